"""Two-model decoding (contrastive, speculative, speculative-contrastive): state, loop and driver.

A *pair* is a target model (the expert, or the model speculative decoding must reproduce) and a second
model (the amateur, or the draft) that share a vocabulary. Both prefill each prompt once into their own
`PromptCache`; every row keeps one `RowCache` per model.

`SpeculativeState` wraps the plain sampler's `DecodeState` (token buffer, flags, random-stream ids,
the target's row cache, the target-call counter) and adds the second model's row cache and the
acceptance counters. The caches of a row always hold its generated tokens [0, n-1), n being the number
of committed tokens: the last committed token has not been fed yet. A step that looks ahead (drafting,
verification) writes further slots and then sets each row's `length` back to n-1 — a rejected draft
is rolled back by that pointer alone, its stale slots are overwritten before they can be attended to.

A `Method` (a frozen, hashable dataclass: a static argument of the jitted functions) says what a step
does: `contrastive.ContrastiveDecoding` (one token per step from both models, or the target alone)
and `speculative.SpeculativeDecoding` (draft γ tokens, verify them in one target forward).

Research use (or a search procedure driving SD/CD/SCD, e.g. Speculative Rejection over SCD)::

    t_logits, t_prompt = sampler.prefill(target.graph, target.params, tokens, mask)
    d_logits, d_prompt = sampler.prefill(draft.graph, draft.params, tokens, mask)
    m, c = SpeculativeDecoding(sampling, gamma=4), make_contrast(alpha, beta)   # c = Contrast.unused(): SD
    state = init_state(t_logits, d_logits, (t_prompt, d_prompt), c, method=m, samples_per_prompt=G,
                       capacity=N, cache_capacity=N + m.headroom, seed=..., ...)
    state = decode_loop(graphs, params, state, (t_prompt, d_prompt), c, method=m, pause_at=segment_end)
    state = compact(state, survivors, alive, cache_capacity=next_capacity + m.headroom)
    state = decode_loop(...)                       # survivors continue; nothing is prefilled again
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxsr.decoding import sampler
from jaxsr.decoding.generate import DEFAULT_MAX_ROWS, RawSample, batches, raw_samples, row_inputs
from jaxsr.decoding.prompts import check_context, check_language_model, left_pad
from jaxsr.decoding.sampling import SamplingConfig, process_logits
from jaxsr.ladder import bucket
from jaxsr.models.cache import PromptCache, RowCache
from jaxsr.models.layers import MASKED
from jaxsr.models.model import Model
from jaxsr.sharding import constrain_rows, mesh_of, on_mesh

Graphs = tuple[nnx.GraphDef, nnx.GraphDef]
"""(target graph, draft/amateur graph): static."""
NO_PAUSE = np.int32(np.iinfo(np.int32).max)


@struct.dataclass
class Contrast:
    """Contrastive-score weights (traced, so sweeping α/β/τ compiles nothing new).

    scores = expert_weight·log p_e − amateur_weight·log p_a on tokens with log p_e ≥ max log p_e +
    log_alpha, −∞ elsewhere. O'Brien & Lewis: (1+β, β); Li et al.: (1, 1/τ)."""

    expert_weight: jax.Array
    amateur_weight: jax.Array
    log_alpha: jax.Array

    @classmethod
    def unused(cls) -> Contrast:
        """Weights under which `contrastive_scores` is the target's own log-softmax (plain SD)."""
        zero = jnp.zeros((), jnp.float32)
        return cls(expert_weight=zero + 1, amateur_weight=zero, log_alpha=zero - jnp.inf)


