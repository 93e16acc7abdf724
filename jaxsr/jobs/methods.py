"""Turn a `JobConfig` into loaded models and a `solve(prompts, indices, write)` function."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxsr.checks import check_positive_int
from jaxsr.decoding.api import (
    contrastive_decode,
    contrastive_decoder,
    generate,
    speculative_contrastive_decode,
    speculative_contrastive_decoder,
    speculative_decode,
    speculative_decoder,
)
from jaxsr.decoding.driver import Sampler, as_sampler, batch_shapes, compile_batch, default_rows
from jaxsr.decoding.inputs import Options, Request, prepare
from jaxsr.jobs.ahead import Programs
from jaxsr.jobs.config import DECODER_OPTIONS, PAIR_METHODS, JobConfig
from jaxsr.loading.resolve import mesh_from_keys, resolve_model, resolve_reward
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards import Reward
from jaxsr.search.best_of_n import best_of_n
from jaxsr.search.candidates import check_reward
from jaxsr.search.speculative_rejection import speculative_rejection
from jaxsr.search.tree import tree_best_of_n

Write = Callable[[int, dict[str, Any]], None]
"""Takes a prompt's record as soon as the prompt is done: (its index in the job, the record)."""
Solve = Callable[[list[Any], list[int], Write], None]
"""Solves `prompts`, whose indices in the job (their random streams) are `indices`, handing each
record to `write`."""


@dataclasses.dataclass(frozen=True)
class Solver:
    """A job's method with its models loaded: `solve(prompts, indices, write)`, how many prompts
    a call takes, and `check(prompts) -> token counts`, which refuses (before any decoding) a prompt the
    method could not take — every prompt of the data, so that a bad one far down fails the job at its
    start — and gives each prompt's length as the generator reads it (to batch prompts by length).
    `programs(token counts)`: the programs a call of prompts of those lengths runs, to compile ahead of
    it (`jobs.ahead`); None where the method compiles as it goes (the searches)."""

    solve: Solve
    prompts_per_call: int
    check: Callable[[list[Any]], list[int]]
    programs: Callable[[list[int]], Programs] | None = None


SEARCH_CALL_ROUNDS = 16
"""A speculative_rejection call takes this many prompts per prompt in flight: enough that a finished
search's place is refilled nearly always (a call's last searches run with fewer beside them). Records
are written as searches end, so a kill loses only the searches in flight; a call's results are held
until it returns, so calls stay bounded."""

# the call of each two-model method, and the builder of each `decoder` the search methods run over
PAIR_DECODE: dict[str, Callable[..., list]] = {
    "speculative": speculative_decode,
    "contrastive": contrastive_decode,
    "speculative_contrastive": speculative_contrastive_decode,
}
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
    models: tuple[Model, ...] = (model,)
    reward: Reward | None = None
    sampling = config.sampling()
    common = dict(
        max_new_tokens=config.max_new_tokens, sampling=sampling, seed=config.seed, chat=config.chat,
        stop_token_ids=tuple(config.stop_token_ids or ()), stop=tuple(config.stop or ()),
    )  # fmt: skip
    if config.method == "generate":
        sampler = as_sampler(model, sampling)
        run: Callable[..., list] = lambda prompts, **kw: generate(
            model, prompts, num_samples=config.num_samples, max_rows=config.max_rows, **kw
        )
    elif config.method in PAIR_METHODS:
        second = load_decoder(config, "draft", mesh)
        models = (model, second)
        kind = PAIR_METHODS[config.method]
        decode, extra = PAIR_DECODE[kind], {name: getattr(config, name) for name in DECODER_OPTIONS[kind]}
        sampler = DECODER_BUILDERS[kind](model, second, **extra)
        run = lambda prompts, **kw: decode(
            model, second, prompts, num_samples=config.num_samples, max_rows=config.max_rows, **extra, **kw
        )
    else:
        reward = resolve_reward(config.reward, config.dtype, mesh)
        if config.decoder is not None:
            extra = {name: getattr(config, name) for name in DECODER_OPTIONS[config.decoder]}
            model = DECODER_BUILDERS[config.decoder](model, load_decoder(config, "draft", mesh), **extra)
            models = model.models
        sampler = as_sampler(model, sampling)
        run = search_call(config, model, reward)

    def solve(prompts: list[Any], indices: list[int], write: Write) -> None:
        def ended(i: int, result: Result) -> None:
            write(indices[i], result.to_dict())

        if reward is not None:  # a search method: each result is written as its search ends
            run(prompts, prompt_offset=indices, on_result=ended, **common)
            return
        for i, result in enumerate(run(prompts, prompt_offset=indices, **common)):  # a batch ends at once
            ended(i, result)

    def check(prompts: list[Any]) -> list[int]:
        try:
            request = prepare(models, prompts, Options(**common))
            if reward is not None:
                check_reward(reward, models[0], prompts)
        except (ValueError, TypeError) as e:
            if "prompts[" not in str(e):  # a config value (max_new_tokens=0): its own name says it
                raise
            raise ValueError(f"data: {config.data}: {e}") from None  # the i-th prompt of the data
        return [len(ids) for ids in request.encoded]

    programs = None if reward is not None else batch_programs(config, sampler, Options(**common))
    return Solver(solve, prompts_per_call(config, sampler), check, programs)


def batch_programs(config: JobConfig, sampler: Sampler, options: Options) -> Callable[[list[int]], Programs]:
    """The programs of a decoding call (`generate` or a pair method) with these options: one set per
    batch shape, compiled as `driver.decode` runs them."""

    @functools.cache
    def calls() -> tuple[Sampler, Request, int]:
        """The calls' sampler, options and rows, as `decode_prompts` takes them (read when first asked,
        after `check` took the options; the placeholder prompt is not read)."""
        request = prepare(sampler.models, [[0]], options)
        decoding = sampler.with_sampling(request.sampling)
        return decoding, request, config.max_rows if config.max_rows is not None else default_rows(decoding)

    def programs(lengths: list[int]) -> Programs:
        decoding, request, max_rows = calls()
        shapes = batch_shapes(lengths, config.num_samples, max_rows, decoding.mesh)
        return {shape: functools.partial(compile_batch, decoding, request, shape) for shape in shapes}

    return programs


def search_call(config: JobConfig, model: Any, reward: Reward) -> Callable[..., list]:
    """The search method's call over `model` (a language model or a two-model decoder)."""
    if config.method == "best_of_n":
        return lambda prompts, **kw: best_of_n(
            model, reward, prompts, n=config.n, memory_budget=config.memory_budget, **kw
        )
    if config.method == "tree_best_of_n":
        return lambda prompts, **kw: tree_best_of_n(
            model, reward, prompts, n=config.n, branch=config.branch, layers=config.layers,
            concurrent_prompts=config.concurrent_prompts, **kw,
        )  # fmt: skip
    return lambda prompts, **kw: speculative_rejection(
        model,
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


def prompts_per_call(config: JobConfig, sampler: Sampler) -> int:
    """Speculative Rejection and TreeBoN: `SEARCH_CALL_ROUNDS` prompts per prompt in flight. Else as
    many prompts as one batch of rows holds: `max_rows`, or 64 a `data` shard."""
    if config.method in ("speculative_rejection", "tree_best_of_n"):  # `concurrent_prompts` in flight
        return SEARCH_CALL_ROUNDS * config.concurrent_prompts
    key = "n" if config.method == "best_of_n" else "num_samples"
    rows = config.max_rows if config.max_rows is not None else default_rows(sampler)
    return max(1, rows // check_positive_int(key, getattr(config, key)))
