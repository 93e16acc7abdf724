"""Exact attention over several key/value segments with one softmax.

A decoding row sees two segments: its prompt's keys (stored once per prompt and shared by the G rows of
that prompt, so rows are grouped as [prompts, G]) and its own generated keys. Scores of all segments are
concatenated before the softmax, so the result equals attention over the concatenated sequence.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsr.models.layers import MASKED


@dataclasses.dataclass(frozen=True)
class Segment:
    """Keys [N, kv_heads, head_dim, S], values [N, kv_heads, S, head_dim], and which of them each query
    may see.

    `shared=True`: N is the number of prompts, row b belongs to prompt b // (B // N), and `mask` is
    [N, S]. `shared=False`: N == B and `mask` is [B, T, S] (per query).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    shared: bool

    @classmethod
    def from_projections(cls, k: jax.Array, v: jax.Array, mask: jax.Array, shared: bool = False) -> Segment:
        """A segment from fresh projections k, v: [N, S, kv_heads, head_dim] (put in cache layout)."""
        return cls(k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask, shared)


def attend(q: jax.Array, segments: list[Segment], scale: float) -> jax.Array:
    """q: [B, T, heads, head_dim] → [B, T, heads, head_dim]."""
    B, T, H, D = q.shape
    K = segments[0].k.shape[1]
    q = q.reshape(B, T, K, H // K, D)
    scores = []
    for seg in segments:
        if seg.shared:
            P = seg.k.shape[0]
            qp = q.reshape(P, B // P, T, K, H // K, D)
            s = jnp.einsum("pgtkrd,pkds->pgkrts", qp, seg.k, preferred_element_type=jnp.float32)
            s = jnp.where(seg.mask[:, None, None, None, None, :], s * scale, MASKED)
            s = s.reshape(B, K, H // K, T, -1)
        else:
            s = jnp.einsum("btkrd,bkds->bkrts", q, seg.k, preferred_element_type=jnp.float32)
            s = jnp.where(seg.mask[:, None, None, :, :], s * scale, MASKED)
        scores.append(s)
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.zeros((B, T, K, H // K, D), jnp.float32)
    start = 0
    for seg in segments:
        S = seg.k.shape[-1]
        p = probs[..., start : start + S].astype(seg.v.dtype)
        start += S
        if seg.shared:
            P = seg.k.shape[0]
            p = p.reshape(P, B // P, K, H // K, T, S)
            o = jnp.einsum("pgkrts,pksd->pgtkrd", p, seg.v, preferred_element_type=jnp.float32)
            out = out + o.reshape(B, T, K, H // K, D)
        else:
            out = out + jnp.einsum("bkrts,bksd->btkrd", p, seg.v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)
