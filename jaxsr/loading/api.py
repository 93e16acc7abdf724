"""`load_model` / `load_reward_model`: a local HF directory, a hub id, or a GGUF file → jaxsr model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from jaxsr.loading.hf_config import decoder_config_from_hf
from jaxsr.loading.params import place_params
from jaxsr.loading.safetensors import CheckpointError, SafetensorsCheckpoint
from jaxsr.loading.weights import convert_hf_tensors
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model, RewardModel

DTYPES = ("float32", "bfloat16")


def _check_dtype(dtype: str) -> str:
    if str(dtype) not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    return str(dtype)


def resolve_source(source: str | Path, revision: str | None = None) -> Path:
    """A local directory or .gguf file as is; anything else is treated as a hub id and downloaded."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if str(source).endswith(".gguf") or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"source: {source} does not exist")
    from jaxsr.loading.hub import download

    return download(str(source), revision=revision)


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's transformers tokenizer (with its chat template), or None if it ships none."""
    if not any((directory / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)


def _eos_ids(hf_config: dict[str, Any], directory: Path | None, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [hf_config]
    if directory is not None and (directory / "generation_config.json").exists():
        sources.insert(0, json.loads((directory / "generation_config.json").read_text()))
    for cfg in sources:
        eos = cfg.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load(source: str | Path, dtype: str, mesh: Mesh | None, revision: str | None) -> Model:
    dtype = _check_dtype(dtype)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    path = resolve_source(source, revision)
    if path.is_file() and path.suffix == ".gguf":
        from jaxsr.loading.gguf import read_gguf

        hf_config, tensors, tokenizer = read_gguf(path)
        directory = None
    elif path.is_dir():
        config_file = path / "config.json"
        if not config_file.exists():
            raise CheckpointError(f"{path}: no config.json")
        hf_config = json.loads(config_file.read_text())
        tensors = SafetensorsCheckpoint(path)
        tokenizer = load_tokenizer(path)
        directory = path
    else:
        raise ValueError(f"source: {source} is neither a checkpoint directory nor a .gguf file")
    config = decoder_config_from_hf(hf_config)
    arrays = convert_hf_tensors(config, tensors)
    graph, params = place_params(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0)), arrays, dtype, mesh)
    cls = RewardModel if config.is_reward_model else Model
    return cls(
        config=config,
        graph=graph,
        params=params,
        tokenizer=tokenizer,
        mesh=mesh,
        name=str(source),
        eos_token_ids=_eos_ids(hf_config, directory, tokenizer),
    )


def load_model(
    source: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None, revision: str | None = None
) -> Model:
    """Load a causal LM (or, for a *ForSequenceClassification checkpoint, a `RewardModel`)."""
    return _load(source, dtype, mesh, revision)


def load_reward_model(
    source: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None, revision: str | None = None
) -> RewardModel:
    """Load a *ForSequenceClassification checkpoint as a reward model."""
    model = _load(source, dtype, mesh, revision)
    if not isinstance(model, RewardModel):
        raise ValueError(
            f"source: {source} is a {model.config.model_type} language model, not a "
            "*ForSequenceClassification reward model"
        )
    return model
