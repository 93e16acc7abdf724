"""Tiny random decoders for fast unit tests (no checkpoint, no tokenizer)."""

from __future__ import annotations

from flax import nnx

from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model


def tiny_config(**overrides) -> DecoderConfig:
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def tiny_model(
    seed: int = 0, eos_token_ids: tuple[int, ...] = (), logit_scale: float = 15.0, **overrides
) -> Model:
    """A random decoder; `logit_scale` spreads its logits so that samples are not near-uniform."""
    module = Decoder(tiny_config(**overrides), rngs=nnx.Rngs(seed))
    module.lm_head[...] = module.lm_head[...] * logit_scale
    return Model.from_module(module, eos_token_ids=eos_token_ids, name=f"tiny-{seed}")
