"""KV cache pytrees.

A prompt is prefilled once and its keys/values are stored once in a `PromptCache`; the rows sampled from
it (N candidates per prompt) keep only their generated tokens in a `RowCache` and attend to both.

Layout: keys are stored transposed, [layers, rows, kv_heads, head_dim, slots], and values as
[layers, rows, kv_heads, slots, head_dim], so both attention products are plain batched matmuls over
(row, head) with no transpose of the cache in the decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxsr.models.config import DecoderConfig


@struct.dataclass
class PromptCache:
    """Keys [layers, prompts, kv_heads, head_dim, S] and values [layers, prompts, kv_heads, S, head_dim]
    of left-padded prompts."""

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
    """Per-row keys [layers, rows, kv_heads, head_dim, capacity] and values [..., capacity, head_dim] of
    generated tokens.

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
        L, K, D = config.num_layers, config.num_kv_heads, config.head_dim
        return cls(
            k=jnp.zeros((L, rows, K, D, capacity), dtype),
            v=jnp.zeros((L, rows, K, capacity, D), dtype),
            length=jnp.zeros((rows,), jnp.int32),
        )

    @classmethod
    def empty_like(cls, prompt: PromptCache, rows: int, capacity: int) -> RowCache:
        """An empty cache for `rows` rows decoding from `prompt` (same model, dtype and layout)."""
        L, _, K, D, _ = prompt.k.shape
        return cls(
            k=jnp.zeros((L, rows, K, D, capacity), prompt.k.dtype),
            v=jnp.zeros((L, rows, K, capacity, D), prompt.v.dtype),
            length=jnp.zeros((rows,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[-1]

    def write(self, k: jax.Array, v: jax.Array) -> RowCache:
        """Store new keys/values [layers, rows, T, kv_heads, head_dim] at slots length + [0, T).

        Slots past the capacity are dropped; `length` is left to the caller. Inside a jitted loop whose
        state is donated this is an in-place scatter of only the new entries."""
        L, B, T = k.shape[:3]
        slots = (self.length[:, None] + jnp.arange(T)[None, :])[None, :, :]
        rows = jnp.arange(B)[None, :, None]
        layers = jnp.arange(L)[:, None, None]
        # advanced indices (layer, row, slot) come first in the indexed shape: [L, B, T, K, D]
        new_k = self.k.at[layers, rows, :, :, slots].set(k, mode="drop")
        new_v = self.v.at[layers, rows, :, slots].set(v, mode="drop")
        return RowCache(k=new_k, v=new_v, length=self.length)

    def take(self, index: jax.Array, capacity: int | None = None) -> RowCache:
        """Rows at `index` (compaction), optionally with a new slot capacity (kept slots are unchanged)."""
        k, v = self.k[:, index], self.v[:, index]
        capacity = self.capacity if capacity is None else capacity
        if capacity < self.capacity:
            k, v = k[..., :capacity], v[:, :, :, :capacity]
        elif capacity > self.capacity:
            extra = capacity - self.capacity
            k = jnp.pad(k, [(0, 0)] * 4 + [(0, extra)])
            v = jnp.pad(v, [(0, 0)] * 3 + [(0, extra), (0, 0)])
        return RowCache(k=k, v=v, length=self.length[index])
