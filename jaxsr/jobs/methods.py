"""Turn a `JobConfig` into loaded models and a `solve(request, write)` function."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxsr.decoding.api import (
    contrastive_decoder,
    decode_request,
    speculative_contrastive_decoder,
    speculative_decoder,
)
from jaxsr.decoding.continuous import length_classes, slab_length, slab_programs
from jaxsr.decoding.driver import Sampler, as_sampler
from jaxsr.decoding.inputs import Options, Request, prepare
from jaxsr.decoding.memory import call_rows, least_slots
from jaxsr.jobs.ahead import Programs
from jaxsr.jobs.config import DECODER_OPTIONS, PAIR_METHODS, JobConfig
from jaxsr.ladder import bucket
from jaxsr.loading.resolve import mesh_from_keys, resolve_model, resolve_reward
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards import Reward
from jaxsr.search.best_of_n import search as search_best_of_n
from jaxsr.search.candidates import check_reward
from jaxsr.search.speculative_rejection import speculative_rejection
from jaxsr.search.tree import tree_best_of_n

Write = Callable[[int, dict[str, Any]], None]
"""Takes a prompt's record as soon as the prompt is done: (its index in the job, the record)."""
Solve = Callable[[Request, Write], None]
"""Solves a prepared request (its `prompt_ids` are the prompts' indices in the job, and so their random
streams), handing each record to `write`."""


@dataclasses.dataclass(frozen=True)
class Solver:
    """A job's method with its models loaded: `solve(request, write)`, how many prompts a call takes
    (None: all of a length bucket's), and `check(prompts) -> Request`, which prepares every prompt
    of the data once (encoded as the generator reads it, the calls take their parts of it) and refuses,
    before any decoding, a prompt the method could not take — so that a bad one far down fails the
    job at its start. `programs(token counts)`: the programs a call of prompts of those lengths runs,
    to compile ahead of it (`jobs.ahead`); None where the method compiles as it goes (the searches)."""

    solve: Solve
    prompts_per_call: int | None
    check: Callable[[list[Any]], Request]
    programs: Callable[[list[int]], Programs] | None = None
    length_class: Callable[[int], int] = bucket
    """A prompt's length class by its token count: a call takes prompts of one class (decoding: the
    slab they stream through, `continuous.slab_length`; the searches: their prefill's bucket)."""


SEARCH_CALL_ROUNDS = 16
"""A speculative_rejection call takes this many prompts per prompt in flight: enough that a finished
search's place is refilled nearly always (a call's last searches run with fewer beside them). Records
are written as searches end, so a kill loses only the searches in flight; a call's results are held
until it returns, so calls stay bounded. (Decoding calls and Best-of-N hold none: a call takes a whole
length bucket, its prompts streaming through one batch of slots.)"""

# the builder of each two-model decoder: the pair methods' sampler, and the `decoder` searches run over
DECODER_BUILDERS: dict[str, Callable[..., Any]] = {
    "speculative": speculative_decoder,
    "contrastive": contrastive_decoder,
    "speculative_contrastive": speculative_contrastive_decoder,
}


def load_decoder(config: JobConfig, key: str, mesh: Mesh | None) -> Model:
    """The job's `model` or `draft` (`key`), its weights stored as `weights_dtype` (quantized as they are
    read) and its KV cache as `kv_dtype`."""
    model = resolve_model(
        getattr(config, key), config.dtype, mesh, key=key, weights_dtype=config.weights_dtype
    )
    return model.with_kv_dtype(config.kv_dtype)


def build_solver(config: JobConfig) -> Solver:
    """The job's method over its loaded models."""
    mesh = mesh_from_keys(config)
    model = load_decoder(config, "model", mesh)
    sampling = config.sampling()
    common = dict(
        max_new_tokens=config.max_new_tokens, sampling=sampling, seed=config.seed, chat=config.chat,
        stop_token_ids=tuple(config.stop_token_ids or ()), stop=tuple(config.stop or ()),
    )  # fmt: skip
    reward: Reward | None = None
    if config.method == "generate" or config.method in PAIR_METHODS:
        sampler = job_sampler(config, model, mesh, config.method)
        run: Callable[..., None] = lambda request, on_result: decode_request(
            sampler, request, num_samples=config.num_samples, max_rows=config.max_rows, on_result=on_result
        )
    else:
        reward = resolve_reward(config.reward, config.dtype, mesh)
        sampler = job_sampler(config, model, mesh, config.decoder)
        run = search_call(config, sampler, reward, common)

    def solve(request: Request, write: Write) -> None:
        run(request, lambda i, result: write(request.prompt_ids[i], result.to_dict()))

    def check(prompts: list[Any]) -> Request:
        try:
            request = prepare(sampler.models, prompts, Options(**common))
            if reward is not None:
                check_reward(reward, sampler.target, prompts)
        except (ValueError, TypeError) as e:
            if "prompts[" not in str(e):  # a config value (max_new_tokens=0): its own name says it
                raise
            raise ValueError(f"data: {config.data}: {e}") from None  # the i-th prompt of the data
        return request

    if config.method in ("speculative_rejection", "tree_best_of_n"):
        return Solver(solve, prompts_per_call(config), check)
    programs = batch_programs(config, sampler, Options(**common))
    length_class = functools.partial(slab_length, least=least_slots(sampler, call_budget(config)))
    return Solver(solve, prompts_per_call(config), check, programs, length_class)


