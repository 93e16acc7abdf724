"""`Model` and `RewardModel`: a loaded decoder (graph + parameters) with its tokenizer.

The module is split once into a graph definition and a parameter state; every jitted function takes
the parameters as an argument (never a closed-over constant) and re-merges the graph at trace time.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.checks import is_int
from jaxsr.models.config import DecoderConfig, check_weights_dtype
from jaxsr.models.decoder import Decoder, dequantize_arrays, quantize_arrays
from jaxsr.sharding import param_sharding, place_rows


@partial(jax.jit, static_argnums=0)
def _logits(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(tokens, mask)
    return module.logits(hidden)


@partial(jax.jit, static_argnums=0)
def _scores(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(tokens, mask)
    return module.scores(hidden, mask)[:, 0]


def _rectangular(name: str, value: Any, what: str) -> np.ndarray:
    """`value` as a numpy array, or a ValueError naming `name` when its rows differ in length."""
    try:
        return np.asarray(value)
    except ValueError:  # numpy: "setting an array element with a sequence" (ragged rows)
        raise ValueError(f"{name}: expected a rectangular [batch, length] array of {what}") from None


def _python_ints(value: Any, array: np.ndarray) -> np.ndarray | None:
    """A list of Python ints that numpy read as floats or objects (ids past int64, or a mix of negative
    ids and ids past int64) as an object array of its ints; None when an entry is not an int."""
    if isinstance(value, np.ndarray | np.generic | jax.Array) or array.dtype.kind not in "fO":
        return None
    objects = np.asarray(value, dtype=object)
    if objects.shape != array.shape:
        return None
    flat = objects.ravel().tolist()
    if all(is_int(i) for i in flat):
        return objects
    return None


def id_array(name: str, value: Any, limit: int | None = None) -> np.ndarray:
    """A non-empty [B, T] batch of integer ids as int32, each in [0, `limit`) (default: 2**31) — checked
    on the values as given, before any cast, so an id past int32 is refused rather than wrapped."""
    limit = 2**31 if limit is None else min(limit, 2**31)
    array = _rectangular(name, value, "ids")
    ints = array if array.dtype.kind in "iu" else _python_ints(value, array)
    if array.ndim != 2 or array.shape[1] == 0 or ints is None:
        raise TypeError(
            f"{name}: expected a non-empty [batch, length] integer array, got {array.shape} {array.dtype}"
        )
    if ints.size:
        low, high = ints.min(), ints.max()
        if low < 0 or high >= limit:
            raise ValueError(f"{name}: ids must lie in [0, {limit}), got {low if low < 0 else high}")
    return np.asarray(ints, np.int32)


def mask_array(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A 0/1 (or boolean) array of `shape` as int32."""
    mask = _rectangular(name, value, "0/1 values")
    if mask.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected a [batch, length] array of 0/1 values, got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (that of token_ids), got {mask.shape}")
    if not ((mask == 0) | (mask == 1)).all():
        bad = mask[(mask != 0) & (mask != 1)].ravel()[0]
        raise ValueError(f"{name}: expected only 0 (padding) and 1 (token), got {bad}")
    return mask.astype(np.int32)


