"""`jaxsr.generate`: batched sampling of several responses per prompt."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsr.decoding.prompts import (
    check_context,
    check_language_model,
    check_positive_int,
    encode_prompts,
    left_pad,
)
from jaxsr.decoding.sampler import decode_loop, init_state, prefill
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.sharding import mesh_of, on_mesh, padded_rows

DEFAULT_MAX_ROWS = 64


@dataclasses.dataclass
class RawSample:
    prompt_index: int
    sample_index: int
    tokens: list[int]
    """Generated tokens without the stop token."""
    finished: bool
    logprob: float


def check_sampling(sampling: Any) -> SamplingConfig:
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling: expected a jaxsr.SamplingConfig, got {type(sampling).__name__}")
    return sampling


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
        raise TypeError(f"seed: expected an int in [0, 2**32), got {seed!r}")
    return int(seed)


def check_decode_args(
    sampling: Any, max_new_tokens: Any, num_samples: Any, max_rows: Any, seed: Any
) -> tuple[SamplingConfig, int, int, int, int]:
    """The arguments every decoding call shares, validated (errors name the argument)."""
    return (
        check_sampling(sampling),
        check_positive_int("max_new_tokens", max_new_tokens),
        check_positive_int("num_samples", num_samples),
        check_positive_int("max_rows", max_rows),
        check_seed(seed),
    )


MAX_PROMPT_ID = 2**30  # prompt ids are int32 on device; a job of any size stays far below


def check_row_ids(model: Model, stop_token_ids: Any, prompt_offset: Any) -> tuple[list[int], int]:
    """Extra stop ids (token ids of `model`) and the index of a call's first prompt in its job."""
    if isinstance(stop_token_ids, str | bytes) or not isinstance(stop_token_ids, Sequence | np.ndarray):
        raise TypeError(f"stop_token_ids: expected a sequence of token ids, got {stop_token_ids!r}")
    vocab = model.config.vocab_size
    for i in stop_token_ids:
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i < vocab:
            raise ValueError(f"stop_token_ids: expected token ids in [0, {vocab}), got {i!r}")
    if isinstance(prompt_offset, bool) or not isinstance(prompt_offset, int | np.integer):
        raise TypeError(f"prompt_offset: expected an int, got {type(prompt_offset).__name__}")
    if not 0 <= prompt_offset < MAX_PROMPT_ID:
        raise ValueError(f"prompt_offset: expected an int in [0, 2**30), got {prompt_offset}")
    return [int(i) for i in stop_token_ids], int(prompt_offset)


def stop_id_matrix(model: Model, rows: int, extra: Sequence[int]) -> np.ndarray:
    ids = list(dict.fromkeys([*model.eos_token_ids, *extra]))
    width = bucket(len(ids), 1) if ids else 1
    matrix = np.full((rows, width), -1, np.int32)
    matrix[:, : len(ids)] = ids
    return matrix