def job_sampler(config: JobConfig, model: Model, mesh: Mesh | None, kind: str | None) -> Sampler:
    """The job's sampler over its `model`: plain sampling (`kind` None or "generate"), or a pair
    method's / a search's two-model decoder over the job's `draft`, sampling as the job says."""
    kind = PAIR_METHODS.get(kind, kind)
    if kind in (None, "generate"):
        return as_sampler(model, config.sampling())
    extra = {name: getattr(config, name) for name in DECODER_OPTIONS[kind]}
    decoder = DECODER_BUILDERS[kind](model, load_decoder(config, "draft", mesh), **extra)
    return as_sampler(decoder, config.sampling())


def batch_programs(config: JobConfig, sampler: Sampler, options: Options) -> Callable[[list[int]], Programs]:
    """The programs of a decoding or Best-of-N call with these options: one set per length class, as
    `continuous.decode` runs them."""

    @functools.cache
    def calls() -> tuple[Sampler, Request]:
        """The calls' sampler and options (read when first asked, after `check` took the options; the
        placeholder prompt is not read)."""
        request = prepare(sampler.models, [[0]], options)
        return sampler.with_sampling(request.sampling), request

    def programs(lengths: list[int]) -> Programs:
        decoding, request = calls()
        samples, max_rows, least = job_call_rows(config, decoding, lengths)
        classes = length_classes(lengths, samples, max_rows, decoding.mesh, least)
        return {
            key: compile_
            for shape, _ in classes
            for key, compile_ in slab_programs(decoding, request, shape).items()
        }

    return programs


def job_call_rows(config: JobConfig, sampler: Sampler, lengths: list[int]) -> tuple[int, int, int]:
    """A decoding or Best-of-N call's samples per prompt, most rows decoded together and its slabs'
    fewest prompt slots, for prompts of these token `lengths` (`call_rows`, as `decode_request` and
    `best_of_n.search` size them)."""
    prompts = [[0] * length for length in lengths]
    samples = config.n if config.method == "best_of_n" else config.num_samples
    rows = call_rows(sampler, call_budget(config), prompts, samples, config.max_new_tokens, config.max_rows)
    return samples, *rows


def call_budget(config: JobConfig) -> int | str | None:
    """The memory budget a decoding or Best-of-N call is sized by: Best-of-N's own; plain and pair
    decoding take none (a GPU's or TPU's free memory; on CPU 64 rows a `data` shard)."""
    return config.memory_budget if config.method == "best_of_n" else None


def search_call(
    config: JobConfig, sampler: Sampler, reward: Reward, common: dict[str, Any]
) -> Callable[[Request, Callable[[int, Result], None]], None]:
    """The search method's call over `sampler` (plain sampling or a two-model decoder): a prepared
    request in, each prompt's result to `on_result` as its search ends."""
    if config.method == "best_of_n":
        return lambda request, on_result: search_best_of_n(
            sampler, reward, request, n=config.n, memory_budget=config.memory_budget,
            on_result=on_result, max_rows=config.max_rows,
        )  # fmt: skip
    if config.method == "tree_best_of_n":
        search: Callable[..., list] = lambda prompts, **kw: tree_best_of_n(
            sampler, reward, prompts, n=config.n, branch=config.branch, layers=config.layers,
            concurrent_prompts=config.concurrent_prompts, **kw,
        )  # fmt: skip
    else:
        search = lambda prompts, **kw: speculative_rejection(
            sampler,
            reward,
            prompts,
            n=config.n,
            rejection_rate=config.rejection_rate,
            memory_budget=config.memory_budget,
            concurrent_prompts=config.concurrent_prompts,
            min_first_segment=config.min_first_segment,
            decision_interval=config.decision_interval,
            rule=config.rule,
            min_keep=config.min_keep,
            keep_rejected=config.keep_rejected,
            **kw,
        )

    def call(request: Request, on_result: Callable[[int, Result], None]) -> None:
        search(list(request.prompts), prompt_offset=list(request.prompt_ids), on_result=on_result, **common)

    return call


def prompts_per_call(config: JobConfig) -> int | None:
    """Speculative Rejection and TreeBoN: `SEARCH_CALL_ROUNDS` prompts per prompt in flight. Decoding
    and Best-of-N: None, a whole length bucket (nothing is held: records stream out as prompts end)."""
    if config.method in ("speculative_rejection", "tree_best_of_n"):  # `concurrent_prompts` in flight
        return SEARCH_CALL_ROUNDS * config.concurrent_prompts
    return None
