"""`load_model` / `load_reward_model`: a local HF directory, a hub id, or a GGUF file → jaxsr model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsr.checks import check_bool, check_int, user_path
from jaxsr.loading import param_cache
from jaxsr.loading.files import CheckpointError, MissingFileError, is_panic, read_json, with_file
from jaxsr.loading.hf_config import decoder_config_from_hf, hf_config_from_decoder
from jaxsr.loading.params import place_params
from jaxsr.loading.safetensors import SafetensorsCheckpoint, write_safetensors
from jaxsr.loading.weights import convert_hf_tensors, export_hf_tensors
from jaxsr.models.config import DecoderConfig, check_kv_dtype, check_weights_dtype
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model, RewardModel
from jaxsr.sharding import check_mesh

DTYPES = ("float32", "bfloat16")


def check_dtype(dtype: str) -> str:
    if str(dtype) not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    return str(dtype)


def resolve_source(source: str | Path, revision: str | None = None) -> Path:
    """A local directory or .gguf file as is; anything else is treated as a hub id and downloaded."""
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"source: expected a path or a hub id, got {type(source).__name__}")
    if not str(source).strip():
        raise ValueError(f"source: expected a path or a hub id, got {str(source)!r}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision: expected a branch, tag or commit (a str) or None, got {revision!r}")
    path = user_path("source", source)
    if path.exists():
        return path
    if str(source).endswith(".gguf") or str(source).startswith((".", "/", "~")):
        raise MissingFileError(f"source: {source} does not exist")
    from jaxsr.loading.hub import download

    return download(str(source), revision=revision)


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's transformers tokenizer (with its chat template), or None if it ships none."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    present = [directory / n for n in names if (directory / n).exists()]
    if not present:
        return None
    for path in present:  # a FIFO would block the reader, a link to a device never end
        if not path.is_file():
            raise CheckpointError(f"{path}: not a regular file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except BaseException as e:  # transformers and tokenizers raise many types for a bad file
        if not isinstance(e, Exception) and not is_panic(e):
            raise  # Ctrl-C, SystemExit
        raise CheckpointError(f"{directory}: the tokenizer files cannot be read: {e}") from None


def _config_eos(cfg: dict[str, Any], file: Path, vocab: int) -> list[int]:
    """The `eos_token_id` entry of one config (an id or a list of ids inside the vocabulary)."""
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in eos):
        raise CheckpointError(
            f"{file}: eos_token_id must be a token id in [0, {vocab}) or a list of them, got {eos}"
        )
    return eos


def _eos_ids(
    hf_config: dict[str, Any], path: Path, is_gguf: bool, tokenizer: Any, vocab: int
) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json, config.json and the tokenizer, in that order."""
    ids: list[int] = []
    sources = [(path if is_gguf else path / "config.json", hf_config)]
    if not is_gguf and (path / "generation_config.json").exists():
        sources.insert(0, (path / "generation_config.json", read_json(path / "generation_config.json")))
    for file, cfg in sources:
        ids += _config_eos(cfg, file, vocab)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _read_checkpoint(
    path: Path, is_gguf: bool
) -> tuple[dict[str, Any], DecoderConfig, Mapping[str, Any], Any]:
    """(HF config dict, its DecoderConfig, HF-named tensors, tokenizer) of a GGUF file or a checkpoint
    directory; a config error names the file it came from."""
    if is_gguf:
        from jaxsr.loading.gguf import read_gguf

        hf_config, tensors, tokenizer = read_gguf(path)
        return hf_config, with_file(path, decoder_config_from_hf, hf_config), tensors, tokenizer
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    hf_config = read_json(config_file)
    config = with_file(config_file, decoder_config_from_hf, hf_config)
    return hf_config, config, SafetensorsCheckpoint(path), load_tokenizer(path)


