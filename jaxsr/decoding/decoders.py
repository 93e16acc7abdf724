"""Pair decoders: speculative, contrastive and speculative contrastive decoding as one object, the
calls that decode prompts with them, and the engines that search procedures drive.

`speculative_decode`, `contrastive_decode` and `speculative_contrastive_decode` build a `PairDecoder`
(with `speculative_decoder`, `contrastive_decoder`, `speculative_contrastive_decoder`, which validate
the pair and the method's arguments) and run it. `best_of_n` and `speculative_rejection` take a `Model`
(plain sampling) or a `PairDecoder`, so Speculative Rejection over speculative contrastive decoding is
one call. A search procedure sees either through the same `Engine` operations — prefill, init, decode
until a pause, compact survivors — over a state whose `base` is the plain sampler's `DecodeState`
(tokens, flags, log-probabilities, random-stream ids).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax

from jaxsr.decoding import pair, sampler
from jaxsr.decoding.contrastive import ContrastiveDecoding, ContrastKind, make_contrast
from jaxsr.decoding.generate import (
    DEFAULT_MAX_ROWS,
    RawSample,
    check_decode_args,
    check_row_ids,
    sample_many,
    to_results,
)
from jaxsr.decoding.prompts import check_context, check_positive_int, encode_prompts
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.speculative import SpeculativeDecoding
from jaxsr.models.model import Model
from jaxsr.results import Result

Prompts = Sequence[str] | Sequence[Sequence[int]]

PairKind = Literal["speculative", "contrastive", "speculative_contrastive"]


@dataclasses.dataclass(frozen=True)
class PairDecoder:
    """Two models decoding as one: `target` (the expert, or SD's target) and `second` (the amateur
    or the draft), sharing a vocabulary. Build it with the functions below."""

    kind: PairKind
    target: Model
    second: Model
    gamma: int = 1
    contrast: pair.Contrast | None = None
    """Contrast weights (None for plain speculative decoding)."""

    @property
    def roles(self) -> tuple[str, str]:
        """`token_forwards` keys of (target, second)."""
        return ("generator", "draft") if self.contrast is None else ("expert", "amateur")

    def method(self, sampling: SamplingConfig) -> pair.Method:
        if self.kind == "contrastive":
            return ContrastiveDecoding(sampling)
        return SpeculativeDecoding(sampling, gamma=self.gamma)

    @property
    def weights(self) -> pair.Contrast:
        return pair.Contrast.unused() if self.contrast is None else self.contrast


def speculative_decoder(target: Model, draft: Model, *, gamma: int = 4) -> PairDecoder:
    """Speculative decoding: samples exactly from `target`, `draft` proposing γ tokens per call."""
    pair.check_pair(target, draft, ("target", "draft"))
    return PairDecoder("speculative", target, draft, gamma=check_positive_int("gamma", gamma))


def contrastive_decoder(
    expert: Model,
    amateur: Model,
    *,
    alpha: float = 0.1,
    beta: float = 0.5,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
) -> PairDecoder:
    """Contrastive decoding (expert and amateur step together every token)."""
    pair.check_pair(expert, amateur, ("expert", "amateur"))
    weights = make_contrast(alpha, beta, contrast=contrast, tau=tau)
    return PairDecoder("contrastive", expert, amateur, contrast=weights)


def speculative_contrastive_decoder(
    expert: Model,
    amateur: Model,
    *,
    gamma: int = 4,
    alpha: float = 0.1,
    beta: float = 0.5,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
) -> PairDecoder:
    """Speculative contrastive decoding: exactly contrastive decoding's distribution, the amateur
    drafting γ tokens per expert call."""
    pair.check_pair(expert, amateur, ("expert", "amateur"))
    weights = make_contrast(alpha, beta, contrast=contrast, tau=tau)
    gamma = check_positive_int("gamma", gamma)
    return PairDecoder("speculative_contrastive", expert, amateur, gamma=gamma, contrast=weights)


class Engine(abc.ABC):
    """The operations a search procedure runs on a decoder (all jitted underneath).

    `model` is the model whose tokenizer, EOS ids and log-probabilities the samples carry; `models`
    every model it runs (for `sharding.on_mesh`); `headroom` the row-cache slots a step may write past
    a row's budget; `slot_bytes` the bytes one token position takes in all of the decoder's caches."""

    model: Model
    models: tuple[Model, ...]
    roles: tuple[str, ...]
    headroom: int
    slot_bytes: int

    def check_context(self, encoded: list[list[int]], max_new_tokens: int) -> None:
        check_context(self.model, encoded, max_new_tokens)

    @abc.abstractmethod
    def sample(self, encoded: list[list[int]], **options: Any) -> tuple[list[list[RawSample]], list[dict]]:
        """Whole responses to encoded prompts: (samples per prompt, stats per prompt); `options` as
        `generate.sample_many`'s, less the sampling."""

    @abc.abstractmethod
    def prefill(self, tokens: jax.Array, mask: jax.Array) -> Any:
        """Prefill left-padded prompts once: (last-position logits, prompt caches)."""

    @abc.abstractmethod
    def init_state(self, prefilled: Any, **rows: Any) -> Any:
        """The decode state of new rows (keywords as `sampler.init_state`, `cache_capacity` included)."""

    @abc.abstractmethod
    def decode_loop(self, state: Any, prefilled: Any, pause_at: jax.Array) -> Any:
        """Decode until every row is done or has `pause_at` tokens (the state is donated)."""

    @abc.abstractmethod
    def compact(self, state: Any, index: jax.Array, alive: jax.Array, cache_capacity: int) -> Any:
        """Gather the rows at `index` into a new batch whose caches have `cache_capacity` slots."""

    @abc.abstractmethod
    def base(self, state: Any) -> sampler.DecodeState:
        """The plain sampler state inside `state` (tokens, flags, log-probabilities, row cache)."""

    @abc.abstractmethod
    def calls(self, state: Any) -> dict[str, jax.Array]:
        """Per role, token positions run per row so far (decode steps × positions per step)."""


