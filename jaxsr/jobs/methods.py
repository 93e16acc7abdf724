"""Turn a `JobConfig` into loaded models and a `solve(prompts, first_index) -> records` function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxsr.decoding.decoders import (
    contrastive_decode,
    contrastive_decoder,
    speculative_contrastive_decode,
    speculative_contrastive_decoder,
    speculative_decode,
    speculative_decoder,
)
from jaxsr.decoding.generate import generate
from jaxsr.decoding.prompts import check_positive_int
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.jobs.config import JobConfig
from jaxsr.loading.api import load_model, load_reward_model
from jaxsr.models.model import Model
from jaxsr.rewards import Reward, SelfLikelihood, as_reward
from jaxsr.search.best_of_n import best_of_n
from jaxsr.search.speculative_rejection import speculative_rejection

Solver = Callable[[list[str], int], list[dict[str, Any]]]

# decoding function of each two-model method and the config keys it takes
PAIR_METHODS: dict[str, tuple[Callable[..., list], tuple[str, ...]]] = {
    "speculative_decode": (speculative_decode, ("gamma",)),
    "contrastive_decode": (contrastive_decode, ("alpha", "beta")),
    "speculative_contrastive_decode": (speculative_contrastive_decode, ("gamma", "alpha", "beta")),
}
# decoder builder of each `decoder` choice for the search methods, and the config keys it takes
SEARCH_DECODERS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "speculative": (speculative_decoder, ("gamma",)),
    "contrastive": (contrastive_decoder, ("alpha", "beta")),
    "speculative_contrastive": (speculative_contrastive_decoder, ("gamma", "alpha", "beta")),
}


def resolve_model(name: str, dtype: str) -> Model:
    """`smollm2` names the embedded SmolLM2-135M-Instruct and `smollm2-draft` its shipped draft/amateur;
    anything else goes to `load_model`."""
    if name == "smollm2":
        from jaxsr.loading.gguf import smollm2_path

        return load_model(smollm2_path(), dtype=dtype)
    if name == "smollm2-draft":
        from jaxsr.loading.embedded import smollm2_draft_path

        return load_model(smollm2_draft_path(), dtype=dtype)
    return load_model(name, dtype=dtype)


def resolve_reward(name: str | None, dtype: str) -> Reward:
    """`self_likelihood`, `minilm` (the embedded all-MiniLM-L6-v2), or a reward-model checkpoint."""
    if name is None:
        raise ValueError(
            "reward: best_of_n and speculative_rejection need a reward (self_likelihood, minilm, or a path)"
        )
    if name in ("self_likelihood", "neg_perplexity"):
        return SelfLikelihood("mean_logprob" if name == "self_likelihood" else "neg_perplexity")
    if name == "minilm":
        from jaxsr.loading.encoder import load_encoder, minilm_path

        return as_reward(load_encoder(minilm_path(), dtype=dtype))
    return as_reward(load_reward_model(name, dtype=dtype))


def build_solver(config: JobConfig) -> tuple[Solver, int]:
    """(solve, prompts per call) for the job's method."""
    model = resolve_model(config.model, config.dtype)
    sampling = SamplingConfig(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    common = dict(max_new_tokens=config.max_new_tokens, sampling=sampling, seed=config.seed, chat=config.chat)
    if config.method == "generate":
        run: Callable[..., list] = lambda prompts, **kw: generate(
            model, prompts, num_samples=config.num_samples, **kw
        )
        per_call = max(1, 64 // check_positive_int("num_samples", config.num_samples))
    elif config.method in PAIR_METHODS:
        if config.draft is None:
            raise ValueError(f"draft: {config.method} needs a second model (the draft or amateur)")
        second = resolve_model(config.draft, config.dtype)
        decode, options = PAIR_METHODS[config.method]
        extra = {name: getattr(config, name) for name in options}
        run = lambda prompts, **kw: decode(
            model, second, prompts, num_samples=config.num_samples, **extra, **kw
        )
        per_call = max(1, 64 // check_positive_int("num_samples", config.num_samples))
    else:
        reward = resolve_reward(config.reward, config.dtype)
        if config.decoder is not None:
            if config.draft is None:
                raise ValueError(f"draft: decoder={config.decoder} needs a second model (draft/amateur)")
            build, options = SEARCH_DECODERS[config.decoder]
            extra = {name: getattr(config, name) for name in options}
            model = build(model, resolve_model(config.draft, config.dtype), **extra)
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
                **kw,
            )
        per_call = 1

    def solve(prompts: list[str], first: int) -> list[dict[str, Any]]:
        return [r.to_dict() for r in run(prompts, prompt_offset=first, **common)]

    return solve, per_call
