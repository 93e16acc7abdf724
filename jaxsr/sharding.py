"""Meshes and the one table that maps parameter axes onto mesh axes.

Parameters are described by logical axis names (`embed`, `heads`, `mlp`, `vocab`, ...); `RULES` maps
each onto a mesh axis. The candidate batch is split over `data`, heads and MLP columns over `model`. A
dimension that the mesh axis does not divide stays replicated, so any mesh shape loads any model.

Decoding runs under `on_mesh(model)`: inside it, the jitted decode functions pin every per-row array
of their state (tokens, flags, KV caches) to `data` with `constrain`, so each device decodes its own
rows and only the parameters' `model` splits communicate. Without a mesh `constrain` does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

T = TypeVar("T")

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
    ("mlp", "gate_bias"): ("mlp",),
    ("mlp", "up_bias"): ("mlp",),
    # int8 weights' scales (`DecoderConfig.weights_dtype`): split like their matrix's output axes
    ("embed_scale",): ("vocab",),
    ("lm_head_scale",): ("vocab",),
    ("attn", "q_scale"): ("heads", "head_dim"),
    ("attn", "k_scale"): ("kv_heads", "head_dim"),
    ("attn", "v_scale"): ("kv_heads", "head_dim"),
    ("attn", "o_scale"): ("embed",),
    ("mlp", "gate_scale"): ("mlp",),
    ("mlp", "up_scale"): ("mlp",),
    ("mlp", "down_scale"): ("embed",),
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


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh | AbstractMesh
) -> PartitionSpec:
    spec = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is not None and (mesh.shape.get(mesh_axis, 1) == 1 or size % mesh.shape[mesh_axis]):
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


def place_rows(mesh: Mesh | None, *arrays: Any) -> tuple[jax.Array, ...]:
    """Host batches put on `mesh` with their rows split over `data` (as they are without a mesh)."""
    if mesh is None:
        return arrays
    return tuple(jax.device_put(a, batch_sharding(mesh, a.shape)) for a in arrays)


def check_mesh(mesh: Any) -> Mesh | None:
    """A mesh jaxsr can place models on: a `jax.sharding.Mesh` with a `data` and/or `model` axis, all
    of automatic type (jaxsr pins shardings with constraints, which explicit axes refuse)."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if not {"data", "model"} & set(mesh.axis_names):
        raise ValueError(f"mesh: expected axes named 'data' and/or 'model', got {mesh.axis_names}")
    if any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        raise ValueError(
            f"mesh: expected automatic axes, got {mesh.axis_types}; build it with "
            "jaxsr.sharding.make_mesh or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * 2)"
        )
    return mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Inside a jitted function traced under `on_mesh`: pin `x` to the logical `axes`. Else `x`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def constrain_rows(tree: T) -> T:
    """Split the leading (row) axis of every array in `tree` over `data` (scalars stay replicated)."""
    return jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)) if x.ndim else x, tree)


def gather_rows(tree: T, index: jax.Array, take: Callable[[T, jax.Array], T]) -> T:
    """`take(tree, index)`: rows `index` of a pytree whose arrays all lead with the row axis, with the
    rows and the result split over the `data` shards as decoding places them.

    XLA partitions a plain gather across shards by assembling the whole tree (or the whole result) on
    every device — for a batch's KV caches, more memory than a device has. Here each shard gathers, for
    every other shard in turn, the rows that shard's part of the result takes from it, and sends them
    there (a collective-permute of one shard's part, a group of arrays at a time, `RING_GROUPS`): a
    device holds its part of the result, the rows it sends and one group in transit, never the whole.
    Without a mesh, or where the shards do not divide the rows and the result, it is `take` itself."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else data_shards(mesh)
    rows = jax.tree.leaves(tree)[0].shape[0]
    if shards == 1 or rows % shards or index.shape[0] % shards:
        return take(tree, index)
    return jax.shard_map(
        partial(_ring_gather, take=take, shards=shards),
        in_specs=(PartitionSpec("data"), PartitionSpec()),
        out_specs=PartitionSpec("data"),
        axis_names={"data"},
    )(tree, index)


def _ring_gather(part: T, index: jax.Array, *, take: Callable[[T, jax.Array], T], shards: int) -> T:
    """One `data` shard's part of `gather_rows`' result, from the rows `part` this shard holds."""
    shard = jax.lax.axis_index("data")
    held, wanted = jax.tree.leaves(part)[0].shape[0], index.shape[0] // shards
    source = jax.lax.dynamic_slice_in_dim(index, shard * wanted, wanted) // held
    result = None
    for shift in range(shards):
        asked = jax.lax.dynamic_slice_in_dim(index, (shard + shift) % shards * wanted, wanted) - shard * held
        sent, treedef = jax.tree.flatten(take(part, jnp.clip(asked, 0, held - 1)))
        if result is None:
            result = sent
            continue
        came = source == (shard - shift) % shards
        ring = [(i, (i + shift) % shards) for i in range(shards)]
        for group in send_groups(sent, RING_GROUPS):
            moved = jax.lax.ppermute([sent[leaf] for leaf in group], "data", ring)
            for leaf, rows in zip(group, moved, strict=True):
                result[leaf] = rows_where(came, rows, result[leaf])
            # one group in transit at a time: the next is sent (and the next shift's gathered) after
            part, sent, result = jax.lax.optimization_barrier((part, sent, result))
    return jax.tree.unflatten(treedef, result)


RING_GROUPS = 8
"""Groups of arrays `gather_rows` sends in turn at each shift. One array at a time holds least in
transit, but a barrier per array per shift made the compaction of a 42-layer model's 85 cache arrays
compile for minutes on a TPU; eight groups hold at most about an eighth of a shift's rows in transit."""


