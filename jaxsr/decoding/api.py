"""The public decoding calls: `generate`, the two-model decoders, and the calls that decode with them.

`speculative_decoder`, `contrastive_decoder` and `speculative_contrastive_decoder` validate a pair and
its method's arguments and return a `Sampler`; `best_of_n` and `speculative_rejection` take a `Model`
(plain sampling) or a `Sampler`, so Speculative Rejection over speculative contrastive decoding is one
call. Every call gathers its shared options in one `inputs.Options`, validates and encodes them once
(`inputs.prepare`) and runs the one driver."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxsr.checks import check_bool, check_positive_int, check_responses_fit, check_rows_fit
from jaxsr.decoding import cost
from jaxsr.decoding.continuous import decode
from jaxsr.decoding.contrast import ContrastKind, make_contrast
from jaxsr.decoding.driver import Run, Sampler, as_sampler, samples_of
from jaxsr.decoding.inputs import (
    Options,
    Request,
    check_contrastive_pair,
    check_pair,
    prepare,
)
from jaxsr.decoding.memory import call_rows
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.speculative import SpeculativeContrastiveDecoding, SpeculativeDecoding
from jaxsr.decoding.state import DecodeState
from jaxsr.decoding.steps import ContrastiveDecoding
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.sharding import local_devices_of

Prompts = Sequence[str] | Sequence[Sequence[int]]


def _check_gamma(gamma: Any, *models: Model) -> int:
    """γ draft tokens per step: each row's cache holds γ + 1 positions beyond its response."""
    gamma = check_positive_int("gamma", gamma)
    context = min(m.config.context for m in models)
    if gamma >= context:
        raise ValueError(f"gamma: {gamma} draft tokens per step do not fit the models' context of {context}")
    return gamma


def speculative_decoder(target: Model, draft: Model, *, gamma: int = 4) -> Sampler:
    """Speculative decoding: samples exactly from `target`, `draft` proposing γ tokens per call (any
    draft distribution keeps it exact: a draft with a reduced output layer, `head_token_ids`, too)."""
    check_pair(target, draft, ("target", "draft"))
    return Sampler((target, draft), SpeculativeDecoding(gamma=_check_gamma(gamma, target, draft)))


def contrastive_decoder(
    expert: Model,
    amateur: Model,
    *,
    alpha: float = 0.1,
    beta: float = 0.5,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
) -> Sampler:
    """Contrastive decoding (expert and amateur step together every token)."""
    check_contrastive_pair(expert, amateur)
    weights = make_contrast(alpha, beta, contrast=contrast, tau=tau)
    return Sampler((expert, amateur), ContrastiveDecoding(), weights)


def speculative_contrastive_decoder(
    expert: Model,
    amateur: Model,
    *,
    gamma: int = 4,
    alpha: float = 0.1,
    beta: float = 0.5,
    contrast: ContrastKind = "obrien",
    tau: float = 1.0,
) -> Sampler:
    """Speculative contrastive decoding: exactly contrastive decoding's distribution, the amateur
    drafting γ tokens per expert call."""
    check_contrastive_pair(expert, amateur)
    weights = make_contrast(alpha, beta, contrast=contrast, tau=tau)
    method = SpeculativeContrastiveDecoding(gamma=_check_gamma(gamma, expert, amateur))
    return Sampler((expert, amateur), method, weights)


def decode_prompts(
    sampler: Sampler,
    prompts: Prompts,
    options: Options,
    *,
    num_samples: int,
    max_rows: int | None,
    baseline: bool = False,
    measure_cost: bool = False,
) -> list[Result]:
    """Decode `prompts` with `sampler`, one `Result` per prompt. Speculative methods' stats add the
    predicted speed-up from the measured cost ratios (`measure_cost`: timing probes) and, with
    `baseline`, the measured one against the method's own baseline (`Method.baseline`: the target
    alone for SD, contrastive decoding for SCD)."""
    baseline, measure_cost = check_bool("baseline", baseline), check_bool("measure_cost", measure_cost)
    request = prepare(sampler.models, prompts, options)
    results: dict[int, Result] = {}
    run = decode_request(
        sampler, request, num_samples=num_samples, max_rows=max_rows, on_result=results.__setitem__
    )
    results = [results[i] for i in range(len(request.encoded))]
    if isinstance(sampler.method, SpeculativeDecoding) and (baseline or measure_cost):
        decoding = sampler.with_sampling(request.sampling)
        measured = speculative_call_stats(decoding, request, run, results, baseline, measure_cost)
        results = [
            dataclasses.replace(r, stats={**r.stats, **st}) for r, st in zip(results, measured, strict=True)
        ]
    return results


