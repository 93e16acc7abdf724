"""Models and rewards named in a config (a job's `model` / `draft` / `reward`, a fine-tuning run's
`model` / `teacher`) loaded onto the mesh its `mesh_data` / `mesh_model` keys ask for; loading errors
name the config key whose value failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxsr.loading.api import Header, load_model, load_reward_model, read_header
from jaxsr.models.model import Model
from jaxsr.rewards import Reward, SelfCertainty, SelfLikelihood, as_reward
from jaxsr.sharding import make_mesh


def mesh_from_keys(config: Any) -> Mesh | None:
    """The mesh a config's `mesh_data` / `mesh_model` ask for over this host's devices (each host of a
    multi-host job or run builds its own); None when they ask for one device."""
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


def _source(name: str) -> str | Path:
    """`smollm2` names the embedded SmolLM2-135M-Instruct and `smollm2-draft` its shipped draft/amateur;
    anything else is a path or hub id as given."""
    if name == "smollm2":
        from jaxsr.loading.gguf import smollm2_path

        return smollm2_path()
    if name == "smollm2-draft":
        from jaxsr.loading.embedded import smollm2_draft_path

        return smollm2_draft_path()
    return name


def resolve_model(
    name: str, dtype: str, mesh: Mesh | None = None, key: str = "model", weights_dtype: str | None = None
) -> Model:
    """The model a config names (`_source`) loaded by `load_model` (its weights as `weights_dtype`,
    quantized as they are read). Errors name the config `key`."""
    with _config_key(key):
        return load_model(_source(name), dtype=dtype, mesh=mesh, weights_dtype=weights_dtype)


def resolve_header(name: str, key: str = "model") -> Header:
    """The config and tokenizer of the model a config names, its weights unread (`read_header`): what
    checks of the data against the model need before the model loads. Errors name the config `key`."""
    with _config_key(key):
        return read_header(_source(name))


def resolve_reward(name: str | None, dtype: str, mesh: Mesh | None = None) -> Reward:
    """`self_likelihood`, `neg_perplexity`, `self_certainty` (read off the generator's sampling
    logits), `minilm` (the embedded all-MiniLM-L6-v2), or a reward-model checkpoint."""
    if name is None:
        raise ValueError(
            "reward: best_of_n and speculative_rejection need a reward (self_likelihood, minilm, or a path)"
        )
    if name in ("self_likelihood", "neg_perplexity"):
        return SelfLikelihood("mean_logprob" if name == "self_likelihood" else "neg_perplexity")
    if name == "self_certainty":
        return SelfCertainty()
    with _config_key("reward"):
        if name == "minilm":
            from jaxsr.loading.encoder import load_encoder, minilm_path

            return as_reward(load_encoder(minilm_path(), dtype=dtype, mesh=mesh))
        return as_reward(load_reward_model(name, dtype=dtype, mesh=mesh))