def as_token_batch(
    token_ids: Any, attention_mask: Any = None, *, vocab_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Validate a [B, T] integer batch (ids in [0, `vocab_size`) when given) and its 0/1 mask (all ones
    by default)."""
    tokens = id_array("token_ids", token_ids, vocab_size)
    mask = (
        np.ones_like(tokens)
        if attention_mask is None
        else mask_array("attention_mask", attention_mask, tokens.shape)
    )
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)


@dataclasses.dataclass
class Model:
    """A causal language model ready for jitted use: `graph` + `params` (an `nnx.State`)."""

    config: DecoderConfig
    graph: nnx.GraphDef
    params: nnx.State
    tokenizer: Any = None
    mesh: Mesh | None = None
    name: str = ""
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_module(
        cls, module: Decoder, *, tokenizer: Any = None, eos_token_ids: tuple[int, ...] = (), name: str = ""
    ):
        """Wrap an in-memory NNX decoder (e.g. one you just trained) for use with jaxsr."""
        graph, params = nnx.split(module)
        return cls(
            config=module.config,
            graph=graph,
            params=params,
            tokenizer=tokenizer,
            name=name,
            eos_token_ids=tuple(eos_token_ids),
        )

    @property
    def module(self) -> Decoder:
        """The NNX module (a fresh merge; mutate it and `nnx.split` again to change parameters)."""
        return nnx.merge(self.graph, self.params)

    @property
    def dtype(self) -> jnp.dtype:
        """The parameters' dtype (the activations'; int8 weights keep their scales in it)."""
        return self.params["final_norm"]["scale"].get_value().dtype

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes of K and V that one token position takes in this model's cache (an int8 cache's scales
        included)."""
        return self.config.kv_bytes_per_token(jnp.dtype(self.dtype).itemsize)

    def with_kv_dtype(self, kv_dtype: str | None) -> Model:
        """This model (the same parameters) with its KV cache stored as `kv_dtype`: None (its dtype) or
        `int8` (`DecoderConfig.kv_dtype`)."""
        module = self.module
        module.use_kv_dtype(kv_dtype)
        if module.config == self.config:
            return self
        graph, _ = nnx.split(module)
        return dataclasses.replace(self, config=module.config, graph=graph)

    def with_weights_dtype(self, weights_dtype: str | None) -> Model:
        """This model with its matrices stored as `weights_dtype` (`DecoderConfig.weights_dtype`): `int8`
        quantizes them on the host, as `load_model` does, and places them as it does; None gives back
        float matrices of the values the int8 ones stand for."""
        config = dataclasses.replace(self.config, weights_dtype=check_weights_dtype(weights_dtype))
        if config == self.config:
            return self
        flat = nnx.to_flat_state(self.params)
        if config.quantized_weights:
            arrays = {}
            for path, leaf in flat:  # one float matrix on the host at a time
                arrays |= quantize_arrays({path: np.asarray(leaf.get_value())})
        else:
            arrays = dequantize_arrays({path: leaf.get_value() for path, leaf in flat}, self.dtype)
        graph, abstract = nnx.split(
            nnx.eval_shape(lambda: Decoder(config, dtype=self.dtype, rngs=nnx.Rngs(0)))
        )
        leaves = [
            (path, variable.replace(self._placed(path, arrays[path].astype(variable.dtype))))
            for path, variable in nnx.to_flat_state(abstract)
        ]
        return dataclasses.replace(self, config=config, graph=graph, params=nnx.from_flat_state(leaves))

    def _placed(self, path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        """`x` on the device, placed on this model's mesh as the parameter at `path` is (when it has one)."""
        if self.mesh is None:
            return jax.device_put(x)
        return jax.device_put(x, param_sharding([str(p) for p in path], x.shape, self.mesh))

    def token_batch(self, token_ids: Any, attention_mask: Any = None) -> tuple[jax.Array, jax.Array]:
        """`as_token_batch` with this model's vocabulary, and a length the context holds."""
        tokens, mask = as_token_batch(token_ids, attention_mask, vocab_size=self.config.vocab_size)
        if tokens.shape[1] > self.config.context:
            raise ValueError(
                f"token_ids: length {tokens.shape[1]} exceeds the model's context of {self.config.context}"
            )
        return tokens, mask

    def logits(self, token_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B, T, vocab] float32 logits; left-padded rows allowed (positions count real tokens)."""
        if self.config.is_reward_model:
            raise TypeError("logits: a reward model has no language-model head; use scores()")
        tokens, mask = self.token_batch(token_ids, attention_mask)
        return _logits(self.graph, self.params, *place_rows(self.mesh, tokens, mask))


@dataclasses.dataclass
class RewardModel(Model):
    """A `*ForSequenceClassification` decoder: one scalar per sequence."""

    def scores(self, token_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B] float32 reward read at each row's last non-pad token."""
        tokens, mask = self.token_batch(token_ids, attention_mask)
        return _scores(self.graph, self.params, *place_rows(self.mesh, tokens, mask))
