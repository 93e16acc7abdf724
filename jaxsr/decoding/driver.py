"""The sampler (models + method + contrast weights) and the one host driver that decodes prompts
with it: batch the prompts, prefill each once per model, compile once per shape, run the token loop,
and bring every row back to the host in one transfer. The search procedures drive the same sampler
through its jitted operations (prefill, init, decode until a pause, compact survivors)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsr import text
from jaxsr.decoding import loop
from jaxsr.decoding.contrast import Contrast
from jaxsr.decoding.inputs import Request
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState, HostRows, compact
from jaxsr.decoding.steps import Method, PlainSampling
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Sample
from jaxsr.sharding import mesh_of, on_mesh, padded_rows

DEFAULT_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Models decoding as one: `models[0]` is the target (the model sampled from, or the expert; its
    tokenizer, EOS ids and log-probabilities are the samples'), the others are what `method` runs
    beside it (a draft or an amateur, sharing its vocabulary). Build one with `jaxsr.speculative_decoder`,
    `contrastive_decoder`, `speculative_contrastive_decoder`, or `as_sampler(model)` for plain sampling."""

    models: tuple[Model, ...]
    method: Method
    contrast: Contrast | None = None
    """Traced contrast weights (contrastive methods), else None."""

    @property
    def target(self) -> Model:
        return self.models[0]

    @property
    def second(self) -> Model:
        """The draft or amateur."""
        return self.models[1]

    @property
    def roles(self) -> tuple[str, ...]:
        """`token_forwards` keys of the models, in order."""
        return self.method.roles

    @property
    def headroom(self) -> int:
        return self.method.headroom

    @property
    def slot_bytes(self) -> int:
        """Bytes one token position takes in all of the sampler's caches."""
        return sum(m.kv_slot_bytes for m in self.models)

    @property
    def mesh(self) -> Mesh | None:
        return mesh_of(*self.models)

    def with_sampling(self, sampling: SamplingConfig) -> Sampler:
        return dataclasses.replace(self, method=self.method.with_sampling(sampling))

    def on_mesh(self):
        return on_mesh(*self.models)

    def prefill(self, tokens: jax.Array, mask: jax.Array) -> tuple[tuple, tuple]:
        """Prefill left-padded prompts once per model: (last-position logits, prompt caches)."""
        out = [loop.prefill(m.graph, m.params, tokens, mask) for m in self.models]
        return tuple(z for z, _ in out), tuple(c for _, c in out)

    def init_state(self, prefilled: tuple[tuple, tuple], **rows: Any) -> DecodeState:
        """New rows (keywords as `loop.init_state`'s, from `row_inputs`, `capacity`, `cache_capacity`)."""
        return loop.init_state(*prefilled, self.contrast, method=self.method, **rows)

    def compiled_loop(self, state: DecodeState, prompts: tuple) -> Any:
        """The decode loop compiled for this state's shapes (paused or not): (params, state, prompts,
        contrast, pause_at) → state."""
        return loop.decode_loop.lower(
            self.graphs,
            self.params,
            state,
            prompts,
            self.contrast,
            method=self.method,
            pause_at=loop.NO_PAUSE,
        ).compile()

    def decode_loop(self, state: DecodeState, prompts: tuple, pause_at: jax.Array) -> DecodeState:
        """Decode until every row is done or has `pause_at` tokens (the state is donated)."""
        return loop.decode_loop(
            self.graphs, self.params, state, prompts, self.contrast, method=self.method, pause_at=pause_at
        )

    def compact(self, state: DecodeState, index: jax.Array, alive: jax.Array, cache_capacity: int):
        return compact(state, index, alive, cache_capacity=cache_capacity)

    @property
    def graphs(self) -> tuple:
        return tuple(m.graph for m in self.models)

    @property
    def params(self) -> tuple:
        return tuple(m.params for m in self.models)


def as_sampler(sampler: Any, sampling: SamplingConfig) -> Sampler:
    """The sampler of a `Model` (plain sampling) or a `Sampler`, sampling with `sampling` (the
    search functions' `model` argument)."""
    if isinstance(sampler, Sampler):
        return sampler.with_sampling(sampling)
    if isinstance(sampler, Model) and not sampler.config.is_reward_model:
        return Sampler((sampler,), PlainSampling(sampling))
    raise TypeError(
        "model: expected a jaxsr.Model (language model) or a sampler from jaxsr.speculative_decoder / "
        f"contrastive_decoder / speculative_contrastive_decoder, got {type(sampler).__name__}"
    )


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


@dataclasses.dataclass
class RawSample:
    """One decoded row on the host: its response and counters, before text and score."""

    prompt_id: int
    """Global prompt index (the random stream's)."""
    sample_index: int
    tokens: list[int]
    """Generated tokens without the stop token."""
    finished: bool
    logprob: float
    num_generated: int
    """Committed tokens, the stop token included."""
    target_calls: int = 0
    accepted: int = 0
    tested: int = 0

    def to_sample(self, text: str, score: float | None = None) -> Sample:
        return Sample(
            token_ids=self.tokens,
            text=text,
            score=score,
            finished=self.finished,
            logprob=self.logprob,
            index=self.sample_index,
        )


