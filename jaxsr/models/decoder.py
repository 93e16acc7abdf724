"""The decoder-only transformer (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, GPT-2) as a Flax NNX
module.

Each layer owns its weights and its KV cache arrays, and the layer loop is unrolled: a decode step is
memory-bound, and a `lax.scan` over stacked [layers, ...] weights and caches copies every layer's slice
out of the stack on every token (measured 2× slower at batch 1 on CPU). Two entry points cover every use:

- `prefill(tokens, mask)`: left-padded prompts, causal attention in blocks of queries (memory linear in
  the prompt length); returns final hidden states and a `PromptCache` (a plain forward pass is a
  prefill whose cache is dropped).
- `decode(tokens, positions, prompt_cache, rows)`: T new tokens per row; each row attends to its prompt's
  shared cache and to its own `RowCache`, into which the new keys/values are written at `rows.length`.

Sliding attention windows (`DecoderConfig.sliding_window`) are applied as transformers applies them:
in a windowed layer (`DecoderConfig.sliding_layers`) key k is visible to query q iff k <= q and
q - k < W (the query sees W keys, itself included). Decoding builds the windowed masks once per call and
shares them between the windowed layers; other layers, and models without a window, use the plain causal
masks. Prefill builds each block's rows of its masks where it attends (`_prefill_mask`).

With `DecoderConfig.kv_dtype="int8"` both caches hold int8 keys and values with float32 scales
(`jaxsr.models.cache`), and prefill attends to its keys/values as stored, as decoding does.

With `DecoderConfig.weights_dtype="int8"` the matrices `QUANTIZED` names are int8 parameters, each with
a `<name>_scale` parameter over its output channels beside it (`attn/q` and `attn/q_scale`); every product
with them is `jaxsr.models.layers.contract`'s.

A reduced output layer (`DecoderConfig.head_token_ids`) scores only its K ids: `head_logits` gives
those K columns, `logits` scatters them into the vocabulary with -inf elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.models.attention import PREFILL_BLOCK, Segment, attend, attend_blocks
from jaxsr.models.cache import PromptCache, RowCache, cache_layout
from jaxsr.models.config import DecoderConfig
from jaxsr.models.layers import (
    ACTIVATIONS,
    Norm,
    apply_rope,
    contract,
    dequantize_weight,
    param,
    quantize_weight,
    rope_inverse_frequencies,
    soft_cap,
)

QUANTIZED: dict[tuple[str, ...], tuple[int, ...]] = {
    ("attn", "q"): (0,),
    ("attn", "k"): (0,),
    ("attn", "v"): (0,),
    ("attn", "o"): (0, 1),
    ("mlp", "gate"): (0,),
    ("mlp", "up"): (0,),
    ("mlp", "down"): (0,),
    ("embed",): (1,),
    ("lm_head",): (0,),
}
"""The matrices int8 weights (`DecoderConfig.weights_dtype`) store as int8, by the last names of their
path, with the axes their products contract; the scale beside each spans the others (its output
channels). The token embedding's scale is per token: a row of the table, a column of the tied head."""
ParamPath = tuple[str | int, ...]


def quantized_axes(path: ParamPath) -> tuple[int, ...] | None:
    """The contracted axes of the matrix at `path` when int8 weights store it as int8, else None."""
    names = tuple(map(str, path))
    return QUANTIZED.get(names[-2:], QUANTIZED.get(names[-1:]))


def scale_path(path: ParamPath) -> ParamPath:
    """Where the scale of the int8 matrix at `path` lives: `attn/q` → `attn/q_scale`."""
    return (*path[:-1], f"{path[-1]}_scale")


def quantize_arrays(arrays: Mapping[ParamPath, Any]) -> dict[ParamPath, Any]:
    """A decoder's parameters by path with each matrix `QUANTIZED` names as int8 and its float32 scale
    beside it (numpy arrays stay on the host)."""
    out = {}
    for path, w in arrays.items():
        contracted = quantized_axes(path)
        if contracted is None:
            out[path] = w
        else:
            out[path], out[scale_path(path)] = quantize_weight(w, contracted)
    return out


def dequantize_arrays(arrays: Mapping[ParamPath, Any], dtype) -> dict[ParamPath, Any]:
    """`quantize_arrays`' inverse up to rounding: each int8 matrix as the `dtype` weight it stands for."""
    scales = {scale_path(path) for path in arrays if quantized_axes(path) is not None}
    out = {}
    for path, w in arrays.items():
        contracted = quantized_axes(path)
        if contracted is not None:
            out[path] = dequantize_weight(w, arrays[scale_path(path)], contracted, dtype)
        elif path not in scales:
            out[path] = w
    return out


