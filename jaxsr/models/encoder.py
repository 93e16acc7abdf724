"""A BERT encoder (`BertModel`, e.g. all-MiniLM-L6-v2) as a Flax NNX module, and its loaded wrapper.

Used for embedding-similarity rewards. Layers are post-norm BERT layers with bidirectional attention
over the non-pad tokens (through the decoder's `attend`). As in the decoder, each layer owns its weights
and the layer loop is unrolled.

Sentence embeddings follow the sentence-transformers pipeline of all-MiniLM-L6-v2 (its modules.json:
Transformer → Pooling(mean) → Normalize): masked mean of the last hidden states, then L2 normalisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.checks import check_positive_int, check_unicode
from jaxsr.ladder import fine_bucket, length_sorted_chunks
from jaxsr.models.attention import Segment, attend
from jaxsr.models.layers import ACTIVATIONS, Norm, param
from jaxsr.models.model import as_token_batch, id_array
from jaxsr.sharding import padded_rows, place_rows


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Shape of a BERT encoder (the fields of a Hugging Face `BertConfig` that change the forward)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: Literal["gelu", "gelu_tanh", "relu", "silu"] = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class SelfAttention(nnx.Module):
    """Multi-head attention with biased projections; every query sees every visible key."""

    def __init__(self, cfg: EncoderConfig, *, dtype, rngs: nnx.Rngs):
        d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q = param(rngs, (d, H, D), dtype)
        self.k = param(rngs, (d, H, D), dtype)
        self.v = param(rngs, (d, H, D), dtype)
        self.o = param(rngs, (H, D, d), dtype)
        self.q_bias = param(rngs, (H, D), dtype)
        self.k_bias = param(rngs, (H, D), dtype)
        self.v_bias = param(rngs, (H, D), dtype)
        self.o_bias = param(rngs, (d), dtype)
        self.scale = D**-0.5

    def __call__(self, x: jax.Array, visible: jax.Array) -> jax.Array:
        """x: [B, T, d]; visible: [B, T, T] (query, key) → [B, T, d]."""
        q = jnp.einsum("btd,dhk->bthk", x, self.q[...]) + self.q_bias[...]
        k = jnp.einsum("btd,dhk->bthk", x, self.k[...]) + self.k_bias[...]
        v = jnp.einsum("btd,dhk->bthk", x, self.v[...]) + self.v_bias[...]
        attn = attend(q, [Segment.from_projections(k, v, visible)], self.scale)
        return jnp.einsum("bthk,hkd->btd", attn, self.o[...]) + self.o_bias[...]


class FeedForward(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, rngs: nnx.Rngs):
        d, F = cfg.hidden_size, cfg.intermediate_size
        self.activation = cfg.activation
        self.up = param(rngs, (d, F), dtype)
        self.up_bias = param(rngs, (F), dtype)
        self.down = param(rngs, (F, d), dtype)
        self.down_bias = param(rngs, (d), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = ACTIVATIONS[self.activation](x @ self.up[...] + self.up_bias[...])
        return h @ self.down[...] + self.down_bias[...]


class Layer(nnx.Module):
    """One post-norm BERT layer."""

    def __init__(self, cfg: EncoderConfig, *, dtype, rngs: nnx.Rngs):
        norm = dict(kind="layer", eps=cfg.layer_norm_eps, dtype=dtype)
        self.attn = SelfAttention(cfg, dtype=dtype, rngs=rngs)
        self.attn_norm = Norm((cfg.hidden_size), **norm)
        self.mlp = FeedForward(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = Norm((cfg.hidden_size), **norm)

    def __call__(self, x: jax.Array, visible: jax.Array) -> jax.Array:
        x = self.attn_norm(x + self.attn(x, visible))
        return self.mlp_norm(x + self.mlp(x))


class Encoder(nnx.Module):
    """Word + position + token-type embeddings with LayerNorm, then the layers."""

    def __init__(self, config: EncoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        d = cfg.hidden_size
        self.embed = param(rngs, (cfg.vocab_size, d), dtype)
        self.pos_embed = param(rngs, (cfg.max_position_embeddings, d), dtype)
        self.type_embed = param(rngs, (cfg.type_vocab_size, d), dtype)
        self.embed_norm = Norm((d,), kind="layer", eps=cfg.layer_norm_eps, dtype=dtype)
        self.layers = nnx.List([Layer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])

    def __call__(self, tokens: jax.Array, mask: jax.Array, token_types: jax.Array | None = None) -> jax.Array:
        """tokens, mask (1 = real token), token_types: [B, T] → last hidden states [B, T, d].

        Positions are 0..T-1 whatever the mask (Hugging Face's default), so pad on the right.
        """
        T = tokens.shape[1]
        if token_types is None:
            token_types = jnp.zeros_like(tokens)
        x = (
            jnp.take(self.embed[...], tokens, axis=0)
            + self.pos_embed[:T][None]
            + jnp.take(self.type_embed[...], token_types, axis=0)
        )
        x = self.embed_norm(x)
        visible = jnp.broadcast_to(mask.astype(bool)[:, None, :], (tokens.shape[0], T, T))
        for layer in self.layers:
            x = layer(x, visible)
        return x

    def sentence_embeddings(
        self, tokens: jax.Array, mask: jax.Array, token_types: jax.Array | None = None
    ) -> jax.Array:
        """L2-normalised masked-mean embeddings [B, d] (float32)."""
        return l2_normalize(mean_pool(self(tokens, mask, token_types), mask))


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of hidden [B, T, d] over the tokens where mask [B, T] is 1 → [B, d] float32.

    Like sentence-transformers' Pooling: the count is clamped at 1e-9, so an empty row gives zeros.
    """
    m = mask.astype(jnp.float32)[..., None]
    total = (hidden.astype(jnp.float32) * m).sum(axis=1)
    return total / jnp.maximum(m.sum(axis=1), 1e-9)


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """x / max(‖x‖₂, eps) along the last axis (torch's F.normalize, used by sentence-transformers)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


@partial(jax.jit, static_argnums=0)
def _hidden(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array, types: jax.Array):
    return nnx.merge(graph, params)(tokens, mask, types)


@partial(jax.jit, static_argnums=0)
def _sentence_embeddings(
    graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array, types: jax.Array
):
    return nnx.merge(graph, params).sentence_embeddings(tokens, mask, types)


@dataclasses.dataclass
class EncoderModel:
    """A loaded encoder: `graph` + `params` (an `nnx.State`) and its transformers tokenizer.

    `max_length` is where texts are truncated (sentence-transformers' `max_seq_length` when the
    checkpoint states one).
    """

    config: EncoderConfig
    graph: nnx.GraphDef
    params: nnx.State
    tokenizer: Any = None
    max_length: int = 512
    mesh: Mesh | None = None
    name: str = ""
    token_forwards: int = 0
    """Token positions run through the encoder by `embed` so far (padding included)."""

    MIN_LENGTH = 8
    """Shortest padded length; longer batches pad to the next power of two."""

    @property
    def module(self) -> Encoder:
        """The NNX module (a fresh merge)."""
        return nnx.merge(self.graph, self.params)

    def hidden(self, token_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> jax.Array:
        """Last hidden states [B, T, d] of a right-padded [B, T] batch (pad positions are not meaningful)."""
        cfg = self.config
        tokens, mask = as_token_batch(token_ids, attention_mask, vocab_size=cfg.vocab_size)
        if tokens.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"token_ids: length {tokens.shape[1]} exceeds the encoder's "
                f"{cfg.max_position_embeddings} positions"
            )
        if token_type_ids is None:
            types = jnp.zeros_like(tokens)
        else:
            types = id_array("token_type_ids", token_type_ids, cfg.type_vocab_size)
            if types.shape != tokens.shape:
                raise ValueError(
                    f"token_type_ids: expected shape {tuple(tokens.shape)} (that of token_ids), "
                    f"got {types.shape}"
                )
            types = jnp.asarray(types)
        return _hidden(self.graph, self.params, *place_rows(self.mesh, tokens, mask, types))

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """int32 tokens and 0/1 mask [len(texts), L], right-padded to L = `fine_bucket(longest)` (at
        least MIN_LENGTH), truncated at `max_length`.

        Padding is done here, not by the tokenizer: all-MiniLM-L6-v2's tokenizer.json pads every text
        to 128 tokens if its own padding setting is left on.
        """
        _check_texts(texts)
        return self._pad(self._token_rows(texts), len(texts))

    def _token_rows(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, truncated at `max_length`, unpadded."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name or 'encoder'}: no tokenizer; call hidden() with token ids")
        enc = self.tokenizer(list(texts), padding=False, truncation=True, max_length=self.max_length)
        return [
            [t for t, m in zip(ids, mask, strict=True) if m]
            for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
        ]

    def _pad(self, rows: list[list[int]], count: int) -> tuple[np.ndarray, np.ndarray]:
        """`rows` right-padded into [count, fine_bucket(longest)] tokens and mask (empty rows after)."""
        width = fine_bucket(max(map(len, rows)), self.MIN_LENGTH, cap=self.config.max_position_embeddings)
        tokens = np.full((count, width), self.tokenizer.pad_token_id or 0, np.int32)
        mask = np.zeros((count, width), np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return tokens, mask

    def embed(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """L2-normalised sentence embeddings [len(texts), d] (float32), `batch_size` texts per call.

        Texts go to the calls shortest first (`length_sorted_chunks`); each call's rows and length are
        padded to rungs of `fine_bucket` (rows also to a multiple of the mesh's `data` shards), so a
        stream of batches pads little and compiles one program per (rows, length) rung.
        """
        _check_texts(texts)
        batch_size = check_positive_int("batch_size", batch_size)
        rows = self._token_rows(texts)
        out = np.zeros((len(texts), self.config.hidden_size), np.float32)
        for chunk in length_sorted_chunks([len(r) for r in rows], batch_size):
            count = padded_rows(fine_bucket(len(chunk), cap=batch_size), self.mesh)  # splits over `data`
            tokens, mask = self._pad([rows[i] for i in chunk], count)
            self.token_forwards += tokens.size
            placed = place_rows(
                self.mesh, jnp.asarray(tokens), jnp.asarray(mask), jnp.zeros(tokens.shape, jnp.int32)
            )
            out[chunk] = np.asarray(_sentence_embeddings(self.graph, self.params, *placed))[: len(chunk)]
        return out


def _check_texts(texts: Any) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a list of strings, got {type(texts).__name__}")
    if not texts:
        raise ValueError("texts: empty list")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}]: expected a string, got a {type(t).__name__}")
        check_unicode(f"texts[{i}]", t)
