"""KV cache pytrees.

A prompt is prefilled once and its keys/values are stored once in a `PromptCache`; the rows sampled from
it (N candidates per prompt) keep only their generated tokens in a `RowCache` and attend to both.

Each layer has its own arrays (a tuple over layers), so a decode step reads and updates them in place.
Keys are stored transposed, [rows, kv_heads, head_dim, slots], and values as [rows, kv_heads, slots,
head_dim], so both attention products are plain batched matmuls over (row, head) with no transpose of the
cache in the decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxsr.sharding import constrain, constrain_rows

Layers = tuple[jax.Array, ...]
KV_AXES = ("batch", "kv_heads", None, None)


def _constrained(cache):
    """Under a mesh: rows (prompts) over `data`, KV heads over `model`."""
    k = tuple(constrain(x, KV_AXES) for x in cache.k)
    v = tuple(constrain(x, KV_AXES) for x in cache.v)
    return constrain_rows(cache.replace(k=(), v=())).replace(k=k, v=v)


@struct.dataclass
class PromptCache:
    """Per layer: keys [prompts, kv_heads, head_dim, S] and values [prompts, kv_heads, S, head_dim] of
    left-padded prompts."""

    k: Layers
    v: Layers
    mask: jax.Array
    """[prompts, S] bool, False on left padding."""
    length: jax.Array
    """[prompts] int32, number of real prompt tokens (the position of the first generated token)."""

    @property
    def num_prompts(self) -> int:
        return self.mask.shape[0]

    constrained = _constrained


@struct.dataclass
class RowCache:
    """Per layer: keys [rows, kv_heads, head_dim, capacity] and values [rows, kv_heads, capacity, head_dim]
    of generated tokens.

    Row b's slots [0, length[b]) are valid; rolling back (rejected speculative tokens) or freezing a row
    is done by its `length` alone, never by clearing memory.
    """

    k: Layers
    v: Layers
    length: jax.Array

    @classmethod
    def empty_like(cls, prompt: PromptCache, rows: int, capacity: int) -> RowCache:
        """An empty cache for `rows` rows decoding from `prompt` (same model, dtype and layout)."""
        return cls(
            k=tuple(jnp.zeros((rows, *k.shape[1:3], capacity), k.dtype) for k in prompt.k),
            v=tuple(jnp.zeros((rows, v.shape[1], capacity, v.shape[3]), v.dtype) for v in prompt.v),
            length=jnp.zeros((rows,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-1]

    constrained = _constrained

    def write_layer(
        self, cache_k: jax.Array, cache_v: jax.Array, k: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One layer's cache with new keys/values [rows, T, kv_heads, head_dim] stored at slots
        length + [0, T); slots past the capacity are dropped. Inside a jitted loop whose state is
        donated this is an in-place scatter of only the new entries."""
        B, T = k.shape[:2]
        slots = self.length[:, None] + jnp.arange(T)[None, :]
        rows = jnp.arange(B)[:, None]
        # advanced indices (row, slot) come first in the indexed shape: [B, T, K, D]
        return (
            cache_k.at[rows, :, :, slots].set(k, mode="drop"),
            cache_v.at[rows, :, slots].set(v, mode="drop"),
        )

    def take(self, index: jax.Array, capacity: int | None = None) -> RowCache:
        """Rows at `index` (compaction), optionally with a new slot capacity (kept slots are unchanged)."""
        capacity = self.capacity if capacity is None else capacity
        keep = min(capacity, self.capacity)
        extra = max(capacity - self.capacity, 0)
        k = tuple(jnp.pad(k[index][..., :keep], [(0, 0)] * 3 + [(0, extra)]) for k in self.k)
        v = tuple(jnp.pad(v[index][:, :, :keep], [(0, 0)] * 2 + [(0, extra), (0, 0)]) for v in self.v)
        return RowCache(k=k, v=v, length=self.length[index])
