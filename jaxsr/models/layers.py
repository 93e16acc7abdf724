"""Building blocks shared by the decoder and the encoder: norms, activations, rotary embeddings, and the
int8 weights of `DecoderConfig.weights_dtype` (`quantize_weight`, `contract`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.models.config import LinearRopeScaling, RopeScaling

MASKED = -1e30  # finite, so a query with no visible key gives uniform weights instead of NaN
INT8_MAX = 127


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def quantize_weight(w: Any, contracted: tuple[int, ...]) -> tuple[Any, Any]:
    """w → (int8 q, float32 scale) with w ≈ q · scale: symmetric absmax over the `contracted` (input) axes,
    so each output channel keeps its own range; the scale has w's shape without those axes. numpy in,
    numpy out (a load quantizes on the host), else jax."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(np.float32)
    scale = xp.max(xp.abs(w), axis=contracted) / INT8_MAX
    divisor = xp.expand_dims(xp.where(scale > 0, scale, 1.0), contracted)
    q = xp.clip(xp.round(w / divisor), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_weight(q: jax.Array, scale: jax.Array, contracted: tuple[int, ...], dtype) -> jax.Array:
    """The float weight in `dtype` that int8 `q` with its per-channel `scale` stands for."""
    return (q.astype(jnp.float32) * jnp.expand_dims(scale.astype(jnp.float32), contracted)).astype(dtype)


def contract(spec: str, x: jax.Array, w: nnx.Param, scale: nnx.Param | None) -> jax.Array:
    """`einsum(spec, x, w)` in x's dtype. An int8 `w` enters the product as int8 converted to x's dtype and
    its per-output-channel `scale` multiplies the float32 result, rounded once to x's dtype: the weight is
    never dequantized. On a TPU the product takes the int8 operand itself (one fusion with the scaling);
    XLA:CPU writes a float copy of one matrix at a time before its product."""
    if scale is None:
        return jnp.einsum(spec, x, w[...])
    y = jnp.einsum(spec, x, w[...].astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale[...].astype(jnp.float32)).astype(x.dtype)


class Norm(nnx.Module):
    """RMSNorm (Llama family) or LayerNorm (GPT-2, BERT), computed in float32.

    `unit_offset`: Gemma's RMSNorm, which multiplies by (1 + scale) in float32 before rounding to the
    input's dtype (Llama rounds first, then multiplies by scale); `scale` starts at 0.
    """

    def __init__(
        self, shape: tuple[int, ...], *, kind: str, eps: float, dtype: jnp.dtype, unit_offset: bool = False
    ):
        self.kind = kind
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)(shape, dtype))
        self.bias = nnx.Param(jnp.zeros(shape, dtype)) if kind == "layer" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        if self.kind == "layer":
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        h = h.astype(x.dtype) * self.scale[...]
        if self.bias is not None:
            h = h + self.bias[...]
        return h


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap·tanh(x / cap): smoothly bounds x to (-cap, cap) (Gemma 2); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | None
) -> np.ndarray:
    """Inverse frequencies of rotate-half RoPE, with Llama 3's or linear scaling when given."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    if isinstance(scaling, LinearRopeScaling):
        return (inv / scaling.factor).astype(np.float32)
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate [B, T, heads, head_dim] by the angle of each token's position (rotate-half layout)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