def send_groups(arrays: Sequence[jax.Array], count: int) -> list[list[int]]:
    """Consecutive array indices in about `count` groups of similar bytes (an array larger than a
    group's share is a group of its own)."""
    sizes = [x.size * x.dtype.itemsize for x in arrays]
    limit = max(max(sizes), sum(sizes) / count)
    groups: list[list[int]] = [[]]
    held = 0
    for index, size in enumerate(sizes):
        if groups[-1] and held + size > limit:
            groups.append([])
            held = 0
        groups[-1].append(index)
        held += size
    return groups


def per_row_shard(f: Callable[..., T], *args: jax.Array) -> T:
    """`f(*args)` for a function of row-led arrays that treats each row alone, run on each `data`
    shard's rows (under a mesh whose `data` axis divides them): a partitioner that cannot split an
    operation by rows (XLA GPU's top-k) would otherwise gather every shard's rows onto each device."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else data_shards(mesh)
    if shards == 1 or any(x.ndim < 2 or x.shape[0] % shards for x in args):  # [rows, ...] only
        return f(*args)
    spec = PartitionSpec("data")
    return jax.shard_map(f, in_specs=spec, out_specs=spec, axis_names={"data"})(*args)


def rows_where(rows: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`a`'s rows where `rows` [B] is True, `b`'s elsewhere (arrays leading with the row axis)."""
    return jnp.where(rows.reshape(-1, *[1] * (a.ndim - 1)), a, b)


def mesh_of(*models: Any) -> Mesh | None:
    """The one mesh the given models (or decoders holding models) are placed on, or None."""
    meshes = {check_mesh(m.mesh) for m in models if getattr(m, "mesh", None) is not None}
    if len(meshes) > 1:
        raise ValueError("mesh: the models are placed on different meshes; load them with the same mesh")
    return meshes.pop() if meshes else None


def local_devices_of(mesh: Mesh | None) -> list:
    """This host's devices a call on `mesh` uses (without a mesh: the first local device)."""
    return jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)


def data_shards(mesh: Mesh | None) -> int:
    """How many ways a batch's rows are split (the mesh's `data` axis; 1 without a mesh)."""
    return 1 if mesh is None else mesh.shape.get("data", 1)


def padded_rows(rows: int, mesh: Mesh | None, groups: int = 1) -> int:
    """`rows` per group rounded up so that `groups` groups of them divide over the `data` shards: a
    decode batch padded with dead rows to this size splits over the shards instead of being replicated
    on each (results are unchanged)."""
    return padded_over(rows, data_shards(mesh), groups)


def padded_over(rows: int, shards: int, groups: int = 1) -> int:
    """`padded_rows` for `shards` `data` shards (the arithmetic alone, for a plan)."""
    step = shards // math.gcd(shards, groups)
    return -(-rows // step) * step


@contextlib.contextmanager
def on_mesh(*models: Any) -> Iterator[Mesh | None]:
    """Trace and run decoding on the models' mesh (a no-op for models on one device)."""
    mesh = mesh_of(*models)
    if mesh is None:
        yield None
        return
    with jax.set_mesh(mesh):
        yield mesh


def shard_model(model: T, mesh: Mesh) -> T:
    """A copy of a loaded `Model`/`RewardModel` with its parameters placed on `mesh` by `RULES` (e.g. a
    model built in memory with `Model.from_module`; `load_model(..., mesh=)` places while loading)."""
    if check_mesh(mesh) is None:
        raise TypeError("mesh: expected a jax.sharding.Mesh, got None")

    def place(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        return jax.device_put(x, param_sharding(_param_names(path), x.shape, mesh))

    return dataclasses.replace(model, params=jax.tree.map_with_path(place, model.params), mesh=mesh)


def _param_names(path: tuple[Any, ...]) -> list[str]:
    """A parameter's path in its module's state: dict keys and list indices (not the `.value` attribute)."""
    return [str(getattr(p, "key", getattr(p, "idx", ""))) for p in path if not hasattr(p, "name")]


def abstract_params(params: T, mesh: Mesh) -> T:
    """`params` (a module's state of arrays or shapes) as `jax.ShapeDtypeStruct`s carrying the
    shardings `shard_model` would place them with on `mesh`: nothing is allocated (`jaxsr.plans`)."""

    def place(path: tuple[Any, ...], x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=param_sharding(_param_names(path), x.shape, mesh)
        )

    return jax.tree.map_with_path(place, params)