def _matrix(
    rngs: nnx.Rngs, cfg: DecoderConfig, name: tuple[str, ...], shape: tuple[int, ...], dtype
) -> tuple[nnx.Param, nnx.Param | None]:
    """A random matrix `name` of `shape` and its scale: int8 and a scale in `dtype` when the config
    quantizes weights, else the float matrix and None."""
    w = param(rngs, shape, dtype)
    if not cfg.quantized_weights:
        return w, None
    q, scale = quantize_weight(w[...], QUANTIZED[name])
    return nnx.Param(q), nnx.Param(scale.astype(dtype))


def _prefill_mask(mask: jax.Array, window: int | None, start: jax.Array | int, queries: int) -> jax.Array:
    """Which keys queries start + [0, queries) of left-padded prompts see, [P, queries, S]: the unpadded
    (`mask` [P, S]) keys at or before the query and, with a window W, fewer than W slots before it
    (distances in slots, as transformers: position distances of padded rows)."""
    query, key = start + jnp.arange(queries), jnp.arange(mask.shape[1])
    seen = mask[:, None, :] & (query[:, None] >= key)[None]
    return seen & ~((query - window)[:, None] >= key)[None] if window else seen


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, dtype, rngs: nnx.Rngs):
        d, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q, self.q_scale = _matrix(rngs, cfg, ("attn", "q"), (d, H, D), dtype)
        self.k, self.k_scale = _matrix(rngs, cfg, ("attn", "k"), (d, K, D), dtype)
        self.v, self.v_scale = _matrix(rngs, cfg, ("attn", "v"), (d, K, D), dtype)
        self.o, self.o_scale = _matrix(rngs, cfg, ("attn", "o"), (H, D, d), dtype)
        bias = cfg.qkv_bias
        self.q_bias = param(rngs, (H, D), dtype) if bias else None
        self.k_bias = param(rngs, (K, D), dtype) if bias else None
        self.v_bias = param(rngs, (K, D), dtype) if bias else None
        self.o_bias = param(rngs, (d), dtype) if cfg.out_bias else None
        norm = dict(kind="rms", eps=cfg.norm_eps, dtype=dtype, unit_offset=cfg.norm_unit_offset)
        self.q_norm = Norm((D), **norm) if cfg.qk_norm else None
        self.k_norm = Norm((D), **norm) if cfg.qk_norm else None

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q = contract("btd,dhk->bthk", x, self.q, self.q_scale)
        k = contract("btd,dhk->bthk", x, self.k, self.k_scale)
        v = contract("btd,dhk->bthk", x, self.v, self.v_scale)
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        out = contract("bthk,hkd->btd", attn, self.o, self.o_scale)
        return out + self.o_bias[...] if self.o_bias is not None else out


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, dtype, rngs: nnx.Rngs):
        d, F = cfg.hidden_size, cfg.intermediate_size
        self.activation = cfg.activation
        gated = cfg.mlp == "gated"
        self.gate, self.gate_scale = (
            _matrix(rngs, cfg, ("mlp", "gate"), (d, F), dtype) if gated else (None, None)
        )
        self.up, self.up_scale = _matrix(rngs, cfg, ("mlp", "up"), (d, F), dtype)
        self.down, self.down_scale = _matrix(rngs, cfg, ("mlp", "down"), (F, d), dtype)
        self.up_bias = param(rngs, (F), dtype) if cfg.mlp_bias else None
        self.gate_bias = param(rngs, (F), dtype) if cfg.mlp_bias and self.gate else None
        self.down_bias = param(rngs, (d), dtype) if cfg.mlp_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        up = contract("...d,df->...f", x, self.up, self.up_scale)
        if self.up_bias is not None:
            up = up + self.up_bias[...]
        if self.gate is not None:
            gate = contract("...d,df->...f", x, self.gate, self.gate_scale)
            if self.gate_bias is not None:
                gate = gate + self.gate_bias[...]
            h = act(gate) * up
        else:
            h = act(up)
        out = contract("...f,fd->...d", h, self.down, self.down_scale)
        return out + self.down_bias[...] if self.down_bias is not None else out