def decoder_factory(config: DecoderConfig, dtype: str) -> Callable[[], Decoder]:
    """What builds the decoder module of `config` (a real load fills its abstract state, a plan keeps it
    abstract: `jaxsr.plans`)."""
    return lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0))


def model_class(config: DecoderConfig) -> type[Model]:
    """`RewardModel` for a *ForSequenceClassification config, else `Model`."""
    return RewardModel if config.is_reward_model else Model


def _restore_cached(
    path: Path, is_gguf: bool, dtype: str, weights_dtype: str | None, mesh: Mesh | None
) -> tuple[dict[str, Any], DecoderConfig, nnx.GraphDef, nnx.State, Any] | None:
    """(HF config, its DecoderConfig, graph, params, tokenizer) from the parameter cache entry of
    `weights_dtype`, or None on a miss. A stored config that is not a valid decoder's is the cache's
    fault: the entry is rebuilt."""
    entry = param_cache.lookup(path, weights_dtype)
    if entry is None:
        return None
    try:
        try:
            config = dataclasses.replace(decoder_config_from_hf(entry.hf_config), weights_dtype=weights_dtype)
            _config_eos(entry.hf_config, entry.path / "meta.json", config.vocab_size)
        except ValueError as e:
            entry.discard()
            raise param_cache.CacheError(f"{entry.path}: the stored config is not a decoder's ({e})") from e
        graph, params = entry.restore(decoder_factory(config, dtype), dtype, mesh)
        tokenizer = entry.tokenizer() if is_gguf else load_tokenizer(path)
    except param_cache.CacheError as e:
        warnings.warn(f"jaxsr: rebuilding the parameter cache: {e}", stacklevel=4)
        return None
    return entry.hf_config, config, graph, params, tokenizer


def _load(
    source: str | Path,
    dtype: str,
    weights_dtype: str | None,
    mesh: Mesh | None,
    revision: str | None,
    cache: bool,
) -> Model:
    dtype, cache = check_dtype(dtype), check_bool("cache", cache)
    check_weights_dtype(weights_dtype)
    check_mesh(mesh)
    path = resolve_source(source, revision)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not is_gguf and not path.is_dir():
        raise ValueError(f"source: {source} is neither a checkpoint directory nor a .gguf file")
    cached = _restore_cached(path, is_gguf, dtype, weights_dtype, mesh) if cache else None
    if cached is not None:
        hf_config, config, graph, params, tokenizer = cached
    else:
        hf_config, config, tensors, tokenizer = _read_checkpoint(path, is_gguf)
        config = dataclasses.replace(config, weights_dtype=weights_dtype)
        arrays = with_file(path, convert_hf_tensors, config, tensors)
        if cache:
            param_cache.store(path, hf_config, arrays, tokenizer if is_gguf else None, weights_dtype)
        graph, params = place_params(decoder_factory(config, dtype), arrays, dtype, mesh)
    return model_class(config)(
        config=config,
        graph=graph,
        params=params,
        tokenizer=tokenizer,
        mesh=mesh,
        name=str(source),
        eos_token_ids=_eos_ids(hf_config, path, is_gguf, tokenizer, config.vocab_size),
    )


def load_model(
    source: str | Path,
    *,
    dtype: str = "float32",
    kv_dtype: str | None = None,
    weights_dtype: str | None = None,
    mesh: Mesh | None = None,
    revision: str | None = None,
    cache: bool = True,
) -> Model:
    """Load a causal LM (or, for a *ForSequenceClassification checkpoint, a `RewardModel`).

    `kv_dtype`: None keeps the KV cache in `dtype`; `int8` stores keys and values as int8 with a
    float32 scale per token and KV head (`DecoderConfig.kv_dtype`), so a memory budget holds about 2×
    the rows of bfloat16 (4× float32). A reward model keeps a float cache.

    `weights_dtype`: None keeps every weight in `dtype`; `int8` quantizes the attention and MLP
    projections, the token embedding and the output layer to int8 with a scale per output channel
    (`DecoderConfig.weights_dtype`) as they are read, about half the parameter bytes of bfloat16
    (a quarter of float32). GGUF weights are dequantized and quantized again per channel.

    `cache`: reuse (and write) converted parameters under `$JAXSR_CACHE_DIR` for GGUF files and large
    checkpoints (see `jaxsr.loading.param_cache`; int8 weights have entries of their own); False
    bypasses the cache entirely.
    """
    check_kv_dtype(kv_dtype)  # before anything is read (as `_load` checks the others)
    return _load(source, dtype, weights_dtype, mesh, revision, cache).with_kv_dtype(kv_dtype)


