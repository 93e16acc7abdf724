"""Hugging Face `config.json` (transformers 4 and 5 spellings) → `DecoderConfig`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsr.loading.files import flag, positive_float, positive_int, small_epsilon
from jaxsr.models.config import DecoderConfig, LinearRopeScaling, RopeScaling

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GEMMA = ("gemma2", "gemma3_text")
MULTIMODAL_GEMMA = "gemma3"
"""Gemma3ForConditionalGeneration: its text decoder is read from `text_config` (the vision tower is
dropped) and saved back as a text-only gemma3_text checkpoint."""
SUPPORTED = (*LLAMA_LIKE, *GEMMA, MULTIMODAL_GEMMA, "gpt2")
SLIDING, FULL = "sliding_attention", "full_attention"

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


def _theta(config: dict[str, Any], key: str, default: float) -> float:
    theta = positive_float(config, key, default)
    if theta <= 1.0:
        raise ValueError(f"field {key!r}: expected a base > 1, got {theta}")
    return theta


def _rope_scaling(scaling: dict[str, Any]) -> RopeScaling | LinearRopeScaling | None:
    """The scaling a `rope_scaling` / `rope_parameters` object names (None for default RoPE)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return LinearRopeScaling(factor=positive_float(scaling, "factor"))
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
    return RopeScaling(
        factor=positive_float(scaling, "factor"),
        low_freq_factor=positive_float(scaling, "low_freq_factor"),
        high_freq_factor=positive_float(scaling, "high_freq_factor"),
        original_max_position_embeddings=positive_int(scaling, "original_max_position_embeddings"),
    )


def _objects(hf: dict[str, Any], *keys: str) -> list[dict[str, Any]]:
    """The JSON objects under `keys` ({} where absent or null)."""
    values = [hf.get(key) or {} for key in keys]
    for key, value in zip(keys, values, strict=True):
        if not isinstance(value, dict):
            raise ValueError(f"field {key!r}: expected an object, got {value!r}")
    return values


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | LinearRopeScaling | None]:
    """(theta, scaling) from `rope_theta`+`rope_scaling` (v4) or `rope_parameters` (v5)."""
    params, scaling = _objects(hf, "rope_parameters", "rope_scaling")
    theta = _theta(params, "rope_theta", _theta(hf, "rope_theta", 10000.0))
    return theta, _rope_scaling(scaling or params)


def _gemma3_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | LinearRopeScaling | None, float]:
    """(global theta, global scaling, local theta) of Gemma 3: v5's `rope_parameters` per layer kind,
    or v4's `rope_theta`, `rope_scaling` (global layers) and `rope_local_base_freq` (local layers)."""
    (params,) = _objects(hf, "rope_parameters")
    if FULL in params or SLIDING in params:
        full, local = _objects(params, FULL, SLIDING)
        if _rope_scaling(local) is not None:
            raise ValueError(f"field 'rope_parameters': scaled RoPE in {SLIDING} layers is not supported")
        return _theta(full, "rope_theta", 1e6), _rope_scaling(full), _theta(local, "rope_theta", 1e4)
    (scaling,) = _objects(hf, "rope_scaling")
    return _theta(hf, "rope_theta", 1e6), _rope_scaling(scaling), _theta(hf, "rope_local_base_freq", 1e4)


def _layer_types(hf: dict[str, Any], layers: int) -> list[str] | None:
    """`layer_types` checked: one of "sliding_attention"/"full_attention" per layer (None if absent)."""
    kinds = hf.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(f"field 'layer_types': expected a list of {layers} of {SLIDING!r}, {FULL!r}")
    return kinds


def _windowed_layers(kinds: list[str]) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(kinds) if kind == SLIDING)