def _norm(cfg: DecoderConfig, dtype) -> Norm:
    """A norm over the hidden size, of the config's kind and convention."""
    offset = cfg.norm_unit_offset
    return Norm((cfg.hidden_size,), kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype, unit_offset=offset)


class Block(nnx.Module):
    """One pre-norm transformer layer; with `sandwich_norm` its attention and MLP outputs are normed
    as well before they join the residual stream."""

    def __init__(self, cfg: DecoderConfig, *, dtype, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = _norm(cfg, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.attn_out_norm = _norm(cfg, dtype) if cfg.sandwich_norm else None
        self.mlp_out_norm = _norm(cfg, dtype) if cfg.sandwich_norm else None


class Decoder(nnx.Module):
    def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed, self.embed_scale = _matrix(
            rngs, cfg, ("embed",), (cfg.vocab_size, cfg.hidden_size), dtype
        )
        learned = cfg.position == "learned"
        self.pos_embed = (
            param(rngs, (cfg.max_position_embeddings, cfg.hidden_size), dtype) if learned else None
        )
        self.blocks = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, dtype)
        has_head = not cfg.tie_word_embeddings and not cfg.is_reward_model
        head = (cfg.hidden_size, cfg.head_size)
        self.lm_head, self.lm_head_scale = (
            _matrix(rngs, cfg, ("lm_head",), head, dtype) if has_head else (None, None)
        )
        self.score = param(rngs, (cfg.hidden_size, cfg.num_labels), dtype) if cfg.num_labels else None

    def use_kv_dtype(self, kv_dtype: str | None) -> None:
        """Store keys and values as `kv_dtype` from now on (`DecoderConfig.kv_dtype`, checked there)."""
        self.config = dataclasses.replace(self.config, kv_dtype=kv_dtype)

    # -- pieces -------------------------------------------------------------------------------
    def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.embed_scale is not None:  # int8 rows times their tokens' scales
            x = (x * jnp.take(self.embed_scale[...], tokens, axis=0)[..., None]).astype(self.dtype)
        if self.config.scale_embeddings:  # sqrt(d) rounded to the table's dtype, as transformers does
            x = x * jnp.asarray(np.float32(self.config.hidden_size**0.5)).astype(x.dtype)
        if self.pos_embed is not None:
            x = x + jnp.take(self.pos_embed[...], positions, axis=0)
        return x

    def _inverse_frequencies(self, layer: int) -> np.ndarray:
        """RoPE of `layer`: Gemma 3's windowed layers have their own base and no scaling."""
        cfg = self.config
        if cfg.local_rope_theta is not None and cfg.is_windowed(layer):
            return rope_inverse_frequencies(cfg.head_dim, cfg.local_rope_theta, None)
        return rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def _qkv(self, layer: int, x: jax.Array, positions: jax.Array):
        block = self.blocks[layer]
        q, k, v = block.attn.project(block.attn_norm(x))
        if self.config.position == "rope":
            inv = self._inverse_frequencies(layer)
            q, k = apply_rope(q, positions, inv), apply_rope(k, positions, inv)
        return q, k, v

    def _finish_block(self, block: Block, x: jax.Array, attn: jax.Array) -> jax.Array:
        out = block.attn.output(attn)
        x = x + (block.attn_out_norm(out) if block.attn_out_norm is not None else out)
        out = block.mlp(block.mlp_norm(x))
        return x + (block.mlp_out_norm(out) if block.mlp_out_norm is not None else out)

    @property
    def _score_scale(self) -> float:
        """What attention scores q·k are multiplied by."""
        return (self.config.query_pre_attn_scalar or self.config.head_dim) ** -0.5

    def _attend(self, q: jax.Array, segments: list[Segment]) -> jax.Array:
        """Attention with the config's score scale and soft-cap."""
        return attend(q, segments, self._score_scale, self.config.attn_logit_softcapping)

    @property
    def _any_windowed(self) -> bool:
        return bool(self.config.sliding_layers)

    # -- entry points -------------------------------------------------------------------------
    def prefill(
        self, tokens: jax.Array, mask: jax.Array, query_block: int = PREFILL_BLOCK
    ) -> tuple[jax.Array, PromptCache]:
        """tokens, mask: [P, S] (left-padded). Returns final hidden [P, S, d] and the prompt cache.

        Attention runs in blocks of `query_block` queries (`jaxsr.models.attention.attend_blocks`), so
        its memory grows linearly in S; prompts of at most `query_block` slots are one block. Hidden
        states and cache entries of padding slots depend on the blocks (no real token sees them)."""
        mask = mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
        cfg = self.config
        x = self._embed(tokens, positions)
        layers = []
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(layer, x, positions)
            # an int8 cache is attended to as stored, as decoding will attend to it
            kv = cache_layout(k, v, cfg.quantized_kv)
            window = cfg.sliding_window if cfg.is_windowed(layer) else None
            visible = partial(_prefill_mask, mask, window)
            softcap = cfg.attn_logit_softcapping
            attn = attend_blocks(q, kv, visible, query_block, self._score_scale, softcap, window)
            x = self._finish_block(block, x, attn)
            layers.append(kv)
        return self.final_norm(x), PromptCache.of_layers(layers, mask, tokens)

    def decode(
        self, tokens: jax.Array, positions: jax.Array, prompt: PromptCache, rows: RowCache
    ) -> tuple[jax.Array, RowCache]:
        """tokens, positions: [B, T]; B is a multiple of the prompt count (rows grouped by prompt).

        New keys go to slots rows.length + [0, T) (there must be room: slots past the capacity are
        dropped, and not attended to); the returned cache keeps `length` unchanged — the caller
        advances it by what it accepts (all T for plain sampling, fewer after a rejection).

        Rows are contiguous after their prompt: with L the prompt's length, row slot j holds position
        L + j and query t of row b is position L + rows.length[b] + t (as `jaxsr.decoding.steps.forward`
        builds `positions`); slot s of the left-padded prompt buffer of S slots holds position
        s - (S - L). Sliding windows are measured in these terms.
        """
        B, T = tokens.shape
        # query t of row b sees its cached slots and the new tokens up to itself
        visible = (
            jnp.arange(rows.capacity)[None, None, :] <= rows.length[:, None, None] + jnp.arange(T)[:, None]
        )
        if self._any_windowed:
            # query t of row b is at row slot i = length + t (position L + i); row slot j is i - j back,
            # prompt slot s is i + S - s back: W or more back is out of the window
            W = self.config.sliding_window
            P, S = prompt.mask.shape
            i = (rows.length[:, None] + jnp.arange(T)[None, :])[:, :, None]
            row_local = visible & (i - jnp.arange(rows.capacity)[None, None, :] < W)
            near = i + (S - jnp.arange(S))[None, None, :] < W
            prompt_local = prompt.mask[:, None, None, :] & near.reshape(P, B // P, T, S)
        x = self._embed(tokens, positions)
        layers = []
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(layer, x, positions)
            # write first, then attend over the written cache: the read depends on the write, so a
            # donated cache is updated in place (reading first makes XLA copy it to order the two)
            kv = rows.write_layer(layer, k, v)
            windowed = self.config.is_windowed(layer)
            seen, own = (prompt_local, row_local) if windowed else (prompt.mask, visible)
            segments = [Segment.of(prompt.layer(layer), seen, shared=True), Segment.of(kv, own)]
            x = self._finish_block(block, x, self._attend(q, segments))
            layers.append(kv)
        return self.final_norm(x), rows.with_layers(layers)

    def head_logits(self, hidden: jax.Array) -> jax.Array:
        """The output layer's logits [..., head_size] in float32 (soft-capped where the config says
        so): column j scores `head_token_ids[j]`, or id j for a full head (then equal to `logits`)."""
        if self.lm_head is None:  # tied: contract with the [V, D] table as stored, no transposed copy
            w, scale, spec = self.embed, self.embed_scale, "...d,vd->...v"
        else:
            w, scale, spec = self.lm_head, self.lm_head_scale, "...d,dv->...v"
        f32 = jnp.float32
        logits = jnp.einsum(spec, hidden, w[...].astype(hidden.dtype), preferred_element_type=f32)
        if scale is not None:
            logits = logits * scale[...].astype(f32)
        return soft_cap(logits, self.config.final_logit_softcapping)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Language-model logits [..., vocab_size] in float32; ids outside `head_token_ids` get -inf."""
        scored = self.head_logits(hidden)
        ids = self.config.head_token_ids
        if ids is None:
            return scored
        full = jnp.full((*scored.shape[:-1], self.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., np.asarray(ids)].set(scored, indices_are_sorted=True, unique_indices=True)

    def scores(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        """Reward-head outputs [B, num_labels] (float32) at each row's last non-pad token."""
        last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1].astype(bool), axis=1)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return jnp.einsum("bd,dn->bn", h, self.score[...], preferred_element_type=jnp.float32)
