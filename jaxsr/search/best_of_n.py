"""Best-of-N: sample N responses per prompt, score every one, return the argmax."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxsr.checks import check_callback, check_positive_int, check_responses_fit
from jaxsr.decoding.driver import Sampler, as_sampler, decode, default_rows, samples_of
from jaxsr.decoding.inputs import Options, check_sampling, prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards import as_reward
from jaxsr.search.candidates import best, check_reward, score_ids, score_samples, token_scorer
from jaxsr.search.memory import best_of_n_rows
from jaxsr.timing import Stopwatch


def best_of_n(
    model: Model | Sampler,
    reward: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    memory_budget: int | str | None = None,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    prompt_offset: int | Sequence[int] = 0,
    on_result: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """N samples per prompt, all scored; `Result.best` is the argmax, `Result.samples` all N.

    `model` is a language model or a two-model `Sampler` (`jaxsr.speculative_decoder` etc.). With a
    `memory_budget` (KV token slots or bytes) the N rows are decoded in chunks that fit it, prompt
    caches included (`stats["kv_bytes"]`: the caches of the batch a prompt was decoded in).
    `on_result(i, result)` is called with prompt `i`'s result as soon as it is scored."""
    sampler = as_sampler(model, check_sampling(sampling))
    reward = as_reward(reward)
    n = check_positive_int("n", n)
    check_callback("on_result", on_result)
    options = Options(max_new_tokens, sampling, seed, chat, stop_token_ids, prompt_offset)
    request = prepare(sampler.models, prompts, options)
    check_reward(reward, sampler.target, prompts, request.encoded)
    lm, encoded, max_new_tokens = sampler.target, request.encoded, request.max_new_tokens
    check_responses_fit("n", len(encoded) * n, max_new_tokens)
    if memory_budget is None:
        max_rows = default_rows(sampler)
    else:
        max_rows = best_of_n_rows(sampler, memory_budget, encoded, n, max_new_tokens)
    t0 = time.perf_counter()
    run = decode(sampler, request, num_samples=n, max_rows=max_rows)
    sample_s = time.perf_counter() - t0
    results = []
    for i, (prompt, ids, rows, st) in enumerate(zip(prompts, encoded, run.rows, run.stats, strict=True)):
        watch = Stopwatch()
        forwards_before = reward.token_forwards
        samples = samples_of(lm, rows)
        scorer = token_scorer(lm, reward, prompt, max_new_tokens)
        on_device = (
            None if scorer is None else score_ids(scorer, [s.token_ids for s in samples], max_new_tokens)
        )
        samples = score_samples(lm, reward, prompt, ids, samples, on_device)
        st["token_forwards"]["reward"] = reward.token_forwards - forwards_before
        st["kv_bytes"] = st["kv_slots"] * sampler.slot_bytes
        st["scoring_s"], compiled = watch.split()
        st["compile_s"] += compiled
        st["wall_s"] = sample_s / len(encoded) + st["scoring_s"] + compiled
        results.append(Result(prompt=prompt, samples=samples, best=best(samples), stats=st))
        if on_result is not None:
            on_result(i, results[-1])
    return results