def batches(
    prompts: list[list[int]], num_samples: int, max_rows: int, mesh: Mesh | None = None
) -> Iterator[tuple[int, int, int, int]]:
    """(first prompt, padded prompt count P, samples per prompt G, rows per prompt R) of each batch of
    at most `max_rows` rows (plus mesh padding): G = min(num_samples, max_rows) samples of P prompts, P a
    power of two (one compiled shape for every full batch); a prompt with more than G samples gets them
    in several batches. R ≥ G pads each prompt's rows with dead ones so the batch splits over the mesh's
    `data` shards (R = G without a mesh)."""
    G = min(num_samples, max_rows)
    per_batch = 1 << (max(1, max_rows // G).bit_length() - 1)
    for start in range(0, len(prompts), per_batch):
        P = min(bucket(len(prompts[start : start + per_batch]), 1), per_batch)
        yield start, P, G, padded_rows(G, mesh, groups=P)


def row_inputs(
    model: Model,
    *,
    prompts: int,
    real_prompts: int,
    samples_per_prompt: int,
    first_sample: int,
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    first_prompt_id: int,
    stop_token_ids: Sequence[int],
    live_per_prompt: int | None = None,
) -> dict[str, Any]:
    """`init_state`'s per-row keywords for samples first_sample … first_sample + G − 1 of `prompts`
    prompts (rows grouped by prompt; padding prompts and samples past `num_samples` are not alive, nor
    a prompt's rows past `live_per_prompt`: mesh padding, see `batches`).
    A row's (seed, prompt id, sample id) is its random stream, whatever the batch it is in."""
    G = samples_per_prompt
    live = G if live_per_prompt is None else live_per_prompt
    sample_ids = np.tile(first_sample + np.arange(G), prompts)
    real = np.repeat(np.arange(prompts) < real_prompts, G) & np.tile(np.arange(G) < live, prompts)
    return dict(
        samples_per_prompt=G,
        seed=np.uint32(seed),
        prompt_ids=jnp.arange(prompts, dtype=jnp.int32) + first_prompt_id,
        sample_ids=jnp.asarray(sample_ids, jnp.int32),
        alive=jnp.asarray(real & (sample_ids < num_samples)),
        max_new_tokens=jnp.full((prompts * G,), max_new_tokens, jnp.int32),
        stop_ids=jnp.asarray(stop_id_matrix(model, prompts * G, stop_token_ids)),
    )


def raw_samples(
    tokens: np.ndarray,
    num_generated: np.ndarray,
    finished: np.ndarray,
    alive: np.ndarray,
    logprob: np.ndarray,
    *,
    samples_per_prompt: int,
    first_prompt: int,
    first_sample: int,
) -> Iterator[tuple[int, RawSample]]:
    """(row, sample) for each alive row of a decoded batch, from host copies of its state."""
    for row in np.flatnonzero(alive):
        p, s = divmod(int(row), samples_per_prompt)
        n = int(num_generated[row]) - bool(finished[row])
        tokens_row = tokens[row, :n].tolist()
        yield (
            int(row),
            RawSample(
                first_prompt + p, first_sample + s, tokens_row, bool(finished[row]), float(logprob[row])
            ),
        )


def sample_many(
    model: Model,
    prompts: list[list[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
) -> tuple[list[list[RawSample]], list[dict[str, Any]]]:
    """Sample `num_samples` continuations of each prompt; each prompt is prefilled exactly once.

    Returns per prompt its samples (by sample index) and stats (work of a batch is shared evenly
    among the real prompts in it; `batch_rows` and `kv_slots` — prompt + row cache slots — describe
    the batch the prompt was decoded in). Compilation is timed apart (`compile_s`) so that `decode_s`
    measures decoding alone."""
    capacity = bucket(max_new_tokens)
    samples: list[list[RawSample]] = [[] for _ in prompts]
    stats: list[dict[str, Any]] = [{} for _ in prompts]
    with on_mesh(model):
        for start, P, G, R in batches(prompts, num_samples, max_rows, mesh_of(model)):
            chunk = prompts[start : start + P]
            S = bucket(max(len(p) for p in chunk))
            t0 = time.perf_counter()
            tokens, mask = left_pad(chunk, P, S)
            last_logits, prompt_cache = prefill(
                model.graph, model.params, jnp.asarray(tokens), jnp.asarray(mask)
            )
            jax.block_until_ready(last_logits)
            prefill_s = time.perf_counter() - t0
            forwards = P * S
            compile_s = decode_s = 0.0
            for first in range(0, num_samples, G):
                rows = row_inputs(
                    model, prompts=P, real_prompts=len(chunk), samples_per_prompt=R, live_per_prompt=G,
                    first_sample=first, num_samples=num_samples, max_new_tokens=max_new_tokens, seed=seed,
                    first_prompt_id=prompt_offset + start, stop_token_ids=stop_token_ids,
                )  # fmt: skip
                state = init_state(last_logits, prompt_cache, capacity=capacity, sampling=sampling, **rows)
                t1 = time.perf_counter()
                loop = decode_loop.lower(
                    model.graph, model.params, state, prompt_cache, sampling=sampling
                ).compile()
                t2 = time.perf_counter()
                state = loop(model.params, state, prompt_cache)
                out = jax.device_get(
                    (
                        state.tokens,
                        state.num_generated,
                        state.finished,
                        state.alive,
                        state.logprob_sum,
                        state.steps,
                    )
                )
                compile_s += t2 - t1
                decode_s += time.perf_counter() - t2
                forwards += int(out[-1]) * P * R
                for _, raw in raw_samples(
                    *out[:-1], samples_per_prompt=R, first_prompt=start, first_sample=first
                ):
                    samples[raw.prompt_index].append(raw)
            for p in range(len(chunk)):
                stats[start + p] = {
                    "prefill_s": prefill_s / len(chunk),
                    "compile_s": compile_s / len(chunk),
                    "decode_s": decode_s / len(chunk),
                    "token_forwards": {"generator": forwards // len(chunk)},
                    "batch_rows": P * R,
                    "kv_slots": P * S + P * R * capacity,
                }
    for rows in samples:
        rows.sort(key=lambda r: r.sample_index)
    return samples, stats


def to_sample(model: Model, raw: RawSample, score: float | None = None) -> Sample:
    text = model.tokenizer.decode(raw.tokens, skip_special_tokens=True) if model.tokenizer else ""
    return Sample(
        token_ids=raw.tokens,
        text=text,
        score=score,
        finished=raw.finished,
        logprob=raw.logprob,
        index=raw.sample_index,
    )


def to_results(
    model: Model,
    prompts: Sequence[Any],
    samples: list[list[RawSample]],
    stats: list[dict[str, Any]],
    wall: float,
) -> list[Result]:
    """One `Result` per prompt from sampled rows (texts decoded with `model`'s tokenizer)."""
    return [
        Result(prompt=prompt, samples=[to_sample(model, r) for r in rows], stats={"wall_s": wall, **st})
        for prompt, rows, st in zip(prompts, samples, stats, strict=True)
    ]


def generate(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    num_samples: int = 1,
    seed: int = 0,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
    prompt_offset: int = 0,
) -> list[Result]:
    """Sample `num_samples` responses to each prompt (one `Result` per prompt, in order).

    `max_rows` bounds the rows decoded together; `prompt_offset` is the index of `prompts[0]` in a
    larger job, so split or resumed jobs draw the same random streams as one whole call."""
    check_language_model(model, "model")
    sampling, max_new_tokens, num_samples, max_rows, seed = check_decode_args(
        sampling, max_new_tokens, num_samples, max_rows, seed
    )
    encoded = encode_prompts(model, prompts, chat=chat)
    check_context(model, encoded, max_new_tokens)
    stop_token_ids, prompt_offset = check_row_ids(model, stop_token_ids, prompt_offset)
    t0 = time.perf_counter()
    samples, stats = sample_many(
        model,
        encoded,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        stop_token_ids=stop_token_ids,
        max_rows=max_rows,
        prompt_offset=prompt_offset,
    )
    return to_results(model, prompts, samples, stats, (time.perf_counter() - t0) / len(encoded))