def decode_request(
    sampler: Sampler,
    request: Request,
    *,
    num_samples: int,
    max_rows: int | None,
    on_result: Callable[[int, Result], None],
) -> Run:
    """Decode a prepared request, handing each prompt's `Result` to `on_result(i, result)` (`i` its
    position in the request) as soon as its rows are done: a caller keeps what it wants of them (a job
    writes each and keeps none). `wall_s` is the seconds spent on the prompt (its shares of prefill,
    decoding and compiling); speculative methods add γ and the prompt's acceptance (`cost`)."""
    num_samples = check_positive_int("num_samples", num_samples)
    if max_rows is not None:
        max_rows = check_positive_int("max_rows", max_rows)
    max_rows, least = call_rows(sampler, None, request.encoded, num_samples, request.max_new_tokens, max_rows)
    rows = len(request.encoded) * num_samples
    check_responses_fit("num_samples", rows, request.max_new_tokens)
    mesh = sampler.mesh
    check_rows_fit(  # a lower bound on one batch's row caches (as `decode` sizes them; prompts aside)
        "max_rows",
        min(max_rows, rows) * sampler.cache_slots(bucket(request.max_new_tokens)) * sampler.slot_bytes,
        local_devices_of(mesh),
        "give a smaller max_rows",
    )
    sampler = sampler.with_sampling(request.sampling)
    speculative = isinstance(sampler.method, SpeculativeDecoding)

    def done(finished: list[tuple[int, DecodeState, dict[str, Any]]]) -> None:
        for i, rows, stats in finished:
            stats = {"wall_s": stats["prefill_s"] + stats["decode_s"] + stats["compile_s"], **stats}
            if speculative:  # the cost ratios are the call's (`speculative_call_stats`)
                stats.update(gamma=sampler.method.gamma, **cost.acceptance_stats(rows), **NOT_MEASURED)
            samples = samples_of(sampler.target, rows, request.stop)
            on_result(i, Result(prompt=request.prompts[i], samples=samples, stats=stats))

    return decode(
        sampler, request, num_samples=num_samples, max_rows=max_rows, on_done=done, least_slots=least
    )


NOT_MEASURED = {"cost_ratio": None, "verify_cost_ratio": None, "expected_speedup": None}
"""A speculative call's cost entries until measured (`measure_cost`)."""


def speculative_call_stats(
    sampler: Sampler,
    request: Request,
    run: Run,
    results: list[Result],
    baseline: bool,
    measure_cost: bool,
) -> list[dict[str, Any]]:
    """Per prompt: the cost ratios and predicted speed-up (`measure_cost`) from its acceptance, and
    the measured speed-up against the method's baseline run on the same prompts (`baseline`)."""
    method = sampler.method
    gamma, contrastive = method.gamma, isinstance(method, SpeculativeContrastiveDecoding)
    costs = cost.measure_call_costs(sampler, run.shapes, gamma) if measure_cost else None
    cost_ratio, verify = costs or (None, None)
    stats = []
    for result in results:
        acceptance = result.stats["acceptance_rate"]
        st = {"cost_ratio": cost_ratio, "verify_cost_ratio": verify, "expected_speedup": None}
        if acceptance is not None and cost_ratio is not None:
            baseline_cost = 1 + cost_ratio if contrastive else 1.0  # CD runs both models every token
            predicted = cost.expected_speedup(acceptance, gamma, cost_ratio, verify, baseline_cost)
            st["expected_speedup"] = cost.finite_or_none(predicted)
        stats.append(st)
    if baseline:
        reference = method.baseline
        models = sampler.models[: reference.num_models]
        contrast = sampler.contrast if contrastive else None
        reference_sampler = Sampler(models, reference, contrast, sampler.sampling)
        base_s = decode(
            reference_sampler, request, num_samples=run.num_samples, max_rows=run.max_rows,
            least_slots=run.least_slots,
        ).decode_s  # fmt: skip
        for st in stats:
            st.update(
                baseline_decode_s=base_s / len(request.encoded),
                speedup=base_s / run.decode_s if run.decode_s > 0 else None,
            )
    return stats


