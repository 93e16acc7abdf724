"""Architecture-neutral configuration for the decoder-only language models jaxsr runs."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """One decoder covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and GPT-2 through these switches."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-6
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: Literal["gated", "plain"] = "gated"
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_labels: int = 0
    """Outputs of a sequence-classification (reward) head; 0 means a language-model head."""
    model_type: str = "llama"
    sliding_window: int | None = None
    """The sliding attention window W, applied in layers `first_sliding_layer` onwards (Mistral v0.1;
    Qwen2/3 with use_sliding_window) as transformers applies it: a query sees the W most recent keys,
    itself included; keys W or more positions back are masked. None: full causal attention."""
    first_sliding_layer: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def context(self) -> int:
        """The longest sequence (prompt + generated) this model takes: its `max_position_embeddings`
        (a sliding window is applied, it does not shorten the context)."""
        return self.max_position_embeddings

    @property
    def is_reward_model(self) -> bool:
        return self.num_labels > 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token position occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