@dataclasses.dataclass(frozen=True)
class Header:
    """What a checkpoint's config and tokenizer say, its weights unread: enough to check data against
    the model (vocabulary, context, chat template, EOS ids) before loading it."""

    config: DecoderConfig
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    name: str


def read_header(source: str | Path, revision: str | None = None) -> Header:
    """The `Header` of what `load_model(source)` would load (a hub id is downloaded as for loading)."""
    path = resolve_source(source, revision)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not is_gguf and not path.is_dir():
        raise ValueError(f"source: {source} is neither a checkpoint directory nor a .gguf file")
    hf_config, config, _, tokenizer = _read_checkpoint(path, is_gguf)
    eos = _eos_ids(hf_config, path, is_gguf, tokenizer, config.vocab_size)
    return Header(config, tokenizer, eos, str(source))


def load_reward_model(
    source: str | Path,
    *,
    dtype: str = "float32",
    weights_dtype: str | None = None,
    mesh: Mesh | None = None,
    revision: str | None = None,
    cache: bool = True,
) -> RewardModel:
    """Load a *ForSequenceClassification checkpoint as a reward model (`weights_dtype` and `cache` as in
    `load_model`; its score head stays in `dtype`)."""
    model = _load(source, dtype, weights_dtype, mesh, revision, cache)
    if not isinstance(model, RewardModel):
        raise ValueError(
            f"source: {source} is a {model.config.model_type} language model, not a "
            "*ForSequenceClassification reward model"
        )
    return model


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Files a transformers tokenizer is read from (a stale one beside a saved checkpoint would be loaded)."""


def _make_parents(directory: Path) -> list[Path]:
    """Create the missing ancestors of `directory` (outermost first), returning those it created."""
    missing = [p for p in reversed(directory.parents) if not p.exists()]
    created: list[Path] = []
    for parent in missing:
        try:
            parent.mkdir()
        except OSError as e:
            _remove_dirs(created)
            raise ValueError(f"directory: {directory} cannot be created ({parent}: {e.strerror})") from None
        created.append(parent)
    return created


def _remove_dirs(created: list[Path]) -> None:
    for parent in reversed(created):
        with contextlib.suppress(OSError):
            parent.rmdir()


def _check_targets(directory: Path, written: list[str]) -> None:
    """Refuse a target whose entries would not be replaced by the new files, or whose leftovers from an
    earlier checkpoint `load_model` would read in place of (or beside) what is saved now."""
    for name in written:
        target = directory / name
        if target.is_dir() and not target.is_symlink():
            raise ValueError(f"directory: {target} is a directory; save_model would replace it with a file")
    # Without a tokenizer of its own, the saved model would load with any tokenizer found beside it.
    no_tokenizer = not set(written) & set(TOKENIZER_FILES)
    stale = [
        p.name
        for p in directory.iterdir()
        if p.name not in written
        and (
            p.suffix == ".safetensors"
            or p.name in ("model.safetensors.index.json", "generation_config.json")
            or (no_tokenizer and p.name in TOKENIZER_FILES)
        )
    ]
    if stale:
        raise ValueError(
            f"directory: {directory} holds {sorted(stale)} of another checkpoint, which load_model would "
            "read with the saved one; remove them or save into another directory"
        )


def save_model(model: Model, directory: str | Path, *, pad_token_id: int | None = None) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json, model.safetensors in the
    parameters' dtype, generation_config.json, tokenizer files) that `load_model` and transformers read.

    `pad_token_id` (default: the tokenizer's) goes into config.json; transformers' reward models need it.

    A model with a reduced output layer (`DecoderConfig.head_token_ids`) is saved with its ids under
    config.json's `jaxsr_head_token_ids` and a [K, hidden] lm_head.weight: `load_model` reads it back,
    transformers cannot load it.

    A model with int8 weights (`weights_dtype`) is refused: save the float model it was quantized from,
    or `model.with_weights_dtype(None)`.

    The files are written into a temporary sibling directory first and then moved into place, so a
    failure leaves `directory` as it was. Other files already in `directory` are kept; files of an
    earlier checkpoint that this one would not replace (shards, an index, a tokenizer) are refused.
    """
    directory, pad_token_id = _checked_save(model, directory, pad_token_id)
    params = {
        path: np.asarray(jax.device_get(leaf.get_value())) for path, leaf in nnx.to_flat_state(model.params)
    }
    tensors = export_hf_tensors(model.config, params)
    eos = list(model.eos_token_ids)
    hf_config = _saved_config(model, pad_token_id)

    def write(staging: Path) -> None:
        write_safetensors(staging / "model.safetensors", tensors)
        if eos:
            (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(str(staging))
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))

    return _write_staged(directory, write)


