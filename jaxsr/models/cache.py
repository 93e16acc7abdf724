"""KV cache pytrees.

A prompt is prefilled once and its keys/values are stored once in a `PromptCache`; the rows sampled from
it (N candidates per prompt) keep only their generated tokens in a `RowCache` and attend to both.

Each layer has its own arrays (a tuple over layers), so a decode step reads and updates them in place.
Values are stored as [rows, kv_heads, slots, head_dim]; keys as the devices decode fastest
(`key_slot_axis`): transposed, [rows, kv_heads, head_dim, slots], on CPUs and GPUs, so that both
attention products are plain batched matmuls over (row, head) with no transpose of the cache in the
decode step; as the values on a TPU for float heads of 128 or more (int8 keys stay transposed), whose
layouts put head_dim minor and would copy transposed keys into another layout and back each step to
write a row's new key.

An int8 cache (`DecoderConfig.kv_dtype`) stores keys and values as int8 beside float32 scales
[rows, kv_heads, slots] (`k_scale`, `v_scale`; empty tuples in a float cache): the key (value) of a token
in a KV head is scale · int8, its scale its absmax / 127. Attention applies the scales per slot to the
scores and to the probabilities (`jaxsr.models.attention`), so the cache is never dequantized whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxsr.sharding import constrain, constrain_rows

Layers = tuple[jax.Array, ...]
KV_AXES = ("batch", "kv_heads", None, None)
SCALE_AXES = ("batch", "kv_heads", None)
INT8_MAX = 127
TPU_SLOT_TILE = 8  # a bf16 tile's rows on a TPU: slots of a row cache stored as values (`slot_tile`)


class KV(NamedTuple):
    """One layer's keys [N, kv_heads, head_dim, S] (or [N, kv_heads, S, head_dim]: `key_slot_axis`) and
    values [N, kv_heads, S, head_dim], with their scales [N, kv_heads, S] in an int8 cache (None in a
    float one)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] → (int8 [..., head_dim], float32 scale [...]) with x ≈ int8 · scale: symmetric
    absmax per vector, so every token's key (value) in every KV head keeps its own range."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def key_slot_axis(head_dim: int, quantized: bool) -> int:
    """The slot axis of stored keys of `head_dim` (int8 where `quantized`) for the devices being traced
    for (the mesh `jax.set_mesh` gives, else the default backend): 2 on a TPU with float heads of 128
    or more (a lane row), keys laid out as values, [N, kv_heads, S, head_dim], so that a row's new key
    is one contiguous vector its cache takes in place (transposed, XLA:TPU copied every row cache into
    another layout and back each step: a Qwen3-8B SR plan cut to 2 layers moved 25.4/40.7/36.7 GiB a
    step over its rungs, 19.2/13.8/9.8 as values); else 3, transposed, [N, kv_heads, head_dim, S],
    which XLA:CPU multiplies fastest (keys as values decoded 1.2 times slower on CPU), a TPU lays out
    better for narrower heads (SmolLM2's 64: 45 GiB a step at 512 rows a v5e chip, 73 as values), and
    for int8 keys (the Gemma-2-9B SR job's first rung on a v5e-8: 58.1 GiB a step, 175.9 as values)."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
    return 2 if keys_as_values(head_dim, quantized, platform) else 3


def keys_as_values(head_dim: int, quantized: bool, platform: str) -> bool:
    """Whether keys of `head_dim` (int8 where `quantized`) are stored as values on `platform`'s devices
    (`key_slot_axis`)."""
    return platform == "tpu" and head_dim >= 128 and not quantized


def slot_tile(head_dim: int, quantized: bool, platform: str) -> int:
    """Slots a row cache of such keys is best a multiple of (`Sampler.cache_slots`,
    `search.memory.MemoryPlan`): TPU_SLOT_TILE where `platform` stores keys as values
    (`key_slot_axis`), else 1. XLA:TPU writes a row's new key and value into a bf16 [rows, kv_heads,
    slots, head_dim] cache in place only when its slots fill whole (8, 128) tiles; else it lays the
    caches out with the heads inside and copies every layer's row caches into that layout and back each
    step (a 2-layer Llama-3.1-8B on a v5e-8: rungs of 213 and 219 slots copy them, 208, 216 and 224
    do not)."""
    return TPU_SLOT_TILE if keys_as_values(head_dim, quantized, platform) else 1


def cache_layout(k: jax.Array, v: jax.Array, quantized: bool) -> KV:
    """Fresh projections k, v [N, S, kv_heads, head_dim] as a layer is stored: heads before slots (keys
    transposed where `key_slot_axis` says so), and int8 with their scales when `quantized`."""
    keys = (0, 2, 3, 1) if key_slot_axis(k.shape[3], quantized) == 3 else (0, 2, 1, 3)
    if not quantized:
        return KV(k.transpose(keys), v.swapaxes(1, 2))
    (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
    return KV(k.transpose(keys), v.swapaxes(1, 2), k_scale.swapaxes(1, 2), v_scale.swapaxes(1, 2))


def _layer(cache, layer: int) -> KV:
    """Layer `layer` of a prompt or row cache."""
    if not cache.k_scale:
        return KV(cache.k[layer], cache.v[layer])
    return KV(cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer])


def key_axis(kv: Any) -> int:
    """The slot axis of one layer's keys (`key_slot_axis` of its heads' width and dtype): `kv` is a
    `KV` or anything holding a layer's `v` and `k_scale` (an attention segment)."""
    return key_slot_axis(kv.v.shape[3], kv.k_scale is not None)


