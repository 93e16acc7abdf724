"""Exact batched speculative decoding (Leviathan et al. 2211.17192, Chen et al. 2302.01318) and
speculative contrastive decoding (Yuan et al. 2311.08981), sharing one verify step.

One step, for every active row at once (n = the row's committed tokens, x_{n-1} the last of them):

1. Draft: γ draft calls feed x_{n-1}, d_0, …, d_{γ-2} and sample d_i ~ q_i, where q_i is the draft's
   distribution after exactly the processing (temperature, top-k, top-p; float32) used in the test.
2. Verify: one target call over the γ+1 tokens x_{n-1}, d_0 … d_{γ-1} gives p_0 … p_γ. For SCD the
   target is the contrastive distribution of the expert's logits and the amateur's logits at the
   same positions: the amateur's are the ones it drafted with (positions 0 … γ-1), and position γ
   comes from one more amateur call (below).
3. Accept d_i while u_i·q_i(d_i) < p_i(d_i) (u_i uniform); a = the number accepted. On the first
   rejection draw from norm(max(0, p_a − q_a)) (p_a if that sums to 0); if all γ were accepted, draw
   the bonus token from p_γ.
4. Rows that accepted all γ need d_{γ-1} in the draft cache (and SCD needs the amateur's logits after
   it): one extra draft call runs, under `lax.cond`, only when some row accepted everything — the cλ^γ
   term of the expected speed-up.
5. Commit the a+1 tokens through the plain sampler's `_record` (stop ids and the token budget cut
   them short), then set both caches' `length` to n'-1: rejected look-ahead is rolled back by pointer.

Greedy (temperature 0) uses one-hot distributions: a draft token is accepted iff it is the target's
argmax, and the residual is the target's argmax, so greedy SD is greedy target decoding and greedy SCD
is greedy contrastive decoding, token for token.

Randomness of a step comes from `row_keys(seed, prompt, sample, n)`, so a row's tokens depend only on
(seed, prompt, sample), not on the batch it was decoded in.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsr.decoding import pair
from jaxsr.decoding.contrastive import (
    DEFAULT_SAMPLING,
    ContrastiveDecoding,
    ContrastKind,
    contrastive_scores,
    make_contrast,
)
from jaxsr.decoding.generate import DEFAULT_MAX_ROWS, check_decode_args, to_sample
from jaxsr.decoding.pair import Contrast, Method, SpeculativeState, probabilities
from jaxsr.decoding.prompts import check_positive_int, encode_prompts
from jaxsr.decoding.sampler import _record, row_keys
from jaxsr.decoding.sampling import SamplingConfig, draw_from
from jaxsr.models.cache import PromptCache
from jaxsr.models.model import Model
from jaxsr.results import Result

# -- the acceptance rule, as pure functions of distributions -----------------------------------------


def accept(u: jax.Array, p_x: jax.Array, q_x: jax.Array) -> jax.Array:
    """Accept a draft token x ~ q with probability min(1, p(x)/q(x)), given u ~ U[0, 1)."""
    return u * q_x < p_x


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p − q)) over the last axis; p itself where that is all zero."""
    r = jnp.maximum(p - q, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def accepted_count(p: jax.Array, q: jax.Array, drafts: jax.Array, u: jax.Array) -> jax.Array:
    """Number of leading draft tokens accepted: p, q [B, γ, V], drafts and u [B, γ]."""
    p_x = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    return jnp.cumprod(accept(u, p_x, q_x), axis=-1).sum(-1).astype(jnp.int32)


def next_distribution(p: jax.Array, q: jax.Array, p_bonus: jax.Array, a: jax.Array) -> jax.Array:
    """The distribution of the token after the a accepted drafts: the residual at the first rejected
    position, or the bonus distribution p_γ when all γ were accepted. p, q [B, γ, V]; p_bonus [B, V]."""
    g = q.shape[1]
    i = jnp.minimum(a, g - 1)[:, None, None]
    p_a = jnp.take_along_axis(p, i, axis=1)[:, 0]
    q_a = jnp.take_along_axis(q, i, axis=1)[:, 0]
    return jnp.where((a < g)[:, None], residual(p_a, q_a), p_bonus)


# -- the step ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoding(Method):
    """γ draft tokens per target call, for a target that is the contrastive distribution of (target
    logits, draft logits) under `Contrast` weights (speculative contrastive decoding). Plain speculative
    decoding is the special case `Contrast.unused()` (weights (1, 0), no cutoff): the scores are then
    the target's log-softmax, which samples, filters and argmaxes exactly as its logits do. Both
    share one compiled program per (γ, sampling, shapes)."""

    gamma: int = 4

    @property
    def headroom(self) -> int:
        return self.gamma + 1

    @property
    def target_positions(self) -> int:
        return self.gamma + 1

    def target_scores(
        self, contrast: Contrast, target_logits: jax.Array, draft_logits: jax.Array
    ) -> jax.Array:
        return contrastive_scores(target_logits, draft_logits, contrast)

    def step(
        self,
        graphs: pair.Graphs,
        params: tuple[nnx.State, nnx.State],
        state: SpeculativeState,
        prompts: tuple[PromptCache, PromptCache],
        contrast: Contrast,
        pause_at: jax.Array | int,
    ) -> SpeculativeState:
        g, sampling, base = self.gamma, self.sampling, state.base
        B = base.tokens.shape[0]
        active = ~base.done & (base.num_generated < pause_at)
        index, last = pair.last_tokens(state)
        keys = row_keys(base.seed, base.prompt_id, base.sample_id, base.num_generated)
        keys = jax.vmap(lambda k: jax.random.split(k, 2 * g + 1))(keys)
        draft_keys, test_keys, final_keys = keys[:, :g], keys[:, g : 2 * g], keys[:, 2 * g]

        def draft_one(carry, j):
            rows, token = carry
            z, rows = pair.forward(
                graphs[1], params[1], token[:, None], (index + j)[:, None], prompts[1], rows
            )
            q = probabilities(z[:, 0], sampling)
            d = jax.vmap(draw_from)(draft_keys[:, j], q)
            return (rows, d), (d, q, z[:, 0])

        (draft_rows, _), (drafts, q, z_a) = jax.lax.scan(draft_one, (state.draft_rows, last), jnp.arange(g))
        drafts, q = drafts.T, q.transpose(1, 0, 2)

        fed = jnp.concatenate([last[:, None], drafts], axis=1)
        fed_index = index[:, None] + jnp.arange(g + 1)
        z_e, target_rows = pair.forward(graphs[0], params[0], fed, fed_index, prompts[0], base.rows)
        head = self.target_scores(contrast, z_e[:, :g], z_a.transpose(1, 0, 2))
        p = probabilities(head, sampling)
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(test_keys)
        a = accepted_count(p, q, drafts, u)
        kept_all = active & (a == g)

        def extra_draft_call(rows):
            z, rows = pair.forward(
                graphs[1], params[1], drafts[:, -1:], (index + g)[:, None], prompts[1], rows
            )
            return rows, z[:, 0]

        def no_call(rows):
            return rows, jnp.zeros_like(z_e[:, g])

        draft_rows, z_a_bonus = jax.lax.cond(kept_all.any(), extra_draft_call, no_call, draft_rows)
        p_bonus = probabilities(self.target_scores(contrast, z_e[:, g], z_a_bonus), sampling)
        token = jax.vmap(draw_from)(final_keys, next_distribution(p, q, p_bonus, a))

        padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
        new = jnp.where(jnp.arange(g + 1)[None, :] == a[:, None], token[:, None], padded)
        logp = pair.token_logprob(z_e, new)
        committed = base.replace(rows=target_rows)
        for j in range(g + 1):
            committed = _record(committed, new[:, j], logp[:, j], active & (j <= a) & ~committed.done)
        state = pair.with_lengths(state, committed.replace(steps=committed.steps + 1), draft_rows)
        return state.replace(
            draft_steps=state.draft_steps + g + kept_all.any(),
            target_calls=state.target_calls + active,
            accepted=state.accepted + jnp.where(active, a, 0),
            tested=state.tested + jnp.where(active, jnp.minimum(a + 1, g), 0),
        )


# -- public functions --------------------------------------------------------------------------------


def _speculative(
    target: Model,
    draft: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    contrast: Contrast | None,
    gamma: Any,
    max_new_tokens: Any,
    sampling: Any,
    num_samples: Any,
    seed: Any,
    chat: bool | None,
    stop_token_ids: Sequence[int],
    max_rows: Any,
    prompt_offset: int,
    baseline: bool,
    measure_cost: bool,
) -> list[Result]:
    gamma = check_positive_int("gamma", gamma)
    sampling, max_new_tokens, num_samples, max_rows, seed = check_decode_args(
        sampling, max_new_tokens, num_samples, max_rows, seed
    )
    encoded = encode_prompts(target, prompts, chat=chat)
    pair.check_pair_context(target, draft, encoded, max_new_tokens)
    contrastive = contrast is not None
    weights = contrast if contrastive else Contrast.unused()
    options = dict(
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=stop_token_ids,
        max_rows=max_rows,
        prompt_offset=prompt_offset,
    )
    t0 = time.perf_counter()
    roles = ("expert", "amateur") if contrastive else ("generator", "draft")
    method = SpeculativeDecoding(sampling, gamma=gamma)
    run = pair.decode_pairs(method, weights, target, draft, encoded, roles=roles, **options)
    wall = (time.perf_counter() - t0) / len(encoded)
    costs = pair.measure_call_costs(target, draft, run, gamma) if measure_cost else None
    cost, verify = costs if costs is not None else (None, None)
    speedup = base_s = None
    if baseline:
        reference = ContrastiveDecoding(sampling, use_amateur=contrastive)
        base_s = pair.decode_pairs(
            reference, weights, target, draft, encoded, roles=roles, **options
        ).decode_s
        speedup = base_s / run.decode_s if run.decode_s > 0 else None
    results = []
    for prompt, rows, counters, st in zip(prompts, run.samples, run.rows, run.stats, strict=True):
        acc = pair.acceptance_stats(counters)
        lam = acc["acceptance_rate"]
        stats = {"wall_s": wall, **st, "gamma": gamma, **acc, "cost_ratio": cost, "verify_cost_ratio": verify}
        stats["expected_speedup"] = None
        if lam is not None and cost is not None:
            # against the method's own baseline: the target alone (SD) or contrastive decoding (SCD)
            baseline_cost = 1 + cost if contrastive else 1.0
            predicted = pair.expected_speedup(lam, gamma, cost, verify, baseline_cost)
            stats["expected_speedup"] = pair.finite_or_none(predicted)
        if baseline:
            stats["baseline_decode_s"] = base_s / len(encoded)
            stats["speedup"] = speedup
        results.append(Result(prompt=prompt, samples=[to_sample(target, r) for r in rows], stats=stats))
    return results


def speculative_decode(
    target: Model,
    draft: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    gamma: int = 4,
    max_new_tokens: int,
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    num_samples: int = 1,
    seed: int = 0,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
    baseline: bool = False,
    measure_cost: bool = True,
) -> list[Result]:
    """Samples from `target` (after `sampling`'s processing) exactly, drafting γ tokens per target call.

    `Result.stats`: acceptance_rate λ, tokens_per_target_call, cost_ratio c (one draft call / one
    1-token target call) and verify_cost_ratio v (one (γ+1)-token verification call / one 1-token target
    call), both measured on this call's shapes, and expected_speedup (see `pair.expected_speedup`:
    (1−λ^{γ+1}) / ((1−λ)(v + cγ + cλ^γ)), Leviathan et al.'s formula when v = 1); with `baseline=True`
    also plain target sampling is run and timed: baseline_decode_s and speedup.
    `token_forwards` has "generator" (the target) and "draft". Prompts are encoded with the target's
    tokenizer and stop on its EOS ids."""
    pair.check_pair(target, draft, ("target", "draft"))
    return _speculative(
        target, draft, prompts, contrast=None, gamma=gamma,
        max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed, chat=chat,
        stop_token_ids=stop_token_ids, max_rows=max_rows, prompt_offset=prompt_offset, baseline=baseline,
        measure_cost=measure_cost,
    )  # fmt: skip


def speculative_contrastive_decode(
    expert: Model,
    amateur: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    gamma: int = 4,
    alpha: float = 0.1,
    beta: float = 0.5,
    max_new_tokens: int,
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    num_samples: int = 1,
    seed: int = 0,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
    baseline: bool = False,
    measure_cost: bool = True,
) -> list[Result]:
    """Samples exactly from `contrastive_decode`'s distribution, the amateur drafting γ tokens per
    expert call (it is both the draft and the contrast). Stats as `speculative_decode`, with
    `token_forwards` keys "expert" and "amateur"; the baseline is `contrastive_decode`, which costs
    1 + c target calls per token, so expected_speedup is (1+c)·E[tokens per step] / (v + cγ + cλ^γ)."""
    pair.check_pair(expert, amateur, ("expert", "amateur"))
    weights = make_contrast(alpha, beta, contrast=contrast, tau=tau)
    return _speculative(
        expert, amateur, prompts, contrast=weights, gamma=gamma,
        max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples, seed=seed, chat=chat,
        stop_token_ids=stop_token_ids, max_rows=max_rows, prompt_offset=prompt_offset, baseline=baseline,
        measure_cost=measure_cost,
    )  # fmt: skip
