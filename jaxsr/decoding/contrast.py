"""The contrast of contrastive decoding: the expert-minus-amateur score under a plausibility cutoff.

Scores, in float32, on the plausible tokens {x : p_e(x) ≥ α·max p_e} (−∞ elsewhere):

- O'Brien & Lewis (arXiv 2309.09117, the default): (1+β)·z_e − β·z_a;
- Li et al. (arXiv 2210.15097): log p_e − (1/τ)·log p_a.

Both are computed from log-softmaxed logits: log p = z − logsumexp(z) shifts each row by a constant, which
changes neither the softmax, nor top-k/top-p, nor the argmax, and keeps large logits well conditioned.
The sampling temperature, top-k and top-p apply to the scores afterwards.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxsr.checks import check_number
from jaxsr.models.layers import MASKED

ContrastKind = Literal["obrien", "li"]


@struct.dataclass
class Contrast:
    """Contrastive-score weights (traced, so sweeping α/β/τ compiles nothing new).

    scores = expert_weight·log p_e − amateur_weight·log p_a on tokens with log p_e ≥ max log p_e +
    log_alpha, −∞ elsewhere. O'Brien & Lewis: (1+β, β); Li et al.: (1, 1/τ)."""

    expert_weight: jax.Array
    amateur_weight: jax.Array
    log_alpha: jax.Array


def contrastive_scores(expert_logits: jax.Array, amateur_logits: jax.Array, contrast: Contrast) -> jax.Array:
    """float32 contrastive scores [..., V]; implausible tokens get a large negative value."""
    lp_e = jax.nn.log_softmax(expert_logits.astype(jnp.float32), axis=-1)
    lp_a = jax.nn.log_softmax(amateur_logits.astype(jnp.float32), axis=-1)
    plausible = lp_e >= lp_e.max(axis=-1, keepdims=True) + contrast.log_alpha
    scores = contrast.expert_weight * lp_e - contrast.amateur_weight * lp_a
    return jnp.where(plausible, scores, MASKED)


MAX_AMATEUR_WEIGHT = 1e6
"""The largest amateur weight (β, or 1/τ) accepted: float32 keeps 7 digits, so past it the expert's
logits vanish from the difference and the contrast is noise."""


def make_contrast(
    alpha: float = 0.1, beta: float = 0.5, *, contrast: ContrastKind = "obrien", tau: float = 1.0
) -> Contrast:
    """Validated contrast weights. α ∈ [0, 1] (0 keeps every token, 1 only the expert's argmax);
    β ≥ 0 (O'Brien & Lewis; β = 0 is the expert alone); τ > 0 (Li et al.'s amateur temperature)."""
    alpha = check_number("alpha", alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a value in [0, 1], got {alpha}")
    beta = check_number("beta", beta)
    if beta < 0:
        raise ValueError(f"beta: expected a value >= 0, got {beta}")
    tau = check_number("tau", tau)
    if tau <= 0:
        raise ValueError(f"tau: expected a value > 0, got {tau}")
    if contrast == "obrien":
        weights = (1.0 + beta, beta)
    elif contrast == "li":
        weights = (1.0, 1.0 / tau)
    else:
        raise ValueError(f"contrast: expected 'obrien' or 'li', got {contrast!r}")
    if weights[1] > MAX_AMATEUR_WEIGHT:
        name, value = ("beta", beta) if contrast == "obrien" else ("tau", tau)
        raise ValueError(
            f"{name}: {value:.3g} weighs the amateur by {weights[1]:.3g}; beyond {MAX_AMATEUR_WEIGHT:.0e} "
            "float32 scores lose every digit of the expert's logits"
        )
    return Contrast(
        expert_weight=jnp.float32(weights[0]),
        amateur_weight=jnp.float32(weights[1]),
        log_alpha=jnp.float32(math.log(alpha) if alpha > 0 else -math.inf),
    )
