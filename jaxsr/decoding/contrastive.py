"""Contrastive decoding: sample from the expert-minus-amateur contrast under a plausibility cutoff.

Scores, in float32, on the plausible tokens {x : p_e(x) ≥ α·max p_e} (−∞ elsewhere):

- O'Brien & Lewis (arXiv 2309.09117, the default): (1+β)·z_e − β·z_a;
- Li et al. (arXiv 2210.15097): log p_e − (1/τ)·log p_a.

Both are computed from log-softmaxed logits: log p = z − logsumexp(z) shifts each row by a constant, which
changes neither the softmax, nor top-k/top-p, nor the argmax, and keeps large logits well conditioned.
The sampling temperature, top-k and top-p apply to the scores afterwards. The expert and the amateur
step together, one token per step; the amateur's row cache is rolled forward with the expert's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsr.decoding import pair
from jaxsr.decoding.pair import Contrast, Method, SpeculativeState, contrastive_scores
from jaxsr.decoding.sampler import _choose, _record
from jaxsr.models.cache import PromptCache

ContrastKind = Literal["obrien", "li"]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return float(value)


def make_contrast(
    alpha: float = 0.1, beta: float = 0.5, *, contrast: ContrastKind = "obrien", tau: float = 1.0
) -> Contrast:
    """Validated contrast weights. α ∈ [0, 1] (0 keeps every token, 1 only the expert's argmax);
    β ≥ 0 (O'Brien & Lewis; β = 0 is the expert alone); τ > 0 (Li et al.'s amateur temperature)."""
    alpha = _number("alpha", alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a value in [0, 1], got {alpha}")
    beta = _number("beta", beta)
    if beta < 0:
        raise ValueError(f"beta: expected a value >= 0, got {beta}")
    tau = _number("tau", tau)
    if tau <= 0:
        raise ValueError(f"tau: expected a value > 0, got {tau}")
    if contrast == "obrien":
        weights = (1.0 + beta, beta)
    elif contrast == "li":
        weights = (1.0, 1.0 / tau)
    else:
        raise ValueError(f"contrast: expected 'obrien' or 'li', got {contrast!r}")
    return Contrast(
        expert_weight=jnp.float32(weights[0]),
        amateur_weight=jnp.float32(weights[1]),
        log_alpha=jnp.float32(math.log(alpha) if alpha > 0 else -math.inf),
    )


@dataclasses.dataclass(frozen=True)
class ContrastiveDecoding(Method):
    """One token per step: the expert and the amateur step together."""

    def step(
        self,
        graphs: pair.Graphs,
        params: tuple[nnx.State, nnx.State],
        state: SpeculativeState,
        prompts: tuple[PromptCache, PromptCache],
        contrast: Contrast,
        pause_at: jax.Array | int,
    ) -> SpeculativeState:
        base = state.base
        active = ~base.done & (base.num_generated < pause_at)
        index, last = pair.last_tokens(state)
        z_e, target_rows = pair.forward(
            graphs[0], params[0], last[:, None], index[:, None], prompts[0], base.rows
        )
        z_e = z_e[:, 0]
        z_a, draft_rows = pair.forward(
            graphs[1], params[1], last[:, None], index[:, None], prompts[1], state.draft_rows
        )
        scores = contrastive_scores(z_e, z_a[:, 0], contrast)
        tokens, _ = _choose(
            scores, (base.seed, base.prompt_id, base.sample_id, base.num_generated), self.sampling
        )
        base = _record(base.replace(rows=target_rows), tokens, pair.token_logprob(z_e, tokens), active)
        state = pair.with_lengths(state, base.replace(steps=base.steps + 1), draft_rows)
        return state.replace(draft_steps=state.draft_steps + 1, target_calls=state.target_calls + active)
