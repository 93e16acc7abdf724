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

from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import Decoder
from jaxsr.sharding import place_rows


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


def as_token_batch(token_ids: Any, attention_mask: Any = None) -> tuple[jax.Array, jax.Array]:
    """Validate a [B, T] integer batch and its 0/1 mask (all ones by default)."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(
            "token_ids: expected a non-empty [batch, length] integer array, "
            f"got {tokens.shape} {tokens.dtype}"
        )
    mask = np.ones_like(tokens) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != tokens.shape:
        raise ValueError(f"attention_mask: expected shape {tokens.shape}, got {mask.shape}")
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
        return jax.tree.leaves(self.params)[0].dtype

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes of K and V that one token position takes in this model's cache."""
        return self.config.kv_bytes_per_token(jnp.dtype(self.dtype).itemsize)

    def check_tokens(self, tokens: jax.Array) -> None:
        if int(tokens.max(initial=0)) >= self.config.vocab_size or int(tokens.min(initial=0)) < 0:
            raise ValueError(f"token_ids: ids must lie in [0, {self.config.vocab_size})")
        if tokens.shape[1] > self.config.context:
            raise ValueError(
                f"token_ids: length {tokens.shape[1]} exceeds the model's context of {self.config.context}"
            )

    def logits(self, token_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B, T, vocab] float32 logits; left-padded rows allowed (positions count real tokens)."""
        if self.config.is_reward_model:
            raise TypeError("logits: a reward model has no language-model head; use scores()")
        tokens, mask = as_token_batch(token_ids, attention_mask)
        self.check_tokens(tokens)
        return _logits(self.graph, self.params, *place_rows(self.mesh, tokens, mask))


@dataclasses.dataclass
class RewardModel(Model):
    """A `*ForSequenceClassification` decoder: one scalar per sequence."""

    def scores(self, token_ids: Any, attention_mask: Any = None) -> jax.Array:
        """[B] float32 reward read at each row's last non-pad token."""
        tokens, mask = as_token_batch(token_ids, attention_mask)
        self.check_tokens(tokens)
        return _scores(self.graph, self.params, *place_rows(self.mesh, tokens, mask))
