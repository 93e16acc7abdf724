"""Exact attention over several key/value segments with one softmax.

A decoding row sees two segments: its prompt's keys (stored once per prompt and shared by the G rows of
that prompt, so rows are grouped as [prompts, G]) and its own generated keys. Scores of all segments are
concatenated before the softmax, so the result equals attention over the concatenated sequence.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsr.models.layers import MASKED, soft_cap


@dataclasses.dataclass(frozen=True)
class Segment:
    """Keys [N, kv_heads, head_dim, S], values [N, kv_heads, S, head_dim], and which of them each query
    may see.

    `shared=True`: N is the number of prompts, row b belongs to prompt b // (B // N) (G = B // N rows per
    prompt), and `mask` is [N, S] (the same for every query of the prompt's rows) or, where queries see
    different keys of the prompt (a sliding window), [N, G, T, S] (per query). `shared=False`: N == B
    and `mask` is [B, T, S] (per query).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    shared: bool

    @classmethod
    def from_projections(cls, k: jax.Array, v: jax.Array, mask: jax.Array, shared: bool = False) -> Segment:
        """A segment from fresh projections k, v: [N, S, kv_heads, head_dim] (put in cache layout)."""
        return cls(k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask, shared)


def attend(q: jax.Array, segments: list[Segment], scale: float, softcap: float | None = None) -> jax.Array:
    """q: [B, T, heads, head_dim] → [B, T, heads, head_dim].

    Scores are q·k·scale, soft-capped to softcap·tanh(s / softcap) when `softcap` is given (Gemma 2).

    Queries are laid out per KV head as [B, kv_heads, T·R, head_dim] (R query heads share a KV head), so
    every product is a plain batched matmul over (row, kv head); a degenerate T=1 axis inside the
    contraction makes XLA:CPU several times slower."""
    B, T, H, D = q.shape
    K = segments[0].k.shape[1]
    R = H // K
    M = T * R
    rows = q.reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4).reshape(B, K, M, D)
    scores = []
    for seg in segments:
        S = seg.k.shape[-1]
        if seg.shared:
            P = seg.k.shape[0]
            grouped = _to_prompt_groups(rows, P)
            s = jnp.einsum("pkmd,pkds->pkms", grouped, seg.k, preferred_element_type=jnp.float32)
            if seg.mask.ndim == 2:
                mask = seg.mask[:, None, None, :]
            else:  # per query [P, G, T, S], laid out as the grouped queries (g, t, r)
                G = B // P
                mask = jnp.broadcast_to(seg.mask[:, :, :, None, :], (P, G, T, R, S)).reshape(P, 1, G * M, S)
            s = jnp.where(mask, soft_cap(s * scale, softcap), MASKED)
            s = _from_prompt_groups(s, B)
        else:
            s = jnp.einsum("bkmd,bkds->bkms", rows, seg.k, preferred_element_type=jnp.float32)
            n = seg.mask.shape[0]
            mask = jnp.broadcast_to(seg.mask[:, None, :, None, :], (n, 1, T, R, S)).reshape(n, 1, M, S)
            s = jnp.where(mask, soft_cap(s * scale, softcap), MASKED)
        scores.append(s)
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.zeros((B, K, M, D), jnp.float32)
    start = 0
    for seg in segments:
        S = seg.k.shape[-1]
        p = probs[..., start : start + S].astype(seg.v.dtype)
        start += S
        if seg.shared:
            P = seg.k.shape[0]
            o = jnp.einsum(
                "pkms,pksd->pkmd", _to_prompt_groups(p, P), seg.v, preferred_element_type=jnp.float32
            )
            out = out + _from_prompt_groups(o, B)
        else:
            out = out + jnp.einsum("bkms,bksd->bkmd", p, seg.v, preferred_element_type=jnp.float32)
    out = out.reshape(B, K, T, R, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, D).astype(q.dtype)


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
