"""Best-of-N: sample N responses per prompt, score every one, return the argmax."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsr.checks import check_positive_int, check_responses_fit
from jaxsr.decoding.driver import DEFAULT_MAX_ROWS, Sampler, as_sampler, decode
from jaxsr.decoding.inputs import check_sampling, prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards import as_reward
from jaxsr.search.candidates import best, check_reward, score_ids, score_rows, token_scorer
from jaxsr.search.memory import budget_slots


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
    prompt_offset: int = 0,
) -> list[Result]:
    """N samples per prompt, all scored; `Result.best` is the argmax, `Result.samples` all N.

    `model` is a language model or a two-model `Sampler` (`jaxsr.speculative_decoder` etc.). With a
    `memory_budget` (KV token slots or bytes) the N rows are decoded in chunks that fit it, prompt
    caches included (`stats["kv_bytes"]`: the caches of the batch a prompt was decoded in)."""
    sampler = as_sampler(model, check_sampling(sampling))
    reward = as_reward(reward)
    n = check_positive_int("n", n)
    request = prepare(
        sampler.models, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
        stop_token_ids=stop_token_ids, prompt_offset=prompt_offset,
    )  # fmt: skip
    check_reward(reward, sampler.target, prompts, request.encoded)
    lm, encoded, max_new_tokens = sampler.target, request.encoded, request.max_new_tokens
    check_responses_fit("n", len(encoded) * n, max_new_tokens)
    max_rows = DEFAULT_MAX_ROWS
    if memory_budget is not None:
        slots = budget_slots(memory_budget, sampler.slot_bytes, mesh=sampler.mesh)
        per_row = bucket(max_new_tokens) + sampler.headroom
        prompt_slots = bucket(max(map(len, encoded)))
        if slots < prompt_slots + per_row:
            raise ValueError(
                f"memory_budget: {slots} KV slots cannot hold one row ({prompt_slots + per_row})"
            )
        max_rows = max(1, 1 << ((slots - prompt_slots) // per_row).bit_length() - 1)
        # with fewer samples than rows a batch holds several prompts, each with its own prompt cache
        samples = min(n, max_rows)
        prompts_per_batch = max(1, slots // (prompt_slots + samples * per_row))
        max_rows = min(max_rows, samples * (1 << (prompts_per_batch.bit_length() - 1)))
    t0 = time.perf_counter()
    run = decode(sampler, request, num_samples=n, max_rows=max_rows)
    sample_s = time.perf_counter() - t0
    results = []
    for prompt, ids, rows, st in zip(prompts, encoded, run.samples, run.stats, strict=True):
        t1 = time.perf_counter()
        forwards_before = reward.token_forwards
        token_lists = [r.tokens for r in rows]
        scorer = token_scorer(lm, reward, prompt, max_new_tokens)
        scores, texts = score_rows(
            lm,
            reward,
            prompt,
            ids,
            token_lists,
            np.array([r.logprob for r in rows]),
            np.array([r.num_generated for r in rows]),
            None if scorer is None else score_ids(scorer, token_lists, max_new_tokens),
        )
        samples = [r.to_sample(t, float(s)) for r, t, s in zip(rows, texts, scores, strict=True)]
        st["token_forwards"]["reward"] = reward.token_forwards - forwards_before
        st["kv_bytes"] = st["kv_slots"] * sampler.slot_bytes
        st["scoring_s"] = time.perf_counter() - t1
        st["wall_s"] = sample_s / len(encoded) + st["scoring_s"]
        results.append(Result(prompt=prompt, samples=samples, best=best(samples), stats=st))
    return results