def _key_axis(cache) -> int:
    """The slot axis of a prompt or row cache's keys (`key_slot_axis` of its heads' width and dtype)."""
    return key_slot_axis(cache.v[0].shape[3], bool(cache.k_scale))


def _layers(layers: list[KV]) -> dict[str, Layers]:
    """The cache fields holding `layers` (the scales empty in a float cache)."""
    fields = dict(k=tuple(kv.k for kv in layers), v=tuple(kv.v for kv in layers), k_scale=(), v_scale=())
    if layers[0].k_scale is not None:
        fields |= dict(k_scale=tuple(kv.k_scale for kv in layers), v_scale=tuple(kv.v_scale for kv in layers))
    return fields


def _constrained(cache):
    """Under a mesh: rows (prompts) over `data`, KV heads over `model` (the scales as their cache)."""
    pinned = {name: tuple(constrain(x, KV_AXES) for x in getattr(cache, name)) for name in ("k", "v")}
    for name in ("k_scale", "v_scale"):
        pinned[name] = tuple(constrain(x, SCALE_AXES) for x in getattr(cache, name))
    empty = dict.fromkeys(pinned, ())
    return constrain_rows(cache.replace(**empty)).replace(**pinned)


@struct.dataclass
class PromptCache:
    """Per layer: keys [prompts, kv_heads, head_dim, S] (`key_slot_axis`) and values [prompts, kv_heads,
    S, head_dim] of left-padded prompts (and their scales [prompts, kv_heads, S] in an int8 cache)."""

    k: Layers
    v: Layers
    mask: jax.Array
    """[prompts, S] bool, False on left padding."""
    length: jax.Array
    """[prompts] int32, number of real prompt tokens (the position of the first generated token)."""
    k_scale: Layers = ()
    v_scale: Layers = ()
    tokens: jax.Array | None = None
    """[prompts, S] int32 ids the cache holds (what a repetition penalty over the prompt reads)."""

    @classmethod
    def of_layers(cls, layers: list[KV], mask: jax.Array, tokens: jax.Array) -> PromptCache:
        """The cache of prompts `tokens` [prompts, S] (`mask`: False on padding) whose layers hold
        `layers`."""
        length = mask.sum(-1).astype(jnp.int32)
        return cls(**_layers(layers), mask=mask, length=length, tokens=tokens.astype(jnp.int32))

    @property
    def num_prompts(self) -> int:
        return self.mask.shape[0]

    def left_padded(self, slots: int) -> PromptCache:
        """The same prompts in `slots` slots (at least as many as now): empty, masked slots added on
        the left, so that each prompt still ends at the last slot (positions and windows unchanged)."""
        extra = slots - self.mask.shape[1]
        if extra == 0:
            return self

        def pad(x: jax.Array, axis: int) -> jax.Array:
            return jnp.pad(x, [(extra, 0) if a == axis else (0, 0) for a in range(x.ndim)])

        return self.replace(
            k=tuple(pad(k, _key_axis(self)) for k in self.k),
            v=tuple(pad(v, 2) for v in self.v),
            mask=pad(self.mask, 1),
            k_scale=tuple(pad(s, 2) for s in self.k_scale),
            v_scale=tuple(pad(s, 2) for s in self.v_scale),
            tokens=None if self.tokens is None else pad(self.tokens, 1),
        )

    layer = _layer
    constrained = _constrained


