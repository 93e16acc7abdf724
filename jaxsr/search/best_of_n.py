"""Best-of-N: sample N responses per prompt, score every one, return the argmax."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsr.decoding.decoders import PairDecoder, as_engine
from jaxsr.decoding.generate import DEFAULT_MAX_ROWS, check_row_ids, check_sampling, check_seed
from jaxsr.decoding.prompts import check_positive_int, encode_prompts
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.search.candidates import best, score_ids, score_rows, token_scorer
from jaxsr.search.memory import budget_slots


def best_of_n(
    model: Model | PairDecoder,
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

    `model` is a language model or a two-model decoder (`jaxsr.speculative_decoder` etc.). With a
    `memory_budget` (KV token slots or bytes) the N rows are decoded in chunks that fit it, prompt
    caches included (`stats["kv_bytes"]`: the caches of the batch a prompt was decoded in)."""
    sampling = check_sampling(sampling)
    engine = as_engine(model, sampling)
    reward = as_reward(reward)
    n = check_positive_int("n", n)
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    seed = check_seed(seed)
    lm = engine.model
    encoded = encode_prompts(lm, prompts, chat=chat)
    engine.check_context(encoded, max_new_tokens)
    stop_token_ids, prompt_offset = check_row_ids(lm, stop_token_ids, prompt_offset)
    max_rows = DEFAULT_MAX_ROWS
    if memory_budget is not None:
        slots = budget_slots(memory_budget, engine.slot_bytes)
        per_row = bucket(max_new_tokens) + engine.headroom
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
    options = dict(
        num_samples=n,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=stop_token_ids,
        max_rows=max_rows,
        prompt_offset=prompt_offset,
    )
    raw, stats = engine.sample(encoded, **options)
    sample_s = time.perf_counter() - t0
    results = []
    for prompt, ids, rows, st in zip(prompts, encoded, raw, stats, strict=True):
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
            np.array([len(r.tokens) + r.finished for r in rows]),
            None if scorer is None else score_ids(scorer, token_lists, max_new_tokens),
        )
        samples = [
            Sample(
                token_ids=r.tokens,
                text=t,
                score=float(s),
                finished=r.finished,
                logprob=r.logprob,
                index=r.sample_index,
            )
            for r, t, s in zip(rows, texts, scores, strict=True)
        ]
        st["token_forwards"]["reward"] = reward.token_forwards - forwards_before
        st["kv_bytes"] = st["kv_slots"] * engine.slot_bytes
        st["scoring_s"] = time.perf_counter() - t1
        st["wall_s"] = sample_s / len(encoded) + st["scoring_s"]
        results.append(Result(prompt=prompt, samples=samples, best=best(samples), stats=st))
    return results
