"""Hugging Face `config.json` (transformers 4 and 5 spellings) → `DecoderConfig`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsr.loading.files import flag, positive_float, positive_int, small_epsilon
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


def _activation(name: Any) -> str:
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _num_labels(hf: dict[str, Any]) -> int:
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"field 'architectures': expected a list of class names, got {architectures!r}")
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return 0
    labels = hf.get("id2label")
    return positive_int(hf, "num_labels", len(labels) if isinstance(labels, dict) and labels else 1)


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_theta`+`rope_scaling` (v4) or `rope_parameters` (v5)."""
    params, scaling = (hf.get(key) or {} for key in ("rope_parameters", "rope_scaling"))
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"field {key!r}: expected an object, got {value!r}")
    scaling = scaling or params
    theta = positive_float(params, "rope_theta", positive_float(hf, "rope_theta", 10000.0))
    if theta <= 1.0:
        raise ValueError(f"field 'rope_theta': expected a base > 1, got {theta}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not supported (supported: default, llama3)")
    return theta, RopeScaling(
        factor=positive_float(scaling, "factor"),
        low_freq_factor=positive_float(scaling, "low_freq_factor"),
        high_freq_factor=positive_float(scaling, "high_freq_factor"),
        original_max_position_embeddings=positive_int(scaling, "original_max_position_embeddings"),
    )


def _sliding_window(hf: dict[str, Any], model_type: str) -> tuple[int | None, int]:
    """(window, first windowed layer) as Hugging Face applies them, or (None, 0) for full attention."""
    window, layers = hf.get("sliding_window"), positive_int(hf, "num_hidden_layers")
    if not window or model_type not in ("mistral", "qwen2", "qwen3"):
        return None, 0
    if model_type == "mistral":
        return positive_int(hf, "sliding_window"), 0
    if hf.get("layer_types") is not None:
        if not isinstance(hf["layer_types"], list) or len(hf["layer_types"]) != layers:
            raise ValueError(f"field 'layer_types': expected a list of {layers} attention kinds")
        sliding = [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
        return (positive_int(hf, "sliding_window"), sliding[0]) if sliding else (None, 0)
    first = hf.get("max_window_layers", layers)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"field 'max_window_layers': expected an integer >= 0, got {first!r}")
    windowed = flag(hf, "use_sliding_window") and first < layers
    return (positive_int(hf, "sliding_window"), first) if windowed else (None, 0)


def decoder_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"unknown architecture model_type={model_type!r} "
            f"(architectures={hf.get('architectures')}); jaxsr supports {', '.join(SUPPORTED)}"
        )
    if model_type == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ValueError("GPT-2 variants with per-layer attention scaling are not supported")
        if hf.get("scale_attn_weights", True) is False:
            raise ValueError("GPT-2 with scale_attn_weights=false is not supported")
        d, heads = positive_int(hf, "n_embd"), positive_int(hf, "n_head")
        return DecoderConfig(
            vocab_size=positive_int(hf, "vocab_size"),
            hidden_size=d,
            num_layers=positive_int(hf, "n_layer"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=d // heads,
            intermediate_size=positive_int(hf, "n_inner", 4 * d),
            max_position_embeddings=positive_int(hf, "n_positions"),
            norm="layer",
            norm_eps=small_epsilon(hf, "layer_norm_epsilon", 1e-5),
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
    heads, hidden = positive_int(hf, "num_attention_heads"), positive_int(hf, "hidden_size")
    theta, scaling = _rope(hf)
    window, first_sliding_layer = _sliding_window(hf, model_type)
    return DecoderConfig(
        vocab_size=positive_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=positive_int(hf, "num_key_value_heads", heads),
        head_dim=positive_int(hf, "head_dim", hidden // heads),
        intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", 2048),
        norm="rms",
        norm_eps=small_epsilon(hf, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        activation=_activation(hf.get("hidden_act", "silu")),
        qkv_bias=model_type == "qwen2" or flag(hf, "attention_bias"),
        out_bias=model_type != "qwen2" and flag(hf, "attention_bias"),
        mlp_bias=flag(hf, "mlp_bias"),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=flag(hf, "tie_word_embeddings"),
        num_labels=_num_labels(hf),
        model_type=model_type,
        sliding_window=window,
        first_sliding_layer=first_sliding_layer,
    )


_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt2": "GPT2"}


def hf_config_from_decoder(cfg: DecoderConfig) -> dict[str, Any]:
    """`DecoderConfig` → a Hugging Face `config.json` dict; `decoder_config_from_hf` reads it back."""
    head = "ForSequenceClassification" if cfg.is_reward_model else "ForCausalLM"
    if cfg.model_type == "gpt2" and not cfg.is_reward_model:
        head = "LMHeadModel"
    hf: dict[str, Any] = {
        "model_type": cfg.model_type,
        "architectures": [_CLASS_PREFIX[cfg.model_type] + head],
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.is_reward_model:
        hf["num_labels"] = cfg.num_labels
    if cfg.model_type == "gpt2":
        activation = {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation)
        return hf | {
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.intermediate_size,
            "n_positions": cfg.max_position_embeddings,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": activation,
        }
    hf |= {
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.activation, cfg.activation),
        "mlp_bias": cfg.mlp_bias,
        "rope_theta": cfg.rope_theta,
    }
    if cfg.model_type not in ("qwen2", "qwen3"):
        if cfg.qkv_bias != cfg.out_bias:
            raise ValueError("cfg: a Llama/Mistral config.json has one attention_bias for q/k/v and o")
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.model_type == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    elif cfg.model_type in ("qwen2", "qwen3"):
        windowed = cfg.sliding_window is not None
        hf |= {"use_sliding_window": windowed, "sliding_window": cfg.sliding_window}
        hf["max_window_layers"] = cfg.first_sliding_layer if windowed else cfg.num_layers
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return hf