def contrastive_scores(expert_logits: jax.Array, amateur_logits: jax.Array, contrast: Contrast) -> jax.Array:
    """float32 contrastive scores [..., V]; implausible tokens get a large negative value."""
    lp_e = jax.nn.log_softmax(expert_logits.astype(jnp.float32), axis=-1)
    lp_a = jax.nn.log_softmax(amateur_logits.astype(jnp.float32), axis=-1)
    plausible = lp_e >= lp_e.max(axis=-1, keepdims=True) + contrast.log_alpha
    scores = contrast.expert_weight * lp_e - contrast.amateur_weight * lp_a
    return jnp.where(plausible, scores, MASKED)


@struct.dataclass
class SpeculativeState:
    base: sampler.DecodeState
    """Tokens, flags, random-stream ids, the target's row cache; `base.steps` counts target calls."""
    draft_rows: RowCache
    """The draft's / amateur's row cache (same `length` as `base.rows`)."""
    draft_steps: jax.Array
    """[] int32 draft forward calls (each one token per row)."""
    target_calls: jax.Array
    """[B] int32 target forward calls made while the row was active (prefill not counted)."""
    accepted: jax.Array
    """[B] int32 draft tokens accepted."""
    tested: jax.Array
    """[B] int32 draft tokens put to the acceptance test (accepted + rejected)."""


@dataclasses.dataclass(frozen=True)
class Method:
    """What a decode step does. Subclasses are frozen dataclasses (hashable, static under jit)."""

    sampling: SamplingConfig

    @property
    def headroom(self) -> int:
        """Row-cache slots beyond the token budget that a step may write (look-ahead)."""
        return 0

    @property
    def target_positions(self) -> int:
        """Token positions per row in one target call."""
        return 1

    def step(
        self,
        graphs: Graphs,
        params: tuple[nnx.State, nnx.State],
        state: SpeculativeState,
        prompts: tuple[PromptCache, PromptCache],
        contrast: Contrast,
        pause_at: jax.Array | int,
    ) -> SpeculativeState:
        raise NotImplementedError


# -- pieces shared by the steps ----------------------------------------------------------------------