@struct.dataclass
class RowCache:
    """Per layer: keys [rows, kv_heads, head_dim, capacity] (`key_slot_axis`) and values [rows, kv_heads,
    capacity, head_dim] of generated tokens (and their scales [rows, kv_heads, capacity] in an int8
    cache).

    Row b's slots [0, length[b]) are valid; rolling back (rejected speculative tokens) or freezing a row
    is done by its `length` alone, never by clearing memory.
    """

    k: Layers
    v: Layers
    length: jax.Array
    k_scale: Layers = ()
    v_scale: Layers = ()

    @classmethod
    def empty_like(cls, prompt: PromptCache, rows: int, capacity: int) -> RowCache:
        """An empty cache for `rows` rows decoding from `prompt` (same model, dtype and layout)."""

        def empty(xs: Layers, axis: int) -> Layers:  # as the prompt's: `rows` rows of `capacity` slots
            return tuple(
                jnp.zeros((rows, *x.shape[1:axis], capacity, *x.shape[axis + 1 :]), x.dtype) for x in xs
            )

        return cls(
            k=empty(prompt.k, _key_axis(prompt)),
            v=empty(prompt.v, 2),
            length=jnp.zeros((rows,), jnp.int32),
            k_scale=empty(prompt.k_scale, 2),
            v_scale=empty(prompt.v_scale, 2),
        )

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

    layer = _layer
    constrained = _constrained

    def write_layer(self, layer: int, k: jax.Array, v: jax.Array) -> KV:
        """Layer `layer` with new keys/values [rows, T, kv_heads, head_dim] stored at slots
        length + [0, T) (quantized in an int8 cache); slots past the capacity are dropped. Inside a
        jitted loop whose state is donated this is an in-place scatter of only the new entries."""
        B, T, K = k.shape[:3]
        slots = self.length[:, None] + jnp.arange(T)[None, :]
        rows = jnp.arange(B)[:, None]
        if _key_axis(self) == 2:  # keys as values: each (row, head, slot)'s vector
            at = at_key = (rows[:, :, None], jnp.arange(K)[None, None, :], slots[:, :, None])
        else:  # advanced indices (row, slot) come first in the indexed shape: [B, T, K, D] and [B, T, K]
            at, at_key = (rows, slice(None), slots), (rows, slice(None), slice(None), slots)
        old = self.layer(layer)
        if old.k_scale is None:
            return KV(old.k.at[at_key].set(k, mode="drop"), old.v.at[at].set(v, mode="drop"))
        (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
        return KV(
            old.k.at[at_key].set(k, mode="drop"),
            old.v.at[at].set(v, mode="drop"),
            old.k_scale.at[at].set(k_scale, mode="drop"),
            old.v_scale.at[at].set(v_scale, mode="drop"),
        )

    def with_layers(self, layers: list[KV]) -> RowCache:
        """This cache holding `layers` (its `length` unchanged)."""
        return self.replace(**_layers(layers))

    def take(self, index: jax.Array, capacity: int | None = None) -> RowCache:
        """Rows at `index` (compaction), optionally with a new slot capacity (kept slots are unchanged):
        every field is gathered by row, and every array with slots cut or padded on its slot axis."""
        capacity = self.capacity if capacity is None else capacity

        def slots(x: jax.Array, axis: int) -> jax.Array:
            x = jax.lax.slice_in_dim(x[index], 0, min(capacity, x.shape[axis]), axis=axis)
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, capacity - x.shape[axis])
            return jnp.pad(x, pad)

        return RowCache(
            k=tuple(slots(k, _key_axis(self)) for k in self.k),
            v=tuple(slots(v, 2) for v in self.v),
            length=self.length[index],
            k_scale=tuple(slots(s, 2) for s in self.k_scale),
            v_scale=tuple(slots(s, 2) for s in self.v_scale),
        )