def _checked_save(model: Model, directory: str | Path, pad_token_id: int | None) -> tuple[Path, int | None]:
    """`save_model`'s arguments checked: the directory as a path to write, the pad id as an int or None."""
    if not isinstance(model, Model):
        raise TypeError(f"model: expected a jaxsr.Model, got {type(model).__name__}")
    if model.config.quantized_weights:
        raise ValueError(
            "model: its weights are int8 (weights_dtype='int8') and save_model writes float checkpoints; "
            "save the float model it was quantized from, or model.with_weights_dtype(None) (the float "
            "values of its int8 weights)"
        )
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(f"directory: expected a path, got {type(directory).__name__}")
    if pad_token_id is not None:
        pad_token_id = check_int("pad_token_id", pad_token_id)
        if not 0 <= pad_token_id < model.config.vocab_size:
            raise ValueError(
                f"pad_token_id: expected an id in [0, {model.config.vocab_size}), got {pad_token_id}"
            )
    path = user_path("directory", directory)
    if path.name in ("", ".."):  # ".", "a/..": stage beside the directory it names, not inside it
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"directory: {path} exists and is not a directory")
    return path, pad_token_id


def _saved_config(model: Model, pad_token_id: int | None) -> dict[str, Any]:
    """The config.json of `model`: its architecture, EOS ids, and the pad id (default the tokenizer's)."""
    hf_config = hf_config_from_decoder(model.config)
    eos = list(model.eos_token_ids)
    if eos:
        hf_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if model.tokenizer is not None and pad_token_id is None:
        pad_token_id = model.tokenizer.pad_token_id
    if pad_token_id is not None:
        hf_config["pad_token_id"] = int(pad_token_id)
    return hf_config


def _write_staged(directory: Path, write: Callable[[Path], None]) -> Path:
    """Let `write` fill a temporary sibling of `directory`, then move its files into place: a failure
    leaves `directory` as it was (and removes the parents it created)."""
    created = _make_parents(directory)
    staging = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        staging.mkdir()
    except OSError as e:
        _remove_dirs(created)
        raise ValueError(f"directory: {directory} cannot be created ({e.strerror})") from None
    try:
        write(staging)
        written = sorted(p.name for p in staging.iterdir())
        if not directory.exists():
            staging.rename(directory)
            return directory
        _check_targets(directory, written)
        for name in written:
            os.replace(staging / name, directory / name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_dirs(created)
        raise
    return directory