def probabilities(scores: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The sampling distribution [..., V] (float32) of raw scores: softmax of the processed scores,
    or the one-hot argmax when greedy. Speculative steps sample and test with exactly these."""
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(scores, axis=-1), scores.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(scores, sampling), axis=-1)


def positions(prompt: PromptCache, index: jax.Array, context: int) -> jax.Array:
    """Absolute positions of generated-token indices [B, T] (clamped to the model's context: only
    look-ahead tokens past the budget ever reach the clamp, and those are never kept)."""
    G = index.shape[0] // prompt.num_prompts
    return jnp.minimum(jnp.repeat(prompt.length, G)[:, None] + index, context - 1)


def forward(
    graph: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    index: jax.Array,
    prompt: PromptCache,
    rows: RowCache,
) -> tuple[jax.Array, RowCache]:
    """Feed tokens [B, T] that sit at generated indices `index` [B, T] (written at the same slots).

    Returns float32 logits [B, T, V] and the cache (its `length` is left for the caller)."""
    module = nnx.merge(graph, params)
    pos = positions(prompt, index, module.config.max_position_embeddings)
    hidden, rows = module.decode(tokens, pos, prompt, rows.replace(length=index[:, 0]))
    return module.logits(hidden), rows


def last_tokens(state: SpeculativeState) -> tuple[jax.Array, jax.Array]:
    """(index of each row's last committed token, that token): what the next step feeds."""
    base = state.base
    index = jnp.maximum(base.num_generated - 1, 0)
    return index, jnp.take_along_axis(base.tokens, index[:, None], axis=1)[:, 0]


def with_lengths(
    state: SpeculativeState, base: sampler.DecodeState, draft_rows: RowCache
) -> SpeculativeState:
    """Set both caches' pointers to n-1 (rolling back whatever a look-ahead wrote past it)."""
    length = jnp.maximum(base.num_generated - 1, 0)
    return state.replace(
        base=base.replace(rows=base.rows.replace(length=length)),
        draft_rows=draft_rows.replace(length=length),
    )


def token_logprob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Raw log-probability of `tokens` [...] under float32 `logits` [..., V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


# -- jitted entry points -----------------------------------------------------------------------------


def pin(state: SpeculativeState) -> SpeculativeState:
    """Under a mesh, keep every row and both of its caches on its `data` shard."""
    per_row = constrain_rows(state.replace(base=None, draft_rows=None))
    return per_row.replace(base=sampler.pin(state.base), draft_rows=state.draft_rows.constrained())


@partial(jax.jit, static_argnames=("method", "samples_per_prompt", "capacity", "cache_capacity"))
def init_state(
    target_logits: jax.Array,
    draft_logits: jax.Array,
    prompts: tuple[PromptCache, PromptCache],
    contrast: Contrast,
    *,
    method: Method,
    samples_per_prompt: int,
    capacity: int,
    cache_capacity: int,
    seed: jax.Array,
    prompt_ids: jax.Array,
    sample_ids: jax.Array,
    alive: jax.Array,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
) -> SpeculativeState:
    """Rows for `samples_per_prompt` samples of each prompt, their first token drawn from the
    target distribution at the prompts' last positions (`*_logits`: [P, V] from the prefills)."""
    scores = contrastive_scores(target_logits, draft_logits, contrast)
    base = sampler.init_state(
        scores,
        prompts[0],
        samples_per_prompt=samples_per_prompt,
        capacity=capacity,
        sampling=method.sampling,
        cache_capacity=cache_capacity,
        seed=seed,
        prompt_ids=prompt_ids,
        sample_ids=sample_ids,
        alive=alive,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
    )
    # the recorded log-probability is the target model's own (not the contrastive score's)
    first = token_logprob(jnp.repeat(target_logits, samples_per_prompt, axis=0), base.tokens[:, 0])
    base = base.replace(logprob_sum=jnp.where(alive, first, 0.0))
    B = base.tokens.shape[0]
    draft_rows = RowCache.empty_like(prompts[1], B, cache_capacity)
    zeros = jnp.zeros((B,), jnp.int32)
    return pin(
        SpeculativeState(
            base=base,
            draft_rows=draft_rows,
            draft_steps=jnp.zeros((), jnp.int32),
            target_calls=zeros,
            accepted=zeros,
            tested=zeros,
        )
    )


@partial(jax.jit, static_argnames=("graphs", "method"), donate_argnames=("state",))
def decode_loop(
    graphs: Graphs,
    params: tuple[nnx.State, nnx.State],
    state: SpeculativeState,
    prompts: tuple[PromptCache, PromptCache],
    contrast: Contrast,
    *,
    method: Method,
    pause_at: jax.Array | None = None,
) -> SpeculativeState:
    """Step until every row is done (or has reached `pause_at` tokens). No host sync inside.

    A speculative step may carry a row past `pause_at` by up to γ tokens. Pass `NO_PAUSE` rather than
    None to share one compiled program with paused runs (the drivers do)."""
    limit = NO_PAUSE if pause_at is None else pause_at

    def running(s: SpeculativeState) -> jax.Array:
        return (~s.base.done & (s.base.num_generated < limit)).any()

    def body(s: SpeculativeState) -> SpeculativeState:
        return pin(method.step(graphs, params, s, prompts, contrast, limit))

    return jax.lax.while_loop(running, body, state)


@partial(jax.jit, static_argnames=("cache_capacity",))
def compact(
    state: SpeculativeState, index: jax.Array, alive: jax.Array, *, cache_capacity: int
) -> SpeculativeState:
    """Gather rows `index` into a (smaller) batch; both caches get `cache_capacity` slots (keep the
    method's look-ahead headroom). Survivors keep tokens, caches, random streams and counters.

    Rows attend to the prompt cache of their group (row b to prompt b // G), so the gather must keep
    each row in its prompt's group — trivially so with one prompt, as Speculative Rejection runs."""
    return pin(
        state.replace(
            base=sampler.compact(state.base, index, alive, cache_capacity=cache_capacity),
            draft_rows=state.draft_rows.take(index, cache_capacity),
            target_calls=state.target_calls[index],
            accepted=state.accepted[index],
            tested=state.tested[index],
        )
    )


# -- host side ---------------------------------------------------------------------------------------


def check_pair(target: Any, draft: Any, names: tuple[str, str]) -> None:
    """Both must be language models over the same vocabulary (same ids for the same tokens)."""
    for model, name in zip((target, draft), names, strict=True):
        check_language_model(model, name)
    t, d = target.config.vocab_size, draft.config.vocab_size
    if t != d:
        raise ValueError(f"{names[1]}: vocabulary of {d} tokens differs from the {names[0]}'s {t}")
    tokenizers = target.tokenizer, draft.tokenizer
    if None not in tokenizers and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ValueError(f"{names[1]}: its tokenizer maps tokens to different ids than the {names[0]}'s")


def check_pair_context(target: Model, draft: Model, encoded: list[list[int]], max_new_tokens: int) -> None:
    check_context(target, encoded, max_new_tokens)
    check_context(draft, encoded, max_new_tokens)


@dataclasses.dataclass
class RowStats:
    """Per-row counters brought back to the host."""

    num_generated: int
    target_calls: int
    accepted: int
    tested: int


@dataclasses.dataclass
class Run:
    samples: list[list[RawSample]]
    rows: list[list[RowStats]]
    stats: list[dict[str, Any]]
    decode_s: float
    """Total decode-loop time of the call (compilation excluded)."""
    probe: tuple[Any, Any, Any, Any] | None = None
    """Shapes of the last batch's (target, draft) row caches and its prompt caches, for cost probes
    (shapes only: no finished batch's cache is kept alive while the next one decodes)."""


def decode_pairs(
    method: Method,
    contrast: Contrast,
    target: Model,
    draft: Model,
    prompts: list[list[int]],
    *,
    roles: tuple[str, str],
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
) -> Run:
    """`num_samples` continuations of each (encoded) prompt; each prompt is prefilled once per model.

    Batching and stats follow `generate.sample_many` (`token_forwards` keyed by `roles`: the (target,
    draft) role names; `kv_slots` counts the slots of one model's caches).
    Compilation is timed apart (`compile_s`) so that `decode_s` measures decoding alone."""
    capacity = bucket(max_new_tokens)
    cache_capacity = capacity + method.headroom
    graphs = (target.graph, draft.graph)
    params = (target.params, draft.params)
    run = Run([[] for _ in prompts], [[] for _ in prompts], [{} for _ in prompts], 0.0)
    with on_mesh(target, draft):
        for start, P, G, R in batches(prompts, num_samples, max_rows, mesh_of(target, draft)):
            chunk = prompts[start : start + P]
            S = bucket(max(len(p) for p in chunk))
            t0 = time.perf_counter()
            tokens, mask = map(jnp.asarray, left_pad(chunk, P, S))
            t_logits, t_prompt = sampler.prefill(target.graph, target.params, tokens, mask)
            d_logits, d_prompt = sampler.prefill(draft.graph, draft.params, tokens, mask)
            jax.block_until_ready((t_logits, d_logits))
            prefill_s = time.perf_counter() - t0
            prompt_caches = (t_prompt, d_prompt)
            target_forwards = draft_forwards = P * S
            compile_s = decode_s = 0.0
            for first in range(0, num_samples, G):
                rows = row_inputs(
                    target, prompts=P, real_prompts=len(chunk), samples_per_prompt=R, live_per_prompt=G,
                    first_sample=first, num_samples=num_samples, max_new_tokens=max_new_tokens, seed=seed,
                    first_prompt_id=prompt_offset + start, stop_token_ids=stop_token_ids,
                )  # fmt: skip
                state = init_state(
                    t_logits, d_logits, prompt_caches, contrast, method=method, capacity=capacity,
                    cache_capacity=cache_capacity, **rows,
                )  # fmt: skip
                t1 = time.perf_counter()
                args = (params, state, prompt_caches, contrast)
                loop = decode_loop.lower(graphs, *args, method=method, pause_at=NO_PAUSE).compile()
                t2 = time.perf_counter()
                state = loop(*args, pause_at=NO_PAUSE)
                base = state.base
                out = jax.device_get(
                    (base.tokens, base.num_generated, base.finished, base.alive, base.logprob_sum, base.steps,
                     state.draft_steps, state.target_calls, state.accepted, state.tested)
                )  # fmt: skip
                t3 = time.perf_counter()
                compile_s += t2 - t1
                decode_s += t3 - t2
                num, steps, draft_steps, calls, accepted, tested = out[1], *out[5:]
                target_forwards += int(steps) * P * R * method.target_positions
                draft_forwards += int(draft_steps) * P * R
                for row, raw in raw_samples(
                    *out[:5], samples_per_prompt=R, first_prompt=start, first_sample=first
                ):
                    run.samples[raw.prompt_index].append(raw)
                    counters = RowStats(int(num[row]), int(calls[row]), int(accepted[row]), int(tested[row]))
                    run.rows[raw.prompt_index].append(counters)
                run.probe = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                    (base.rows, state.draft_rows, *prompt_caches),
                )
                del state, base
            run.decode_s += decode_s
            target_role, draft_role = roles
            for p in range(len(chunk)):
                run.stats[start + p] = {
                    "prefill_s": prefill_s / len(chunk),
                    "compile_s": compile_s / len(chunk),
                    "decode_s": decode_s / len(chunk),
                    "token_forwards": {
                        target_role: target_forwards // len(chunk),
                        draft_role: draft_forwards // len(chunk),
                    },
                    "batch_rows": P * R,
                    "kv_slots": P * S + P * R * cache_capacity,
                }
    for i, rows in enumerate(run.samples):
        order = np.argsort([r.sample_index for r in rows], kind="stable")
        run.samples[i] = [rows[j] for j in order]
        run.rows[i] = [run.rows[i][j] for j in order]
    return run


def acceptance_stats(rows: list[RowStats]) -> dict[str, Any]:
    """acceptance_rate λ = accepted / tested draft tokens; tokens_per_target_call = tokens committed
    by verification calls / those calls (the first token, drawn from the prefill, is not counted)."""
    accepted = sum(r.accepted for r in rows)
    tested = sum(r.tested for r in rows)
    calls = sum(r.target_calls for r in rows)
    produced = sum(max(r.num_generated - 1, 0) for r in rows)
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
    target: Model, draft: Model, run: Run, gamma: int, repeats: int = 3
) -> tuple[float, float] | None:
    """(c, v): one draft call (1 token per row) and one verification call (γ+1 tokens per row), each
    relative to one 1-token target call, timed on the last batch's shapes (best of `repeats`)."""
    if run.probe is None:
        return None
    target_rows, draft_rows, t_prompt, d_prompt = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), run.probe
    )
    B = target_rows.length.shape[0]

    def best(model: Model, prompt: PromptCache, rows: RowCache, width: int) -> float:
        tokens = jnp.zeros((B, width), jnp.int32)
        jax.block_until_ready(_probe(model.graph, model.params, tokens, prompt, rows))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(_probe(model.graph, model.params, tokens, prompt, rows))
            times.append(time.perf_counter() - t0)
        return min(times)

    with on_mesh(target, draft):
        t_step = best(target, t_prompt, target_rows, 1)
        if t_step <= 0:
            return None
        draft_step = best(draft, d_prompt, draft_rows, 1)
        return draft_step / t_step, best(target, t_prompt, target_rows, gamma + 1) / t_step


def finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
