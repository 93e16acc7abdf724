"""KV cache pytrees.

A prompt is prefilled once and its keys/values are stored once in a `PromptCache`; the rows sampled from
it (N candidates per prompt) keep only their generated tokens in a `RowCache` and attend to both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxsr.models.config import DecoderConfig


@struct.dataclass
class PromptCache:
    """Keys/values of left-padded prompts: `k`, `v` are [layers, prompts, S, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    """[prompts, S] bool, False on left padding."""
    length: jax.Array
    """[prompts] int32, number of real prompt tokens (the position of the first generated token)."""

    @property
    def num_prompts(self) -> int:
        return self.k.shape[1]

    def take(self, index: jax.Array) -> PromptCache:
        """The cache of the prompts at `index` (used to bring one prompt's KV to a search job)."""
        return PromptCache(
            k=self.k[:, index], v=self.v[:, index], mask=self.mask[index], length=self.length[index]
        )


@struct.dataclass
class RowCache:
    """Per-row keys/values of generated tokens: [layers, rows, capacity, kv_heads, head_dim].

    Row b's slots [0, length[b]) are valid; rolling back (rejected speculative tokens) or freezing a row
    is done by its `length` alone, never by clearing memory.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @classmethod
    def empty(
        cls, config: DecoderConfig, rows: int, capacity: int, dtype: jnp.dtype = jnp.float32
    ) -> RowCache:
        shape = (config.num_layers, rows, capacity, config.num_kv_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((rows,), jnp.int32)
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def take(self, index: jax.Array, capacity: int | None = None) -> RowCache:
        """Rows at `index` (compaction), optionally with a new slot capacity (kept slots are unchanged)."""
        k, v = self.k[:, index], self.v[:, index]
        capacity = self.capacity if capacity is None else capacity
        if capacity < self.capacity:
            k, v = k[:, :, :capacity], v[:, :, :capacity]
        elif capacity > self.capacity:
            pad = [(0, 0), (0, 0), (0, capacity - self.capacity), (0, 0), (0, 0)]
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        return RowCache(k=k, v=v, length=self.length[index])
