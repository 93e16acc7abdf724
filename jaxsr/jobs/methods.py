"""Turn a `JobConfig` into loaded models and a `solve(prompts, first_index) -> records` function."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
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
from jaxsr.decoding.driver import DEFAULT_MAX_ROWS
from jaxsr.decoding.inputs import prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.jobs.config import DECODER_OPTIONS, PAIR_METHODS, JobConfig
from jaxsr.loading.api import load_model, load_reward_model
from jaxsr.models.model import Model
from jaxsr.rewards import Reward, SelfLikelihood, as_reward
from jaxsr.search.best_of_n import best_of_n
from jaxsr.search.candidates import check_reward
from jaxsr.search.speculative_rejection import speculative_rejection
from jaxsr.sharding import make_mesh

Solve = Callable[[list[str], int], list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Solver:
    """A job's method with its models loaded: `solve(prompts, first_index) -> records`, how many prompts
    a call takes, and `check(prompts)`, which refuses (before any decoding) a prompt the method could
    not take — every prompt of the data, so that a bad one far down fails the job at its start."""

    solve: Solve
    prompts_per_call: int
    check: Callable[[list[str]], None]


SEARCH_CALL_ROUNDS = 4
"""A speculative_rejection call takes this many prompts per prompt in flight: enough that a finished
search's place is refilled most of the time, few enough that a killed job redoes little."""

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


def job_mesh(config: Any) -> Mesh | None:
    """The mesh a config's `mesh_data` / `mesh_model` ask for over this host's devices (each host of a
    multi-host job runs its own)."""
    if config.mesh_data is None and config.mesh_model == 1:
        return None
    data = 1 if config.mesh_data is None else config.mesh_data
    try:
        return make_mesh(data=data, model=config.mesh_model, devices=jax.local_devices())
    except ValueError as e:
        raise ValueError(f"mesh_data / mesh_model: {e}") from None


@contextlib.contextmanager
def _config_key(key: str) -> Iterator[None]:
    """Loading errors name the config key whose value failed to load (`reward: source: ...`)."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"{key}: {e}") from e


def resolve_model(name: str, dtype: str, mesh: Mesh | None = None, key: str = "model") -> Model:
    """`smollm2` names the embedded SmolLM2-135M-Instruct and `smollm2-draft` its shipped draft/amateur;
    anything else goes to `load_model`. Errors name the config `key`."""
    with _config_key(key):
        if name == "smollm2":
            from jaxsr.loading.gguf import smollm2_path

            return load_model(smollm2_path(), dtype=dtype, mesh=mesh)
        if name == "smollm2-draft":
            from jaxsr.loading.embedded import smollm2_draft_path

            return load_model(smollm2_draft_path(), dtype=dtype, mesh=mesh)
        return load_model(name, dtype=dtype, mesh=mesh)


def resolve_reward(name: str | None, dtype: str, mesh: Mesh | None = None) -> Reward:
    """`self_likelihood`, `minilm` (the embedded all-MiniLM-L6-v2), or a reward-model checkpoint."""
    if name is None:
        raise ValueError(
            "reward: best_of_n and speculative_rejection need a reward (self_likelihood, minilm, or a path)"
        )
    if name in ("self_likelihood", "neg_perplexity"):
        return SelfLikelihood("mean_logprob" if name == "self_likelihood" else "neg_perplexity")
    with _config_key("reward"):
        if name == "minilm":
            from jaxsr.loading.encoder import load_encoder, minilm_path

            return as_reward(load_encoder(minilm_path(), dtype=dtype, mesh=mesh))
        return as_reward(load_reward_model(name, dtype=dtype, mesh=mesh))


def build_solver(config: JobConfig) -> Solver:
    """The job's method over its loaded models."""
    mesh = job_mesh(config)
    model = resolve_model(config.model, config.dtype, mesh)
    models: tuple[Model, ...] = (model,)
    reward: Reward | None = None
    sampling = SamplingConfig(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    common = dict(max_new_tokens=config.max_new_tokens, sampling=sampling, seed=config.seed, chat=config.chat)
    if config.method == "generate":
        run: Callable[..., list] = lambda prompts, **kw: generate(
            model, prompts, num_samples=config.num_samples, **kw
        )
    elif config.method in PAIR_METHODS:
        if config.draft is None:
            raise ValueError(f"draft: {config.method} needs a second model (the draft or amateur)")
        second = resolve_model(config.draft, config.dtype, mesh, key="draft")
        models = (model, second)
        kind = PAIR_METHODS[config.method]
        decode, extra = PAIR_DECODE[kind], {name: getattr(config, name) for name in DECODER_OPTIONS[kind]}
        run = lambda prompts, **kw: decode(
            model, second, prompts, num_samples=config.num_samples, **extra, **kw
        )
    else:
        reward = resolve_reward(config.reward, config.dtype, mesh)
        if config.decoder is not None:
            if config.draft is None:
                raise ValueError(f"draft: decoder={config.decoder} needs a second model (draft/amateur)")
            extra = {name: getattr(config, name) for name in DECODER_OPTIONS[config.decoder]}
            model = DECODER_BUILDERS[config.decoder](
                model, resolve_model(config.draft, config.dtype, mesh, key="draft"), **extra
            )
            models = model.models
        if config.method == "best_of_n":
            if config.n is None:
                raise ValueError("n: best_of_n needs n")
            run = lambda prompts, **kw: best_of_n(
                model, reward, prompts, n=config.n, memory_budget=config.memory_budget, **kw
            )
        else:
            run = lambda prompts, **kw: speculative_rejection(
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
                **kw,
            )

    def solve(prompts: list[str], first: int) -> list[dict[str, Any]]:
        return [r.to_dict() for r in run(prompts, prompt_offset=first, **common)]

    def check(prompts: list[str]) -> None:
        try:
            prepare(models, prompts, stop_token_ids=(), prompt_offset=0, **common)
            if reward is not None:
                check_reward(reward, models[0], prompts)
        except (ValueError, TypeError) as e:
            if "prompts[" not in str(e):  # a config value (max_new_tokens=0): its own name says it
                raise
            raise ValueError(f"data: {config.data}: {e}") from None  # the i-th prompt of the data

    if config.method == "speculative_rejection":  # a call keeps `concurrent_prompts` searches in flight
        per_call = SEARCH_CALL_ROUNDS * config.concurrent_prompts
    else:  # a call decodes as many prompts' rows as one batch of DEFAULT_MAX_ROWS holds
        key = "n" if config.method == "best_of_n" else "num_samples"
        per_call = max(1, DEFAULT_MAX_ROWS // check_positive_int(key, getattr(config, key)))
    return Solver(solve, per_call, check)