def generate(
    model: Model | Sampler,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    num_samples: int = 1,
    seed: int = 0,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    max_rows: int | None = None,
    prompt_offset: int | Sequence[int] = 0,
) -> list[Result]:
    """Sample `num_samples` responses to each prompt (one `Result` per prompt, in order) from a
    language model, or with any `Sampler` (a speculative or contrastive decoder, or your own `Method`);
    `sampling` None keeps the sampler's own (a model's: `SamplingConfig()`).

    `max_rows` bounds the rows decoded together (None: what a GPU's or TPU's free memory holds, each
    row's decode-step working memory counted, and on CPU 64 a `data` shard); `prompt_offset` is the
    index of `prompts[0]` in a larger job, or a list of each prompt's index, so split, reordered or
    resumed jobs draw the same random streams as one whole call."""
    sampler = as_sampler(model, sampling)
    options = Options(max_new_tokens, sampler.sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    return decode_prompts(sampler, prompts, options, num_samples=num_samples, max_rows=max_rows)


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
    stop: Sequence[str] = (),
    max_rows: int | None = None,
    prompt_offset: int | Sequence[int] = 0,
) -> list[Result]:
    """Sample `num_samples` responses per prompt from the contrastive distribution (see
    `jaxsr.decoding.contrast`); greedy when `sampling.temperature == 0`. Prompts are encoded with the
    expert's tokenizer and stop on the expert's EOS ids (plus `stop_token_ids`). `Sample.logprob` is the
    expert's own log-probability of the tokens; `stats["token_forwards"]` has "expert" and "amateur"."""
    sampler = contrastive_decoder(expert, amateur, alpha=alpha, beta=beta, contrast=contrast, tau=tau)
    options = Options(max_new_tokens, sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    return decode_prompts(sampler, prompts, options, num_samples=num_samples, max_rows=max_rows)


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
    stop: Sequence[str] = (),
    max_rows: int | None = None,
    prompt_offset: int | Sequence[int] = 0,
    baseline: bool = False,
    measure_cost: bool = False,
) -> list[Result]:
    """Samples from `target` (after `sampling`'s processing) exactly, drafting γ tokens per target call.

    `Result.stats`: acceptance_rate λ, tokens_per_target_call, cost_ratio c (one draft call / one
    1-token target call) and verify_cost_ratio v (one (γ+1)-token verification call / one 1-token target
    call), measured with timing probes on this call's shapes when `measure_cost=True` (None otherwise),
    and expected_speedup (see `cost.expected_speedup`: (1−λ^{γ+1}) / ((1−λ)(v + cγ + cλ^γ)),
    Leviathan et al.'s formula when v = 1); with `baseline=True`
    also plain target sampling is run and timed: baseline_decode_s and speedup.
    `token_forwards` has "generator" (the target) and "draft". Prompts are encoded with the target's
    tokenizer and stop on its EOS ids."""
    sampler = speculative_decoder(target, draft, gamma=gamma)
    options = Options(max_new_tokens, sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    return decode_prompts(
        sampler, prompts, options, num_samples=num_samples, max_rows=max_rows,
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
    stop: Sequence[str] = (),
    max_rows: int | None = None,
    prompt_offset: int | Sequence[int] = 0,
    baseline: bool = False,
    measure_cost: bool = False,
) -> list[Result]:
    """Samples exactly from `contrastive_decode`'s distribution, the amateur drafting γ tokens per
    expert call (it is both the draft and the contrast). Stats as `speculative_decode`, with
    `token_forwards` keys "expert" and "amateur"; the baseline is `contrastive_decode`, which costs
    1 + c target calls per token, so expected_speedup is (1+c)·E[tokens per step] / (v + cγ + cλ^γ)."""
    sampler = speculative_contrastive_decoder(
        expert, amateur, gamma=gamma, alpha=alpha, beta=beta, contrast=contrast, tau=tau
    )
    options = Options(max_new_tokens, sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    return decode_prompts(
        sampler, prompts, options, num_samples=num_samples, max_rows=max_rows,
        baseline=baseline, measure_cost=measure_cost,
    )  # fmt: skip