class PlainEngine(Engine):
    def __init__(self, model: Model, sampling: SamplingConfig):
        self.model, self.models, self.sampling = model, (model,), sampling
        self.roles, self.headroom, self.slot_bytes = ("generator",), 0, model.kv_slot_bytes

    def sample(self, encoded, **options):
        return sample_many(self.model, encoded, sampling=self.sampling, **options)

    def prefill(self, tokens, mask):
        return sampler.prefill(self.model.graph, self.model.params, tokens, mask)

    def init_state(self, prefilled, **rows):
        logits, prompt = prefilled
        return sampler.init_state(logits, prompt, sampling=self.sampling, **rows)

    def decode_loop(self, state, prefilled, pause_at):
        m = self.model
        return sampler.decode_loop(
            m.graph, m.params, state, prefilled[1], sampling=self.sampling, pause_at=pause_at
        )

    def compact(self, state, index, alive, cache_capacity):
        return sampler.compact(state, index, alive, cache_capacity=cache_capacity)

    def base(self, state):
        return state

    def calls(self, state):
        return {"generator": state.steps}


class PairEngine(Engine):
    def __init__(self, decoder: PairDecoder, sampling: SamplingConfig):
        self.decoder, self.model, self.models = decoder, decoder.target, (decoder.target, decoder.second)
        self.method = decoder.method(sampling)
        self.roles, self.headroom = decoder.roles, self.method.headroom
        self.slot_bytes = decoder.target.kv_slot_bytes + decoder.second.kv_slot_bytes
        self.graphs = (decoder.target.graph, decoder.second.graph)
        self.params = (decoder.target.params, decoder.second.params)

    def check_context(self, encoded, max_new_tokens):
        pair.check_pair_context(self.decoder.target, self.decoder.second, encoded, max_new_tokens)

    def sample(self, encoded, **options):
        d = self.decoder
        run = pair.decode_pairs(
            self.method, d.weights, d.target, d.second, encoded, roles=self.roles, **options
        )
        return run.samples, run.stats

    def prefill(self, tokens, mask):
        t_logits, t_prompt = sampler.prefill(self.graphs[0], self.params[0], tokens, mask)
        d_logits, d_prompt = sampler.prefill(self.graphs[1], self.params[1], tokens, mask)
        return (t_logits, d_logits), (t_prompt, d_prompt)

    def init_state(self, prefilled, **rows):
        (t_logits, d_logits), prompts = prefilled
        return pair.init_state(t_logits, d_logits, prompts, self.decoder.weights, method=self.method, **rows)

    def decode_loop(self, state, prefilled, pause_at):
        weights = self.decoder.weights
        return pair.decode_loop(
            self.graphs, self.params, state, prefilled[1], weights, method=self.method, pause_at=pause_at
        )

    def compact(self, state, index, alive, cache_capacity):
        return pair.compact(state, index, alive, cache_capacity=cache_capacity)

    def base(self, state):
        return state.base

    def calls(self, state):
        target, second = self.roles
        return {target: state.base.steps * self.method.target_positions, second: state.draft_steps}


def as_engine(decoder: Any, sampling: SamplingConfig) -> Engine:
    """The engine of a `Model` or a `PairDecoder` (the search functions' `model` argument)."""
    if isinstance(decoder, PairDecoder):
        return PairEngine(decoder, sampling)
    if isinstance(decoder, Model) and not decoder.config.is_reward_model:
        return PlainEngine(decoder, sampling)
    raise TypeError(
        "model: expected a jaxsr.Model (language model) or a decoder from jaxsr.speculative_decoder / "
        f"contrastive_decoder / speculative_contrastive_decoder, got {type(decoder).__name__}"
    )


# -- one call: prompts in, results out ----------------------------------------------------------------


