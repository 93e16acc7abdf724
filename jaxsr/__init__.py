"""jaxsr: inference-time alignment decoding in JAX (Best-of-N, Speculative Rejection, speculative and
contrastive decoding), and fine-tuning on their results (`jaxsr.training`)."""

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
