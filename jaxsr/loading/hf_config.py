"""Hugging Face `config.json` (transformers 4 and 5 spellings) → `DecoderConfig`."""

from __future__ import annotations

from typing import Any

from jaxsr.models.config import DecoderConfig, RopeScaling

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*LLAMA_LIKE, "gpt2")

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"config.json: hidden_act {name!r} is not supported; expected one of {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def _num_labels(hf: dict[str, Any]) -> int:
    architectures = hf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return 0
    return int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 1)


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_theta`+`rope_scaling` (v4) or `rope_parameters` (v5)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def decoder_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"config.json: unknown architecture model_type={model_type!r} "
            f"(architectures={hf.get('architectures')}); jaxsr supports {', '.join(SUPPORTED)}"
        )
    if model_type == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ValueError("config.json: GPT-2 variants with per-layer attention scaling are not supported")
        if hf.get("scale_attn_weights", True) is False:
            raise ValueError("config.json: GPT-2 with scale_attn_weights=false is not supported")
        d = hf["n_embd"]
        return DecoderConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=d,
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            num_kv_heads=hf["n_head"],
            head_dim=d // hf["n_head"],
            intermediate_size=hf.get("n_inner") or 4 * d,
            max_position_embeddings=hf["n_positions"],
            norm="layer",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            position="learned",
            mlp="plain",
            activation=_activation(hf.get("activation_function", "gelu_new")),
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            num_labels=_num_labels(hf),
            model_type=model_type,
        )
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        activation=_activation(hf.get("hidden_act", "silu")),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        out_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_labels=_num_labels(hf),
        model_type=model_type,
    )
