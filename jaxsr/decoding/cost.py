"""The cost model of speculative steps: acceptance statistics, the expected speed-up, and opt-in
timing probes of one draft call and one verification call against one target call."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.decoding.driver import Sampler
from jaxsr.decoding.state import DecodeState
from jaxsr.decoding.steps import forward
from jaxsr.models.cache import PromptCache, RowCache
from jaxsr.sharding import constrain_rows


def acceptance_stats(rows: DecodeState) -> dict[str, Any]:
    """acceptance_rate λ = accepted / tested draft tokens; tokens_per_target_call = tokens committed
    by verification calls / those calls (the first token, drawn from the prefill, is not counted).
    `rows`: decoded rows on the host (`state.to_host`)."""
    accepted = int(rows.accepted.sum())
    tested = int(rows.tested.sum())
    calls = int(rows.target_calls.sum())
    produced = int(np.maximum(rows.num_generated - 1, 0).sum())
    return {
        "acceptance_rate": accepted / tested if tested else None,
        "tokens_per_target_call": produced / calls if calls else None,
        "target_calls": calls,
        "accepted_tokens": accepted,
        "tested_tokens": tested,
    }


def expected_speedup(
    acceptance: float, gamma: int, cost_ratio: float, verify_ratio: float = 1.0, baseline_cost: float = 1.0
) -> float:
    """Expected speed-up of speculative steps over a baseline that spends `baseline_cost` 1-token target
    calls per token: E[tokens per step] · baseline_cost / (cγ + v + cλ^γ), with E[tokens per step] =
    (1−λ^{γ+1}) / (1−λ), c = draft call / target call, v = verification call (γ+1 positions) / target
    call, and one extra draft call after a fully accepted draft. With v = 1 and baseline_cost = 1 this is
    Leviathan et al.'s formula; v > 1 where the γ+1 positions do not run in parallel for free (CPUs),
    and contrastive decoding as the baseline costs 1 + c (both models every token)."""
    lam, c = acceptance, cost_ratio
    tokens = gamma + 1 if lam >= 1 else (1 - lam ** (gamma + 1)) / (1 - lam)
    return tokens * baseline_cost / (c * gamma + verify_ratio + c * lam**gamma)


def finished_by_step(acceptance: float, gamma: int, tokens: int) -> np.ndarray:
    """P(a row has committed `tokens` tokens after n speculative steps), n = 0 … tokens: each step
    commits 1 + A tokens, P(A ≥ i) = λ^i for i ≤ γ (independent acceptances)."""
    lam = acceptance
    commits = np.array([0.0] + [lam**a * (1 - lam) for a in range(gamma)] + [lam**gamma])  # by count
    have = np.zeros(tokens + 1)  # committed tokens, `tokens` absorbing
    have[0] = 1.0
    done = [0.0]
    for _ in range(tokens):
        spread = np.convolve(have[:tokens], commits)
        have = np.append(spread[:tokens], have[tokens] + spread[tokens:].sum())
        done.append(have[tokens])
    return np.asarray(done)


def expected_batch_speedup(
    acceptances: Sequence[float],
    gamma: int,
    tokens: int,
    cost_ratio: float,
    verify_ratio: float = 1.0,
    baseline_cost: float = 1.0,
) -> float:
    """`expected_speedup` for rows decoded together, each committing `tokens` tokens: the loop runs
    until its slowest row is done (E[max_i steps_i], row i accepting at its own λ_i), and the extra
    draft call runs whenever any row accepted all γ. The baseline takes `tokens` steps of
    `baseline_cost` target calls. One row and many tokens give back `expected_speedup`."""
    if tokens <= 0 or not acceptances:
        return 1.0
    lams = [min(max(lam, 0.0), 1.0) for lam in acceptances]
    finished = np.prod([finished_by_step(lam, gamma, tokens) for lam in lams], axis=0)
    steps = float(np.sum(1.0 - finished))  # E[max] = Σ_n P(max > n)
    any_full = 1.0 - float(np.prod([1.0 - lam**gamma for lam in lams]))
    per_step = cost_ratio * gamma + verify_ratio + cost_ratio * any_full
    return tokens * baseline_cost / (steps * per_step)


@partial(jax.jit, static_argnums=0)
def _probe(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, prompt: PromptCache, rows: RowCache):
    index = jnp.zeros(tokens.shape, jnp.int32) + jnp.arange(tokens.shape[1])
    tokens, index = constrain_rows((tokens, index))
    return forward(graph, params, tokens, index, prompt.constrained(), rows.constrained())[0]


def measure_call_costs(
    sampler: Sampler, shapes: Any, gamma: int, repeats: int = 3
) -> tuple[float, float] | None:
    """(c, v): one draft call (1 token per row) and one verification call (γ+1 tokens per row), each
    relative to one 1-token target call, timed on `shapes` (a `driver.Run`'s: its last batch's row and
    prompt caches), best of `repeats`."""
    if shapes is None:
        return None
    (target_rows, draft_rows), (t_prompt, d_prompt) = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), shapes
    )
    B = target_rows.length.shape[0]
    target, draft = sampler.models

    def best(model, prompt: PromptCache, rows: RowCache, width: int) -> float:
        tokens = jnp.zeros((B, width), jnp.int32)
        jax.block_until_ready(_probe(model.graph, model.params, tokens, prompt, rows))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(_probe(model.graph, model.params, tokens, prompt, rows))
            times.append(time.perf_counter() - t0)
        return min(times)

    with sampler.on_mesh():
        t_step = best(target, t_prompt, target_rows, 1)
        if t_step <= 0:
            return None
        draft_step = best(draft, d_prompt, draft_rows, 1)
        return draft_step / t_step, best(target, t_prompt, target_rows, gamma + 1) / t_step


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
