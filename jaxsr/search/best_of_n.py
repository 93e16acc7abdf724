"""Best-of-N: sample N responses per prompt, score every one, return the argmax."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxsr.checks import check_callback, check_positive_int, check_responses_fit
from jaxsr.decoding.continuous import decode
from jaxsr.decoding.driver import Sampler, as_sampler, samples_of
from jaxsr.decoding.inputs import Options, Request, prepare
from jaxsr.decoding.memory import call_rows
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards import Reward, as_reward
from jaxsr.search.candidates import (
    best,
    check_reward,
    even_share,
    read_on_device,
    score_ids,
    score_prompts,
    score_samples,
    token_scorer,
)
from jaxsr.timing import Stopwatch


def best_of_n(
    model: Model | Sampler,
    reward: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    memory_budget: int | str | None = None,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    prompt_offset: int | Sequence[int] = 0,
    on_result: Callable[[int, Result], None] | None = None,
    max_rows: int | None = None,
) -> list[Result]:
    """N samples per prompt, all scored; `Result.best` is the argmax, `Result.samples` all N.

    `model` is a language model or a two-model `Sampler` (`jaxsr.speculative_decoder` etc.). With a
    `memory_budget` (KV token slots or bytes) the N rows are decoded in chunks that fit it, prompt
    caches included (`stats["kv_bytes"]`: the caches of the batch a prompt was decoded in); `max_rows`
    caps the rows decoded together (default: what the budget holds; without one, what a GPU's or
    TPU's free memory holds, decode-step working memory counted, and on CPU 64 a `data` shard). Prompts
    stream through the batch (`jaxsr.decoding.continuous`): `on_result(i, result)` is called with
    prompt `i`'s result as soon as its samples are scored."""
    sampler = as_sampler(model, sampling)
    reward = as_reward(reward)
    check_callback("on_result", on_result)
    options = Options(max_new_tokens, sampler.sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    request = prepare(sampler.models, prompts, options)
    results: dict[int, Result] = {}

    def keep(i: int, result: Result) -> None:
        results[i] = result
        if on_result is not None:
            on_result(i, result)

    search(sampler, reward, request, n=n, memory_budget=memory_budget, on_result=keep, max_rows=max_rows)
    return [results[i] for i in range(len(request.encoded))]


def search(
    sampler: Sampler,
    reward: Reward,
    request: Request,
    *,
    n: int,
    memory_budget: int | str | None,
    on_result: Callable[[int, Result], None],
    max_rows: int | None = None,
) -> None:
    """Best-of-N over a prepared request: each prompt's `Result` to `on_result(i, result)` as soon as
    its N samples are scored (the prompts whose samples end together are scored together)."""
    n = check_positive_int("n", n)
    if max_rows is not None:
        max_rows = check_positive_int("max_rows", max_rows)
    check_reward(reward, sampler.target, request.prompts, request.encoded)
    lm, encoded, max_new_tokens = sampler.target, request.encoded, request.max_new_tokens
    check_responses_fit("n", len(encoded) * n, max_new_tokens)
    max_rows, least = call_rows(sampler, memory_budget, encoded, n, max_new_tokens, max_rows)

    def scored(finished: list[tuple[int, DecodeState, dict[str, Any]]]) -> None:
        watch, before = Stopwatch(), reward.token_forwards
        items = [(request.prompts[i], encoded[i], rows) for i, rows, _ in finished]
        samples = score_rows(lm, reward, items, request)
        scoring_s, compiled = watch.split()
        forwards, count = reward.token_forwards - before, len(finished)
        for k, ((i, _, st), mine) in enumerate(zip(finished, samples, strict=True)):
            # the prompts were scored together: each takes an even share of the scoring
            st["token_forwards"]["reward"] = even_share(forwards, k, count)
            st["kv_bytes"] = st["kv_slots"] * sampler.slot_bytes
            st["scoring_s"] = scoring_s / count
            st["compile_s"] += compiled / count
            st["wall_s"] = st["prefill_s"] + st["decode_s"] + st["scoring_s"] + st["compile_s"]
            on_result(i, Result(prompt=request.prompts[i], samples=mine, best=best(mine), stats=st))

    decode(sampler, request, num_samples=n, max_rows=max_rows, on_done=scored, least_slots=least)


def score_rows(lm: Model, reward: Any, items: list[tuple[Any, list[int], Any]], request: Request) -> list:
    """Each (prompt, ids, decoded rows)'s samples, scored: on device where the reward reads the
    generator's ids as it reads their text (per prompt: its template prefix), the others through their
    text, together in shared batches."""
    samples = [samples_of(lm, rows, request.stop) for _, _, rows in items]
    by_text: list[tuple[int, np.ndarray]] = []
    for i, ((prompt, ids, _), mine) in enumerate(zip(items, samples, strict=True)):
        scorer = token_scorer(lm, reward, prompt, request.max_new_tokens)
        same = read_on_device(scorer, mine) if scorer is not None else np.zeros(len(mine), bool)
        if same.any():
            rows = np.flatnonzero(same)
            on_device = score_ids(scorer, [mine[j].token_ids for j in rows], request.max_new_tokens)
            place(mine, rows, score_samples(lm, reward, prompt, ids, [mine[j] for j in rows], on_device))
        if not same.all():
            by_text.append((i, np.flatnonzero(~same)))
    items = [(*items[i][:2], [samples[i][j] for j in rows]) for i, rows in by_text]
    for (i, rows), scored in zip(by_text, score_prompts(lm, reward, items), strict=True):
        place(samples[i], rows, scored)
    return samples


def place(samples: list, rows: np.ndarray, scored: list) -> None:
    """Put the scored samples back at their rows."""
    for j, sample in zip(rows, scored, strict=True):
        samples[j] = sample
