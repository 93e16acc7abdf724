"""Meshes and the one table that maps parameter axes onto mesh axes.

Parameters are described by logical axis names (`embed`, `heads`, `mlp`, `vocab`, ...); `RULES` maps
each onto a mesh axis. The candidate batch is split over `data`, heads and MLP columns over `model`. A
dimension that the mesh axis does not divide stays replicated, so any mesh shape loads any model.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "embed": None,
    "head_dim": None,
    "batch": "data",
}

# Logical axes of each decoder/encoder parameter, by the last names of its path.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed",): ("vocab", "embed"),
    ("pos_embed",): (None, "embed"),
    ("lm_head",): ("embed", "vocab"),
    ("score",): ("embed", None),
    ("attn", "q"): ("embed", "heads", "head_dim"),
    ("attn", "k"): ("embed", "kv_heads", "head_dim"),
    ("attn", "v"): ("embed", "kv_heads", "head_dim"),
    ("attn", "o"): ("heads", "head_dim", "embed"),
    ("attn", "q_bias"): ("heads", "head_dim"),
    ("attn", "k_bias"): ("kv_heads", "head_dim"),
    ("attn", "v_bias"): ("kv_heads", "head_dim"),
    ("mlp", "gate"): ("embed", "mlp"),
    ("mlp", "up"): ("embed", "mlp"),
    ("mlp", "down"): ("mlp", "embed"),
    ("mlp", "gate_bias"): ("mlp"),
    ("mlp", "up_bias"): ("mlp"),
}


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh; `data=-1` takes all devices left after `model`."""
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        if len(devices) % model:
            raise ValueError(f"model={model} does not divide the {len(devices)} devices")
        data = len(devices) // model
    if data * model > len(devices):
        raise ValueError(f"mesh data={data} × model={model} needs more than the {len(devices)} devices")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), ("data", "model"))


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    spec = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is not None and (mesh.shape[mesh_axis] == 1 or size % mesh.shape[mesh_axis]):
            mesh_axis = None
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def param_sharding(path: Sequence[str], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Sharding of one parameter; parameters not in the table are replicated."""
    for n in (2, 1):
        axes = PARAM_AXES.get(tuple(path[-n:]))
        if axes is not None and len(axes) == len(shape):
            return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Split the leading (row) axis over `data` when it divides, replicate otherwise."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh))