def _sliding_window(hf: dict[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, windowed layers) as Hugging Face applies them, or (None, None) for full attention."""
    window, layers = hf.get("sliding_window"), positive_int(hf, "num_hidden_layers")
    if model_type in GEMMA:
        kinds = _layer_types(hf, layers)
        if kinds is None:  # transformers' default: every `pattern`-th layer global, the rest local
            pattern = 2 if model_type == "gemma2" else positive_int(hf, "sliding_window_pattern", 6)
            kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        sliding = _windowed_layers(kinds)
        return (positive_int(hf, "sliding_window", 4096), sliding) if sliding else (None, None)
    if not window or model_type not in ("mistral", "qwen2", "qwen3"):
        return None, None
    if model_type == "mistral":
        return positive_int(hf, "sliding_window"), None
    kinds = _layer_types(hf, layers)
    if kinds is not None:
        sliding = _windowed_layers(kinds)
        return (positive_int(hf, "sliding_window"), sliding) if sliding else (None, None)
    first = hf.get("max_window_layers", layers)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"field 'max_window_layers': expected an integer >= 0, got {first!r}")
    windowed = flag(hf, "use_sliding_window") and first < layers
    return (positive_int(hf, "sliding_window"), tuple(range(first, layers))) if windowed else (None, None)


def _optional_cap(hf: dict[str, Any], key: str, default: float | None) -> float | None:
    """A soft-capping value: null means no cap, an absent key transformers' default."""
    if key in hf and hf[key] is None:
        return None
    return positive_float(hf, key, default)


def _gemma_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config of a Gemma3ForConditionalGeneration `config.json`."""
    (text,) = _objects(hf, "text_config")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        kind = text.get("model_type")
        raise ValueError(f"field 'text_config': expected a gemma3_text config, got {kind!r}")
    return text | {"model_type": "gemma3_text", "architectures": hf.get("architectures")}


def _gemma_config(hf: dict[str, Any], model_type: str) -> DecoderConfig:
    """Gemma 2 / Gemma 3 (text): sandwich norms with (1 + w), GeGLU, scaled embeddings, local and
    global layers; soft-capping (Gemma 2) or q/k norms and a separate local RoPE base (Gemma 3)."""
    if flag(hf, "use_bidirectional_attention"):
        raise ValueError("field 'use_bidirectional_attention': bidirectional Gemma is not supported")
    gemma2 = model_type == "gemma2"
    if gemma2:
        (theta, scaling), local_theta = _rope(hf), None
    else:
        theta, scaling, local_theta = _gemma3_rope(hf)
    bias = flag(hf, "attention_bias")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return DecoderConfig(
        **_llama_layout(hf, model_type, 8192 if gemma2 else 131072),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        activation=_activation(activation),
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=not gemma2,
        norm_unit_offset=True,
        sandwich_norm=True,
        scale_embeddings=True,
        query_pre_attn_scalar=positive_int(hf, "query_pre_attn_scalar", 256),
        attn_logit_softcapping=_optional_cap(hf, "attn_logit_softcapping", 50.0 if gemma2 else None),
        final_logit_softcapping=_optional_cap(hf, "final_logit_softcapping", 30.0 if gemma2 else None),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", True),
    )


def _llama_layout(hf: dict[str, Any], model_type: str, context: int) -> dict[str, Any]:
    """The DecoderConfig fields every Llama-layout config.json spells alike (sizes, RMSNorm epsilon,
    sliding window, reward head); `context` is the family's default max_position_embeddings."""
    heads, hidden = positive_int(hf, "num_attention_heads"), positive_int(hf, "hidden_size")
    window, sliding_layers = _sliding_window(hf, model_type)
    return dict(
        vocab_size=positive_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=positive_int(hf, "num_key_value_heads", heads),
        head_dim=positive_int(hf, "head_dim", hidden // heads),
        intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", context),
        norm_eps=small_epsilon(hf, "rms_norm_eps", 1e-6),
        num_labels=_num_labels(hf),
        model_type=model_type,
        sliding_window=window,
        sliding_layers=sliding_layers,
    )


HEAD_TOKEN_IDS = "jaxsr_head_token_ids"
"""config.json key of `DecoderConfig.head_token_ids`, a jaxsr extension: such a checkpoint's
lm_head.weight is [K, hidden], which transformers cannot load."""


def decoder_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """The decoder a config.json describes, with jaxsr's reduced output layer where it names one
    (`HEAD_TOKEN_IDS`)."""
    config = _architecture_config(hf)
    ids = hf.get(HEAD_TOKEN_IDS)
    if ids is None:
        return config
    if not isinstance(ids, list):
        raise ValueError(f"field {HEAD_TOKEN_IDS!r}: expected a list of token ids, got {ids!r}")
    try:  # DecoderConfig checks the ids, and refuses them with tied embeddings or a reward head
        return dataclasses.replace(config, head_token_ids=ids)
    except ValueError as e:
        raise ValueError(f"field {HEAD_TOKEN_IDS!r}: {e}") from None


def _architecture_config(hf: dict[str, Any]) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"unknown architecture model_type={model_type!r} "
            f"(architectures={hf.get('architectures')}); jaxsr supports {', '.join(SUPPORTED)}"
        )
    if model_type == MULTIMODAL_GEMMA:
        return _architecture_config(_gemma_text_config(hf))
    if model_type in GEMMA:
        return _gemma_config(hf, model_type)
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
    theta, scaling = _rope(hf)
    return DecoderConfig(
        **_llama_layout(hf, model_type, 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        activation=_activation(hf.get("hidden_act", "silu")),
        qkv_bias=model_type == "qwen2" or flag(hf, "attention_bias"),
        out_bias=model_type != "qwen2" and flag(hf, "attention_bias"),
        mlp_bias=flag(hf, "mlp_bias"),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=flag(hf, "tie_word_embeddings"),
    )


_CLASS_PREFIX = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "gpt2": "GPT2",
}


def _rope_scaling_json(scaling: RopeScaling | LinearRopeScaling) -> dict[str, Any]:
    kind = "linear" if isinstance(scaling, LinearRopeScaling) else "llama3"
    return {"rope_type": kind, **dataclasses.asdict(scaling)}


def _layer_types_json(cfg: DecoderConfig) -> list[str]:
    return [SLIDING if cfg.is_windowed(i) else FULL for i in range(cfg.num_layers)]


def _gemma_json(cfg: DecoderConfig) -> dict[str, Any]:
    """The Gemma-specific fields of `hf_config_from_decoder` (transformers-4 RoPE spelling, which
    transformers 5 converts)."""
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError("cfg: a Gemma config.json has one attention_bias for q/k/v and o")
    hf = {
        "hidden_activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.activation, cfg.activation),
        "attention_bias": cfg.qkv_bias,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "sliding_window": cfg.sliding_window,
        "layer_types": _layer_types_json(cfg),
        "rope_theta": cfg.rope_theta,
    }
    if cfg.model_type == "gemma3_text":
        hf["rope_local_base_freq"] = cfg.local_rope_theta
    return hf


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
    if cfg.head_token_ids is not None:
        hf[HEAD_TOKEN_IDS] = list(cfg.head_token_ids)
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
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = _rope_scaling_json(cfg.rope_scaling)
    if cfg.model_type in GEMMA:
        return hf | _gemma_json(cfg)
    hf |= {
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
        windowed = bool(cfg.sliding_layers)
        hf |= {"use_sliding_window": windowed, "sliding_window": cfg.sliding_window}
        # max_window_layers for transformers 4 (windowed layers are a suffix there); layer_types wins in 5
        hf["max_window_layers"] = cfg.sliding_layers[0] if windowed else cfg.num_layers
        if windowed:
            hf["layer_types"] = _layer_types_json(cfg)
    return hf