def decode_with(
    decoder: PairDecoder,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    num_samples: int,
    seed: int,
    chat: bool | None,
    stop_token_ids: Sequence[int],
    max_rows: int,
    prompt_offset: int,
    baseline: bool = False,
    measure_cost: bool = False,
) -> list[Result]:
    """Decode `prompts` with `decoder`. For the speculative kinds the stats add acceptance, the
    measured cost ratios (`measure_cost`), the predicted speed-up and, with `baseline`, the measured one
    against the method's own baseline: the target alone (SD) or contrastive decoding (SCD)."""
    sampling, max_new_tokens, num_samples, max_rows, seed = check_decode_args(
        sampling, max_new_tokens, num_samples, max_rows, seed
    )
    target, second = decoder.target, decoder.second
    encoded = encode_prompts(target, prompts, chat=chat)
    pair.check_pair_context(target, second, encoded, max_new_tokens)
    stop_token_ids, prompt_offset = check_row_ids(target, stop_token_ids, prompt_offset)
    options = dict(
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=stop_token_ids,
        max_rows=max_rows,
        prompt_offset=prompt_offset,
    )
    method, weights = decoder.method(sampling), decoder.weights
    t0 = time.perf_counter()
    run = pair.decode_pairs(method, weights, target, second, encoded, roles=decoder.roles, **options)
    wall = (time.perf_counter() - t0) / len(encoded)
    if decoder.kind == "contrastive":
        return to_results(target, prompts, run.samples, run.stats, wall)

    gamma, contrastive = decoder.gamma, decoder.contrast is not None
    costs = pair.measure_call_costs(target, second, run, gamma) if measure_cost else None
    cost, verify = costs or (None, None)
    stats = [
        {**st, "gamma": gamma, **pair.acceptance_stats(rows)}
        for st, rows in zip(run.stats, run.rows, strict=True)
    ]
    for st in stats:
        st.update(cost_ratio=cost, verify_cost_ratio=verify, expected_speedup=None)
        if st["acceptance_rate"] is not None and cost is not None:
            baseline_cost = 1 + cost if contrastive else 1.0  # CD runs both models every token
            predicted = pair.expected_speedup(st["acceptance_rate"], gamma, cost, verify, baseline_cost)
            st["expected_speedup"] = pair.finite_or_none(predicted)
    if baseline:
        if contrastive:  # SCD against contrastive decoding
            reference = ContrastiveDecoding(sampling)
            base_s = pair.decode_pairs(
                reference, weights, target, second, encoded, roles=decoder.roles, **options
            ).decode_s
        else:  # SD against sampling the target alone
            _, plain = sample_many(target, encoded, sampling=sampling, **options)
            base_s = sum(st["decode_s"] for st in plain)
        for st in stats:
            st.update(
                baseline_decode_s=base_s / len(encoded),
                speedup=base_s / run.decode_s if run.decode_s > 0 else None,
            )
    return to_results(target, prompts, run.samples, stats, wall)


def contrastive_decode(
    expert: Model,
    amateur: Model,
    prompts: Prompts,
    *,
    alpha: float = 0.1,
    beta: float = 0.5,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    num_samples: int = 1,
    seed: int = 0,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
) -> list[Result]:
    """Sample `num_samples` responses per prompt from the contrastive distribution (see
    `jaxsr.decoding.contrastive`); greedy when `sampling.temperature == 0`. Prompts are encoded with the
    expert's tokenizer and stop on the expert's EOS ids (plus `stop_token_ids`). `Sample.logprob` is the
    expert's own log-probability of the tokens; `stats["token_forwards"]` has "expert" and "amateur"."""
    decoder = contrastive_decoder(expert, amateur, alpha=alpha, beta=beta, contrast=contrast, tau=tau)
    return decode_with(
        decoder, prompts, max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples,
        seed=seed, chat=chat, stop_token_ids=stop_token_ids, max_rows=max_rows, prompt_offset=prompt_offset,
    )  # fmt: skip


def speculative_decode(
    target: Model,
    draft: Model,
    prompts: Prompts,
    *,
    gamma: int = 4,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
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
    decoder = speculative_decoder(target, draft, gamma=gamma)
    return decode_with(
        decoder, prompts, max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples,
        seed=seed, chat=chat, stop_token_ids=stop_token_ids, max_rows=max_rows, prompt_offset=prompt_offset,
        baseline=baseline, measure_cost=measure_cost,
    )  # fmt: skip


def speculative_contrastive_decode(
    expert: Model,
    amateur: Model,
    prompts: Prompts,
    *,
    gamma: int = 4,
    alpha: float = 0.1,
    beta: float = 0.5,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
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
    decoder = speculative_contrastive_decoder(
        expert, amateur, gamma=gamma, alpha=alpha, beta=beta, contrast=contrast, tau=tau
    )
    return decode_with(
        decoder, prompts, max_new_tokens=max_new_tokens, sampling=sampling, num_samples=num_samples,
        seed=seed, chat=chat, stop_token_ids=stop_token_ids, max_rows=max_rows, prompt_offset=prompt_offset,
        baseline=baseline, measure_cost=measure_cost,
    )  # fmt: skip
