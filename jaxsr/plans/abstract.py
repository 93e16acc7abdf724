"""Models without weights: a decoder built from its Hugging Face config alone, its parameters abstract
arrays placed on a mesh by the sharding rules table — the module, graph and shardings a real
`load_model` would give, nothing allocated."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.loading.api import check_dtype, decoder_factory, model_class
from jaxsr.loading.hf_config import decoder_config_from_hf
from jaxsr.models.config import check_weights_dtype
from jaxsr.models.model import Model
from jaxsr.sharding import abstract_params, check_mesh


def abstract_model(
    hf_config: Mapping[str, Any], mesh: Mesh, dtype: str = "bfloat16", weights_dtype: str | None = None
) -> Model:
    """The model a checkpoint with this `config.json` loads as onto `mesh` (any devices, e.g. a TPU
    target's: `jaxsr.plans.targets.target_mesh`) with `weights_dtype` weights, its parameters
    `jax.ShapeDtypeStruct`s."""
    dtype, weights_dtype = check_dtype(dtype), check_weights_dtype(weights_dtype)
    if check_mesh(mesh) is None:
        raise TypeError("mesh: expected a jax.sharding.Mesh, got None")
    config = dataclasses.replace(decoder_config_from_hf(dict(hf_config)), weights_dtype=weights_dtype)
    graph, shapes = nnx.split(nnx.eval_shape(decoder_factory(config, dtype)))
    params = abstract_params(shapes, mesh)
    return model_class(config)(config=config, graph=graph, params=params, mesh=mesh, name="abstract")


def bytes_per_device(tree: Any) -> int:
    """Bytes of one device's shard of every sharded abstract array in `tree` (the largest shard)."""
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
