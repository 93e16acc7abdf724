"""Build a module's parameter state from converted arrays, placing each on its mesh shards directly."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.loading.files import CheckpointError
from jaxsr.sharding import param_sharding


def path_name(path: tuple[str | int, ...]) -> str:
    """'blocks/3/attn/q': a parameter path as text (error messages, cache keys)."""
    return "/".join(map(str, path))


def place_params(
    make_module, arrays: Mapping[tuple[str, ...], np.ndarray], dtype, mesh: Mesh | None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Fill the (abstract, never initialised) state of `make_module()` from `arrays`.

    Floating arrays of floating parameters are cast to `dtype` on the host; any other parameter (an int8
    weight) takes only an array of its own dtype, so quantized and float weights are never mistaken for
    each other. With a mesh each array goes straight to its shards (`device_put` with a
    `NamedSharding`), so no device ever holds a full replica first.
    """
    graph, abstract = nnx.split(nnx.eval_shape(make_module))
    flat = nnx.to_flat_state(abstract)
    expected = {path for path, _ in flat}
    for path in arrays:
        if path not in expected:
            raise CheckpointError(f"converted parameter {path_name(path)} has no place in the module")
    leaves = []
    for path, variable in flat:
        if path not in arrays:
            raise CheckpointError(f"missing parameter {path_name(path)}")
        value = np.asarray(arrays[path])
        if value.shape != variable.shape:
            raise CheckpointError(
                f"parameter {path_name(path)}: checkpoint shape {value.shape} != expected {variable.shape}"
            )
        floating = value.dtype.kind == "f" or value.dtype == jnp.bfloat16
        if floating and jnp.issubdtype(variable.dtype, jnp.floating):
            value = value.astype(jnp.dtype(dtype))
        elif value.dtype != variable.dtype:
            raise CheckpointError(
                f"parameter {path_name(path)}: a {value.dtype} array for a {variable.dtype} parameter"
            )
        if mesh is None:
            array = jax.device_put(value)
        else:
            array = jax.device_put(value, param_sharding([str(p) for p in path], value.shape, mesh))
        leaves.append((path, variable.replace(array)))
    return graph, nnx.from_flat_state(leaves)