def raw_samples(host: HostRows, rows: Sequence[int] | None = None) -> list[RawSample]:
    """The samples of `rows` (default: every alive row) of a decoded batch, in row order."""
    rows = np.flatnonzero(host.alive) if rows is None else rows
    counters = ("num_generated", "target_calls", "accepted", "tested")
    return [
        RawSample(
            prompt_id=int(host.prompt_id[r]),
            sample_index=int(host.sample_id[r]),
            tokens=host.response(r),
            finished=bool(host.finished[r]),
            logprob=float(host.logprob_sum[r]),
            **{name: int(getattr(host, name)[r]) for name in counters},
        )
        for r in rows
    ]


def samples_of(
    model: Model, raws: Sequence[RawSample], scores: Sequence[float] | None = None
) -> list[Sample]:
    """`Sample`s of decoded rows, texts decoded with `model`'s tokenizer in one batch."""
    texts = text.decode_batch(model.tokenizer, [r.tokens for r in raws])
    scores = [None] * len(raws) if scores is None else [float(s) for s in scores]
    return [r.to_sample(t, s) for r, t, s in zip(raws, texts, scores, strict=True)]


@dataclasses.dataclass
class Run:
    samples: list[list[RawSample]]
    """Per prompt, its samples by sample index."""
    stats: list[dict[str, Any]]
    decode_s: float
    """Total decode-loop time of the call (compilation excluded)."""
    shapes: Any = None
    """Shapes of the last batch's row caches and prompt caches (for `cost.measure_call_costs`: shapes
    only, so that no finished batch's cache stays alive while the next one decodes)."""


def decode(sampler: Sampler, request: Request, *, num_samples: int, max_rows: int = DEFAULT_MAX_ROWS) -> Run:
    """`num_samples` continuations of each prompt of `request`; each prompt is prefilled once per model.

    Per prompt, stats: the work of a batch shared evenly among its real prompts (`prefill_s`,
    `compile_s`, `decode_s`, `token_forwards` by role), `batch_rows` and `kv_slots` (prompt + row cache
    slots of one model) of the batch it was decoded in. Compilation is timed apart so that `decode_s`
    measures decoding alone."""
    prompts, target = request.encoded, sampler.target
    capacity = bucket(request.max_new_tokens)
    cache_capacity = capacity + sampler.headroom
    run = Run([[] for _ in prompts], [{} for _ in prompts], 0.0)
    with sampler.on_mesh():
        for start, P, G, R in batches(prompts, num_samples, max_rows, sampler.mesh):
            chunk = prompts[start : start + P]
            S = bucket(max(len(p) for p in chunk))
            t0 = time.perf_counter()
            tokens, mask = map(jnp.asarray, text.left_pad(chunk, P, S))
            logits, prompt_caches = sampler.prefill(tokens, mask)
            jax.block_until_ready(logits)
            prefill_s = time.perf_counter() - t0
            forwards = np.full(len(sampler.models), P * S)
            compile_s = decode_s = 0.0
            for first in range(0, num_samples, G):
                rows = row_inputs(
                    target, prompts=P, real_prompts=len(chunk), samples_per_prompt=R, live_per_prompt=G,
                    first_sample=first, num_samples=num_samples, max_new_tokens=request.max_new_tokens,
                    seed=request.seed, first_prompt_id=request.prompt_offset + start,
                    stop_token_ids=request.stop_token_ids,
                )  # fmt: skip
                state = sampler.init_state(
                    (logits, prompt_caches), capacity=capacity, cache_capacity=cache_capacity, **rows
                )
                t1 = time.perf_counter()
                compiled = sampler.compiled_loop(state, prompt_caches)
                t2 = time.perf_counter()
                state = compiled(
                    sampler.params, state, prompt_caches, sampler.contrast, pause_at=loop.NO_PAUSE
                )
                host = HostRows.read(state)
                compile_s += t2 - t1
                decode_s += time.perf_counter() - t2
                forwards += host.forwards.astype(np.int64) * P * R
                for raw in raw_samples(host):
                    run.samples[raw.prompt_id - request.prompt_offset].append(raw)
                run.shapes = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state.rows, prompt_caches)
                )
                del state
            run.decode_s += decode_s
            for p in range(len(chunk)):
                run.stats[start + p] = {
                    "prefill_s": prefill_s / len(chunk),
                    "compile_s": compile_s / len(chunk),
                    "decode_s": decode_s / len(chunk),
                    "token_forwards": {
                        role: int(n) // len(chunk) for role, n in zip(sampler.roles, forwards, strict=True)
                    },
                    "batch_rows": P * R,
                    "kv_slots": P * S + P * R * cache_capacity,
                }
    for rows in run.samples:
        rows.sort(key=lambda r: r.sample_index)
    return run
