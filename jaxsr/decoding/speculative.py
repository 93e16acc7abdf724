"""Exact batched speculative decoding (Leviathan et al. 2211.17192, Chen et al. 2302.01318) and
speculative contrastive decoding (Yuan et al. 2311.08981), sharing one verify step.

One step, for every active row at once (n = the row's committed tokens, x_{n-1} the last of them):

1. Draft: γ draft calls feed x_{n-1}, d_0, …, d_{γ-2} and sample d_i ~ q_i, where q_i is the draft's
   distribution after exactly the processing (penalties over the row's tokens and the drafts before
   it, temperature, top-k, top-p, min-p; float32) used in the test.
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
5. Commit the a+1 tokens through `state.record` (stop ids and the token budget cut
   them short), then set both caches' `length` to n'-1: rejected look-ahead is rolled back by pointer.

Greedy (temperature 0) uses one-hot distributions: a draft token is accepted iff it is the target's
argmax, and the residual is the target's argmax, so greedy SD is greedy target decoding and greedy SCD
is greedy contrastive decoding, token for token.

Randomness of a step comes from `row_keys(seed, prompt, sample, n)`, so a row's tokens depend only on
(seed, prompt, sample), not on the batch it was decoded in.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxsr.decoding.contrast import contrastive_scores
from jaxsr.decoding.sampling import Past, draw_from, history, probabilities, token_statistics
from jaxsr.decoding.state import record
from jaxsr.decoding.steps import (
    ContrastiveDecoding,
    Controls,
    Method,
    PlainSampling,
    forward,
    keys_of,
    past_of,
    vocab_of,
)  # fmt: skip

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


# -- the steps --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoding(Method):
    """Speculative decoding: samples exactly from the target, the draft proposing γ tokens per target
    call. `SpeculativeContrastiveDecoding` runs the same step with the contrastive distribution as
    its target."""

    gamma: int = 4
    num_models: ClassVar[int] = 2
    roles: ClassVar[tuple[str, ...]] = ("generator", "draft")

    @property
    def headroom(self) -> int:
        return self.gamma + 1

    @property
    def baseline(self) -> Method:
        return PlainSampling()

    scores = PlainSampling.scores  # the target's logits as they are (a repetition penalty reads their sign)

    def step(self, graphs, params, state, prompts, controls, pause_at):
        g, sampling = self.gamma, controls.sampling
        B = state.tokens.shape[0]
        active = state.active(pause_at)
        index, last = state.last_tokens()
        target_rows, draft_rows = state.rows
        keys = jax.vmap(lambda k: jax.random.split(k, 2 * g + 1))(keys_of(state))
        draft_keys, test_keys, final_keys = keys[:, :g], keys[:, g : 2 * g], keys[:, 2 * g]
        past, vocab = past_of(state, prompts[0]), vocab_of(graphs[0], params[0])

        def draft_one(carry, j):
            rows, token, seen = carry
            z, rows = forward(graphs[1], params[1], token[:, None], (index + j)[:, None], prompts[1], rows)
            q = probabilities(z[:, 0], sampling, None if seen is None else history(sampling, seen, vocab))
            d = jax.vmap(draw_from)(draft_keys[:, j], q)
            return (rows, d, None if seen is None else seen.plus(d)), (d, q, z[:, 0])

        carry = (draft_rows, last, past if sampling.form.penalties else None)  # the draft's own penalties
        (draft_rows, _, _), (drafts, q, z_a) = jax.lax.scan(draft_one, carry, jnp.arange(g))
        drafts, q = drafts.T, q.transpose(1, 0, 2)

        fed = jnp.concatenate([last[:, None], drafts], axis=1)
        fed_index = index[:, None] + jnp.arange(g + 1)
        z_e, target_rows = forward(graphs[0], params[0], fed, fed_index, prompts[0], target_rows)
        before = past.then(drafts)  # position j after the first j drafts; the bonus after all γ
        after = before.replace(length=past.length + g)
        scores = self.scores((z_e[:, :g], z_a.transpose(1, 0, 2)), controls, before)
        p = probabilities(scores, sampling, history(sampling, before, vocab))
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(test_keys)
        a = accepted_count(p, q, drafts, u)
        kept_all = active & (a == g)

        def extra_draft_call(rows):
            z, rows = forward(graphs[1], params[1], drafts[:, -1:], (index + g)[:, None], prompts[1], rows)
            return rows, z[:, 0]

        def no_call(rows):
            return rows, jnp.zeros_like(z_e[:, g])

        draft_rows, z_a_bonus = jax.lax.cond(kept_all.any(), extra_draft_call, no_call, draft_rows)
        p_bonus = probabilities(
            self.scores((z_e[:, g], z_a_bonus), controls, after), sampling, history(sampling, after, vocab)
        )
        token = jax.vmap(draw_from)(final_keys, next_distribution(p, q, p_bonus, a))

        padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
        new = jnp.where(jnp.arange(g + 1)[None, :] == a[:, None], token[:, None], padded)
        logp, certainty = token_statistics(z_e, new)
        committed = state
        for j in range(g + 1):
            at = (logp[:, j], certainty[:, j])
            committed = record(committed, new[:, j], at, active & (j <= a) & ~committed.done)
        committed = committed.with_rows((target_rows, draft_rows))
        return committed.replace(
            steps=committed.steps + 1,
            forwards=committed.forwards + jnp.stack([jnp.int32(g + 1), g + kept_all.any().astype(jnp.int32)]),
            target_calls=committed.target_calls + active,
            accepted=committed.accepted + jnp.where(active, a, 0),
            tested=committed.tested + jnp.where(active, jnp.minimum(a + 1, g), 0),
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeContrastiveDecoding(SpeculativeDecoding):
    """Speculative contrastive decoding: exactly contrastive decoding's distribution, the amateur
    drafting γ tokens per expert call (it is both the draft and the contrast)."""

    roles: ClassVar[tuple[str, ...]] = ("expert", "amateur")

    @property
    def baseline(self) -> Method:
        return ContrastiveDecoding()

    def scores(self, logits: tuple[jax.Array, ...], controls: Controls, past: Past) -> jax.Array:
        return contrastive_scores(logits[0], logits[1], controls.contrast)
