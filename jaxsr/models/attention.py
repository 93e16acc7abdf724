"""Exact attention over several key/value segments with one softmax.

A decoding row sees two segments: its prompt's keys (stored once per prompt and shared by the G rows of
that prompt, so rows are grouped as [prompts, G]) and its own generated keys. Scores of all segments are
concatenated before the softmax, so the result equals attention over the concatenated sequence.

Prefill attends in blocks of queries, one block after another (`attend_blocks`), so long prompts need
memory linear in their length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxsr.models.cache import KV, cache_layout, key_axis
from jaxsr.models.layers import MASKED, soft_cap

PREFILL_BLOCK = 512
"""Most queries per prefill attention block (`attend_blocks`); prompts of at most this many slots are
attended to at once, as before blocking. Up to about 512 slots a prompt's scores [S, S] per head are no
larger than prefill's other temporaries (the MLP's [S, intermediate] activations), so blocks would
save little memory for a loop's costs: the SmolLM2 draft's prefill of 16 prompts of 512 slots holds
122 MB unblocked and 134 MB in blocks of 256. Past it the scores dominate: at 4096 slots, 560 MB
unblocked, 101 MB in blocks of 512, 67 MB in blocks of 256 (CPU, one prompt)."""
PREFILL_LOOPS = 4
"""Most loops over a layer's prefill blocks (`attend_blocks`). A loop reads the keys up to its last
query, so m loops of equal length do (m + 1) / 2m of the products of all keys (5/8 at 4, against the
1/2 of one loop per block); each loop is compiled on its own (about 0.08 s per loop and layer on CPU)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """Keys [N, kv_heads, head_dim, S] (or [N, kv_heads, S, head_dim]: `key_slot_axis`), values
    [N, kv_heads, S, head_dim], and which of them each query may see; an int8 segment has float32
    scales [N, kv_heads, S] (`jaxsr.models.cache`).

    `shared=True`: N is the number of prompts, row b belongs to prompt b // (B // N) (G = B // N rows per
    prompt), and `mask` is [N, S] (the same for every query of the prompt's rows) or, where queries see
    different keys of the prompt (a sliding window), [N, G, T, S] (per query). `shared=False`: N == B
    and `mask` is [B, T, S] (per query).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    shared: bool
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @classmethod
    def of(cls, kv: KV, mask: jax.Array, shared: bool = False) -> Segment:
        """A segment over one cache layer `kv`."""
        return cls(kv.k, kv.v, mask, shared, kv.k_scale, kv.v_scale)

    @classmethod
    def from_projections(cls, k: jax.Array, v: jax.Array, mask: jax.Array, shared: bool = False) -> Segment:
        """A segment from fresh projections k, v: [N, S, kv_heads, head_dim] (put in cache layout)."""
        return cls.of(cache_layout(k, v, quantized=False), mask, shared)


def attend(q: jax.Array, segments: list[Segment], scale: float, softcap: float | None = None) -> jax.Array:
    """q: [B, T, heads, head_dim] → [B, T, heads, head_dim].

    Scores are q·k·scale, soft-capped to softcap·tanh(s / softcap) when `softcap` is given (Gemma 2).

    Queries are laid out per KV head as [B, kv_heads, T·R, head_dim] (R query heads share a KV head), so
    every product is a plain batched matmul over (row, kv head); a degenerate T=1 axis inside the
    contraction makes XLA:CPU several times slower. Int8 keys and values enter the matmuls as q's dtype
    and their scales are applied per slot: to the scores after q·k, and to the probabilities before p·v
    (the weighted sum of scaled values is the sum of scaled weights times the int8 values)."""
    B, T, H, D = q.shape
    K = segments[0].k.shape[1]
    R = H // K
    M = T * R
    rows = q.reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4).reshape(B, K, M, D)
    scores = [_segment_scores(rows, seg, T, scale, softcap) for seg in segments]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.zeros((B, K, M, D), jnp.float32)
    start = 0
    for seg in segments:
        S = seg.v.shape[2]
        out = out + _weighted(probs[..., start : start + S], seg, q.dtype)
        start += S
    out = out.reshape(B, K, T, R, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, D).astype(q.dtype)


def attend_blocks(
    q: jax.Array,
    kv: KV,
    visible: Callable[[jax.Array | int, int], jax.Array],
    block: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Causal self-attention of q [P, S, heads, head_dim] to `kv` (the same S slots, in cache layout) in
    blocks of at most `block` queries: `visible(start, n)` [P, n, S] is which keys queries start + [0, n)
    see, none after the query and, in a window of `window` keys, none `window` or more slots before it.

    The blocks run one after another in at most `PREFILL_LOOPS` loops, so only one block's scores
    [P, kv_heads, block·R, keys] exist at once: temporaries grow linearly in S. A loop reads only the keys
    its queries may see, none past its last query (nor out of the window of its first). Exact up to
    rounding, as each query's softmax is its own; a query that sees no key (left padding) gets uniform
    weights over its loop's keys. S is cut into blocks of equal size, padded with fewer queries than
    blocks (their outputs dropped); at most `block` slots are one block (no loop)."""
    P, S, H, D = q.shape
    if block >= S:
        return attend(q, [Segment.of(kv, visible(0, S))], scale, softcap)
    n = -(-S // block)
    size = -(-S // n)
    padded = jnp.pad(q, ((0, 0), (0, n * size - S), (0, 0), (0, 0)))
    blocks = padded.reshape(P, n, size, H, D).swapaxes(0, 1)
    out = []
    for first, last in _loops(n):
        keys = slice(max(0, first * size - window + 1) if window else 0, min(last * size, S))

        def one(i_rows: tuple[jax.Array, jax.Array], keys: slice = keys) -> jax.Array:
            i, rows = i_rows
            segment = Segment.of(_key_slots(kv, keys), visible(i * size, size)[..., keys])
            return attend(rows, [segment], scale, softcap)

        out.append(jax.lax.map(one, (jnp.arange(first, last), blocks[first:last])))
    return jnp.concatenate(out).swapaxes(0, 1).reshape(P, n * size, H, D)[:, :S]


def _loops(blocks: int) -> list[tuple[int, int]]:
    """[first, last) blocks of each of at most `PREFILL_LOOPS` loops over `blocks` blocks, the longer
    loops first (their keys end sooner). Each has two blocks or more: XLA inlines a loop of one, and
    inlined blocks run side by side, scores and all."""
    m = min(PREFILL_LOOPS, blocks // 2)
    starts = [blocks - blocks * (m - j) // m for j in range(m)]
    return list(zip(starts, [*starts[1:], blocks], strict=True))


def _key_slots(kv: KV, keys: slice) -> KV:
    """Slots `keys` of a layer in cache layout."""
    scales = (None, None) if kv.k_scale is None else (kv.k_scale[..., keys], kv.v_scale[..., keys])
    return KV(
        jax.lax.slice_in_dim(kv.k, keys.start, keys.stop, axis=key_axis(kv)),
        kv.v[:, :, keys],
        *scales,
    )


def _segment_scores(rows: jax.Array, seg: Segment, T: int, scale: float, softcap: float | None) -> jax.Array:
    """Float32 scores [B, K, M, S] of queries `rows` [B, K, M, D] (M = T·R) against the segment's keys:
    q·k (k's scales applied), scaled, soft-capped, and `MASKED` where the query does not see the key.
    A shared segment is computed per prompt group (one matmul against the prompt's keys)."""
    B = rows.shape[0]
    queries = _to_prompt_groups(rows, seg.k.shape[0]) if seg.shared else rows
    keys = seg.k if seg.k_scale is None else seg.k.astype(rows.dtype)
    spec = "nkmd,nkds->nkms" if key_axis(seg) == 3 else "nkmd,nksd->nkms"
    s = jnp.einsum(spec, queries, keys, preferred_element_type=jnp.float32)
    if seg.k_scale is not None:
        s = s * seg.k_scale[:, :, None, :]
    s = jnp.where(_mask(seg, B, T, rows.shape[2] // T), soft_cap(s * scale, softcap), MASKED)
    return _from_prompt_groups(s, B) if seg.shared else s


def _mask(seg: Segment, B: int, T: int, R: int) -> jax.Array:
    """Which keys each query sees, broadcastable to the (grouped) scores of `_segment_scores`."""
    S = seg.v.shape[2]
    if seg.shared and seg.mask.ndim == 2:
        return seg.mask[:, None, None, :]
    if seg.shared:  # per query [P, G, T, S], laid out as the grouped queries (g, t, r)
        P = seg.k.shape[0]
        G = B // P
        return jnp.broadcast_to(seg.mask[:, :, :, None, :], (P, G, T, R, S)).reshape(P, 1, G * T * R, S)
    n = seg.mask.shape[0]
    return jnp.broadcast_to(seg.mask[:, None, :, None, :], (n, 1, T, R, S)).reshape(n, 1, T * R, S)


def _weighted(p: jax.Array, seg: Segment, dtype: jnp.dtype) -> jax.Array:
    """Float32 p·v [B, K, M, D] of the segment's probabilities `p` [B, K, M, S] and values, v's scales
    folded into the probabilities; int8 values enter the matmul as `dtype`."""
    B = p.shape[0]
    if seg.shared:
        p = _to_prompt_groups(p, seg.k.shape[0])
    if seg.v_scale is not None:
        p = p * seg.v_scale[:, :, None, :]
    v = seg.v if seg.v_scale is None else seg.v.astype(dtype)
    o = jnp.einsum("nkms,nksd->nkmd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _from_prompt_groups(o, B) if seg.shared else o


def _to_prompt_groups(x: jax.Array, prompts: int) -> jax.Array:
    """[B, K, M, X] with rows grouped by prompt → [P, K, G·M, X] (each prompt's rows side by side)."""
    B, K, M, X = x.shape
    G = B // prompts
    return x.reshape(prompts, G, K, M, X).transpose(0, 2, 1, 3, 4).reshape(prompts, K, G * M, X)


def _from_prompt_groups(x: jax.Array, rows: int) -> jax.Array:
    """Inverse of `_to_prompt_groups`."""
    P, K, GM, X = x.shape
    G = rows // P
    return x.reshape(P, K, G, GM // G, X).transpose(0, 2, 1, 3, 4).reshape(rows, K, GM // G, X)
