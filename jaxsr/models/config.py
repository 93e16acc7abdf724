"""Architecture-neutral configuration for the decoder-only language models jaxsr runs."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Literal

import numpy as np

KV_DTYPES = ("int8",)
"""Cache dtypes other than the parameters' (`DecoderConfig.kv_dtype`)."""
KV_SCALE_BYTES = 4
"""An int8 cache's float32 scale of one token's key (or value) in one KV head."""
WEIGHTS_DTYPES = ("int8",)
"""Weight storage other than the parameters' dtype (`DecoderConfig.weights_dtype`)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type: linear`): every inverse frequency divided by `factor`
    (Gemma 3's global layers)."""

    factor: float


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """One decoder covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3 and GPT-2 through these
    switches."""

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
    rope_scaling: RopeScaling | LinearRopeScaling | None = None
    local_rope_theta: float | None = None
    """RoPE base of the windowed layers, which then use no scaling while `rope_theta` and
    `rope_scaling` apply to the others (Gemma 3's rope_local_base_freq). None: one RoPE for all."""
    mlp: Literal["gated", "plain"] = "gated"
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_unit_offset: bool = False
    """RMSNorms multiply by (1 + w), computed in float32, with w stored as the checkpoint stores it
    (Gemma)."""
    sandwich_norm: bool = False
    """The attention and MLP outputs are normed again before the residual add (Gemma 2/3)."""
    scale_embeddings: bool = False
    """Token embeddings are multiplied by sqrt(hidden_size), rounded to their dtype (Gemma)."""
    query_pre_attn_scalar: int | None = None
    """Attention scores are scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5 (Gemma)."""
    attn_logit_softcapping: float | None = None
    """Attention scores s become c·tanh(s / c) before masking (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Logits z become c·tanh(z / c) (Gemma 2)."""
    tie_word_embeddings: bool = False
    num_labels: int = 0
    """Outputs of a sequence-classification (reward) head; 0 means a language-model head."""
    model_type: str = "llama"
    sliding_window: int | None = None
    """The sliding attention window W, applied in the layers `sliding_layers` (Mistral v0.1; Qwen2/3
    with use_sliding_window; Gemma 2/3's local layers) as transformers applies it: a query sees the W
    most recent keys, itself included; keys W or more positions back are masked. None: full causal
    attention."""
    sliding_layers: tuple[int, ...] | None = None
    """Indices of the windowed layers, ascending; None (the default) means every layer when there is
    a window. Stored as a tuple, empty without a window."""
    head_token_ids: tuple[int, ...] | None = None
    """Vocabulary ids the output layer scores, ascending and distinct, each < vocab_size; None: every
    id. Other ids get logit -inf (probability 0): a small draft model skips most of a large
    vocabulary's output layer, and speculative sampling stays exact for any draft distribution."""
    kv_dtype: Literal["int8"] | None = None
    """How the KV cache stores keys and values: None in the parameters' dtype; `int8` as int8 with a
    float32 scale per token and KV head (symmetric absmax), about half the bytes of bfloat16 and a
    quarter of float32. Prefill and decoding attend to the stored (quantized) keys and values, so
    logits do not depend on how a sequence is split between them. Not part of the checkpoint."""
    weights_dtype: Literal["int8"] | None = None
    """How the matrices of the attention and MLP projections, the token embedding and the output layer
    are stored: None in the parameters' dtype; `int8` as int8 with a scale per output channel (symmetric
    absmax; in the parameters' dtype) applied to each product's result (`jaxsr.models.layers.contract`),
    about half the bytes of bfloat16. Norms, biases, learned positions and a reward head stay in the
    parameters' dtype. Not part of the checkpoint: quantized when the model loads."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is None:
            layers: tuple[int, ...] = ()
        elif self.sliding_layers is None:
            layers = tuple(range(self.num_layers))
        else:
            layers = tuple(self.sliding_layers)
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"sliding_layers: expected ascending layer indices below {self.num_layers}, got {layers}"
            )
        object.__setattr__(self, "sliding_layers", layers)  # frozen: normalised once, here
        check_kv_dtype(self.kv_dtype)
        if self.kv_dtype is not None and self.num_labels:
            raise ValueError("kv_dtype: a reward model keeps no cache between calls; leave it None")
        check_weights_dtype(self.weights_dtype)
        if self.head_token_ids is not None:
            object.__setattr__(self, "head_token_ids", self._checked_head_ids())

    def _checked_head_ids(self) -> tuple[int, ...]:
        """`head_token_ids` as a tuple of Python ints, or a ValueError naming it."""
        ids = self.head_token_ids
        try:
            ids = tuple(ids)
        except TypeError:
            raise ValueError(f"head_token_ids: expected a sequence of token ids, got {ids!r}") from None
        if not ids or not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
            raise ValueError(
                f"head_token_ids: expected a non-empty sequence of ints, got {_abbreviated(ids)}"
            )
        ids = tuple(int(i) for i in ids)
        if any(a >= b for a, b in itertools.pairwise(ids)) or not 0 <= ids[0] <= ids[-1] < self.vocab_size:
            raise ValueError(
                f"head_token_ids: expected ascending, distinct ids in [0, {self.vocab_size}), got "
                f"{_abbreviated(ids)}"
            )
        if self.tie_word_embeddings:
            raise ValueError("head_token_ids: a reduced output layer cannot be tied to the embeddings")
        if self.num_labels:
            raise ValueError("head_token_ids: a reward model has no language-model head to reduce")
        return ids

    @property
    def head_size(self) -> int:
        """Columns of the output layer: len(head_token_ids), or vocab_size for a full head."""
        return self.vocab_size if self.head_token_ids is None else len(self.head_token_ids)

    @property
    def context(self) -> int:
        """The longest sequence (prompt + generated) this model takes: its `max_position_embeddings`
        (a sliding window is applied, it does not shorten the context)."""
        return self.max_position_embeddings

    def is_windowed(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return layer in self.sliding_layers

    @property
    def is_reward_model(self) -> bool:
        return self.num_labels > 0

    @property
    def quantized_kv(self) -> bool:
        """Whether the KV cache holds int8 keys and values with their scales."""
        return self.kv_dtype == "int8"

    @property
    def quantized_weights(self) -> bool:
        """Whether the projection, embedding and output matrices are int8 with per-channel scales."""
        return self.weights_dtype == "int8"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token position occupies across all layers: `dtype_bytes` an element
        (the parameters' dtype), or in an int8 cache one byte an element and a float32 scale a KV head."""
        if self.quantized_kv:
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + KV_SCALE_BYTES)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def check_kv_dtype(kv_dtype: object) -> str | None:
    """`kv_dtype` when it is one jaxsr's caches store (None: the parameters' dtype), else a ValueError
    naming it."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ValueError(
            f"kv_dtype: expected None (the model's dtype) or one of {KV_DTYPES}, got {kv_dtype!r}"
        )
    return kv_dtype


def check_weights_dtype(weights_dtype: object) -> str | None:
    """`weights_dtype` when it is one jaxsr stores weights as (None: the parameters' dtype), else a
    ValueError naming it."""
    if weights_dtype is not None and (
        not isinstance(weights_dtype, str) or weights_dtype not in WEIGHTS_DTYPES
    ):
        raise ValueError(
            f"weights_dtype: expected None (the model's dtype) or one of {WEIGHTS_DTYPES}, got "
            f"{weights_dtype!r}"
        )
    return weights_dtype


def _abbreviated(ids: tuple[int, ...]) -> str:
    """The ids for an error message, shortened past a dozen (a head may hold thousands)."""
    return str(list(ids)) if len(ids) <= 12 else f"[{', '.join(map(str, ids[:12]))}, ...] ({len(ids)} ids)"
