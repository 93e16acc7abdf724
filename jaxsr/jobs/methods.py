"""Turn a `JobConfig` into loaded models and a `solve(prompts, first_index)` function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxsr.decoding.generate import generate
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.jobs.config import JobConfig
from jaxsr.loading.api import load_model
from jaxsr.models.model import Model

EMBEDDED_MODELS = {"smollm2"}


def resolve_model(name: str, dtype: str) -> Model:
    if name == "smollm2":
        from jaxsr.loading.gguf import smollm2_path

        return load_model(smollm2_path(), dtype=dtype)
    return load_model(name, dtype=dtype)


def build_solver(config: JobConfig) -> tuple[Callable[[list[str], int], list[dict[str, Any]]], int]:
    """(solve, prompts per call) for the job's method."""
    model = resolve_model(config.model, config.dtype)
    sampling = SamplingConfig(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    if config.method == "generate":
        per_call = max(1, 64 // config.num_samples)

        def solve(prompts: list[str], first: int) -> list[dict[str, Any]]:
            results = generate(
                model,
                prompts,
                max_new_tokens=config.max_new_tokens,
                sampling=sampling,
                num_samples=config.num_samples,
                seed=config.seed,
                chat=config.chat,
                prompt_offset=first,
            )
            return [r.to_dict() for r in results]

        return solve, per_call
    raise ValueError(f"method: {config.method!r} is not available in this version")
