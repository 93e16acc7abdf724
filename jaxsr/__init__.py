"""jaxsr: inference-time alignment decoding in JAX (Best-of-N, Speculative Rejection, speculative and
contrastive decoding), and fine-tuning on their results (`jaxsr.training`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what checkers and the API docs read; at run time `__getattr__` imports each name
    from jaxsr import data, rewards, sharding, training
    from jaxsr.decoding.api import (
        contrastive_decode,
        contrastive_decoder,
        generate,
        speculative_contrastive_decode,
        speculative_contrastive_decoder,
        speculative_decode,
        speculative_decoder,
    )
    from jaxsr.decoding.driver import Sampler
    from jaxsr.decoding.sampling import SamplingConfig
    from jaxsr.loading.api import load_model, load_reward_model, save_model
    from jaxsr.loading.encoder import load_encoder
    from jaxsr.models.encoder import EncoderModel
    from jaxsr.models.model import Model, RewardModel
    from jaxsr.results import Result, Sample
    from jaxsr.search.best_of_n import best_of_n
    from jaxsr.search.speculative_rejection import speculative_rejection
    from jaxsr.search.tree import tree_best_of_n

    PairDecoder = Sampler
    """The name earlier releases gave a two-model `Sampler`."""

_HOMES = {
    "jaxsr.decoding.api": (
        "contrastive_decode",
        "contrastive_decoder",
        "generate",
        "speculative_contrastive_decode",
        "speculative_contrastive_decoder",
        "speculative_decode",
        "speculative_decoder",
    ),
    "jaxsr.decoding.driver": ("Sampler",),
    "jaxsr.decoding.sampling": ("SamplingConfig",),
    "jaxsr.loading.api": ("load_model", "load_reward_model", "save_model"),
    "jaxsr.loading.encoder": ("load_encoder",),
    "jaxsr.models.encoder": ("EncoderModel",),
    "jaxsr.models.model": ("Model", "RewardModel"),
    "jaxsr.results": ("Result", "Sample"),
    "jaxsr.search.best_of_n": ("best_of_n",),
    "jaxsr.search.speculative_rejection": ("speculative_rejection",),
    "jaxsr.search.tree": ("tree_best_of_n",),
}
"""Each public name's module: imported on the name's first use, so that `import jaxsr` (and the
`jaxsr` command's `--help`) imports no jax."""
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
_SUBMODULES = ("data", "rewards", "sharding", "training")
_ALIASES = {"PairDecoder": "Sampler"}

__all__ = [
    "EncoderModel",
    "Model",
    "PairDecoder",
    "Result",
    "RewardModel",
    "Sample",
    "Sampler",
    "SamplingConfig",
    "best_of_n",
    "contrastive_decode",
    "contrastive_decoder",
    "data",
    "generate",
    "load_encoder",
    "load_model",
    "load_reward_model",
    "rewards",
    "save_model",
    "sharding",
    "speculative_contrastive_decode",
    "speculative_contrastive_decoder",
    "speculative_decode",
    "speculative_decoder",
    "speculative_rejection",
    "training",
    "tree_best_of_n",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxsr.{name}")
    own = _ALIASES.get(name, name)
    if own not in _HOME_OF:
        raise AttributeError(f"module 'jaxsr' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[own]), own)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
