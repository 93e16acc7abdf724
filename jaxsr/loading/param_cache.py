"""On-disk cache of converted parameters (orbax), so a GGUF or a large checkpoint loads fast the second time.

An entry holds the arrays `convert_hf_tensors` returned (in their own dtype, before the cast to the load
dtype, so one entry serves every dtype), the Hugging Face config, and for GGUF sources the tokenizer
(building it from a GGUF takes seconds). Int8 weights (`load_model(..., weights_dtype="int8")`) are stored
quantized, in an entry of their own beside the float one (its name's digest covers the weights dtype,
its meta.json names it): each restores straight onto the devices in its own layout, and a float entry is
never served for int8 weights nor an int8 one for float weights.

Entries are keyed on the source files' absolute paths, sizes and mtimes, the contents of its JSON files
(a config edited within the same second and size, or copied with its mtime, still misses) plus
`FORMAT_VERSION`, so a changed source misses its old entry (which is then replaced). An entry's meta.json
carries a digest of the config and layout it stores: an edited one is damaged, never served.

An entry is written into a temporary directory and renamed into place, so a killed process never leaves
a half-written entry under a real name; an entry that cannot be read is deleted and rebuilt. Restoring
with a mesh reads each parameter straight onto its shards.

Location: `$JAXSR_CACHE_DIR`, default `~/.cache/jaxsr/params`; `JAXSR_CACHE_DIR=off` disables it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxsr.checks import user_path
from jaxsr.loading.params import path_name
from jaxsr.sharding import param_sharding

FORMAT_VERSION = 2
"""Bump when the converted parameter layout changes, so old entries are never read."""
ENV_VAR = "JAXSR_CACHE_DIR"
DISABLED = ("off", "0", "false", "no", "none")
MIN_DIRECTORY_BYTES = 256 * 2**20
"""Safetensors directories smaller than this are not cached: converting them is already quick."""

ParamPath = tuple[str | int, ...]


class CacheError(Exception):
    """A cache entry exists but could not be read (it has been deleted)."""


def cache_root() -> Path | None:
    """The cache directory, or None when `JAXSR_CACHE_DIR` switches caching off."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in DISABLED:
        return None
    return user_path(ENV_VAR, value) if value else Path.home() / ".cache" / "jaxsr" / "params"


def _source_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    names = ("config.json", "model.safetensors.index.json")
    return sorted(p for p in source.iterdir() if p.name in names or p.suffix == ".safetensors")


def _fingerprint(source: Path) -> list[list[Any]]:
    """[path, size, mtime, content digest (JSON files only: small, and read by every load anyway)]."""
    stats = [(p.resolve(), p.stat()) for p in _source_files(source)]
    return [
        [str(path), st.st_size, st.st_mtime_ns, _file_digest(path) if path.suffix == ".json" else None]
        for path, st in stats
    ]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _meta_digest(hf_config: Any, arrays: Any, weights_dtype: str | None) -> str:
    """What a meta.json's `digest` field must be for the config, array layout and weights dtype it holds
    (float entries' digests as they were before int8 weights)."""
    return _digest([hf_config, arrays] + ([] if weights_dtype is None else [weights_dtype]), 64)


def _digest(value: Any, n: int) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:n]


def _entry_prefix(source: Path, weights_dtype: str | None) -> str:
    """Name shared by every entry of one source path and weights dtype (all but the newest are stale)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", source.name)[:80]
    key = str(source.resolve()) if weights_dtype is None else [str(source.resolve()), weights_dtype]
    return f"{name}-{_digest(key, 8)}-"


def entry_path(source: Path, weights_dtype: str | None = None) -> Path | None:
    """Where the entry for `source` with `weights_dtype` weights lives, or None when caching is off or
    `source` is not worth it."""
    root = cache_root()
    if root is None:
        return None
    fingerprint = _fingerprint(source)
    if source.is_dir() and sum(size for _, size, *_ in fingerprint) < MIN_DIRECTORY_BYTES:
        return None
    return root / (_entry_prefix(source, weights_dtype) + _digest([FORMAT_VERSION, fingerprint], 16))


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """A complete entry: `params/` (orbax), `meta.json`, and `tokenizer/` for GGUF sources."""

    path: Path
    hf_config: dict[str, Any]
    arrays: dict[str, tuple[list[int], str]]
    """'a/b/c' parameter path → (shape, dtype name), as stored."""

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def tokenizer(self) -> Any:
        """The stored transformers tokenizer, or None if the source had none."""
        directory = self.path / "tokenizer"
        if not directory.is_dir():
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError) as e:
            self.discard()
            raise CacheError(f"{self.path}: unreadable tokenizer ({e})") from e

    def restore(
        self, make_module: Callable[[], nnx.Module], dtype: Any, mesh: Mesh | None
    ) -> tuple[nnx.GraphDef, nnx.State]:
        """The module's parameter state, each array read straight onto its target device(s) and dtype."""
        graph, abstract = nnx.split(nnx.eval_shape(make_module))
        flat = nnx.to_flat_state(abstract)
        expected = {path_name(path): (list(v.shape), _is_float(v.dtype)) for path, v in flat}
        stored = {name: (shape, _is_float(dtype)) for name, (shape, dtype) in self.arrays.items()}
        if stored != expected:
            self.discard()
            raise CacheError(f"{self.path}: stored parameters do not match the module")
        args: dict[str, Any] = {}
        for path, variable in flat:
            sharding = (
                param_sharding([str(p) for p in path], variable.shape, mesh)
                if mesh is not None
                else SingleDeviceSharding(jax.devices()[0])
            )
            floating = _is_float(self.arrays[path_name(path)][1])
            arg = ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype if floating else None)
            _nest(args, path, arg)
        try:
            restored = ocp.PyTreeCheckpointer().restore(self.path / "params", restore_args=args)
            leaves = [(path, variable.replace(_get(restored, path))) for path, variable in flat]
        except Exception as e:  # any unreadable entry is rebuilt, whatever orbax raised
            self.discard()
            raise CacheError(
                f"{self.path}: unreadable parameters ({type(e).__name__}: {str(e)[:200]})"
            ) from e
        return graph, nnx.from_flat_state(leaves)


def _is_float(dtype: Any) -> bool:
    """Whether arrays of `dtype` are floats (cast to the load dtype) rather than int8 weights."""
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def _nest(tree: dict[str, Any], path: ParamPath, value: Any) -> None:
    """Store `value` under `path` in nested dicts keyed by strings (layer indices included)."""
    for key in path[:-1]:
        tree = tree.setdefault(str(key), {})
    tree[str(path[-1])] = value


def _get(tree: Mapping[str, Any], path: ParamPath) -> Any:
    for key in path:
        tree = tree[str(key)]
    return tree


def lookup(source: Path, weights_dtype: str | None = None) -> CacheEntry | None:
    """The complete, current entry for `source` with `weights_dtype` weights, or None (a damaged entry is
    deleted)."""
    path = entry_path(source, weights_dtype)
    if path is None or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta["format"] != FORMAT_VERSION or meta["fingerprint"] != _fingerprint(source):
            raise ValueError("stale entry")
        if meta["digest"] != _meta_digest(meta["hf_config"], meta["arrays"], meta.get("weights_dtype")):
            raise ValueError("its config or layout was edited")
        if meta.get("weights_dtype") != weights_dtype:
            raise ValueError(f"it holds {meta.get('weights_dtype') or 'float'} weights")
        arrays = {name: ([int(n) for n in a["shape"]], str(a["dtype"])) for name, a in meta["arrays"].items()}
        return CacheEntry(path, dict(meta["hf_config"]), arrays)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        message = f"jaxsr: rebuilding the parameter cache: {path}: damaged entry ({reason})"
        warnings.warn(message, stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
        return None


_UNUSABLE: set[Path] = set()


def _warn_unusable(root: Path, error: OSError) -> None:
    """Warn once per cache location that cannot be written; loading goes on without the cache."""
    if root not in _UNUSABLE:
        _UNUSABLE.add(root)
        reason = error.strerror or type(error).__name__
        warnings.warn(
            f"jaxsr: the parameter cache {root} cannot be written ({reason}); loading without it "
            f"(set {ENV_VAR} to a writable folder, or to 'off')",
            stacklevel=3,
        )


def _tmp_prefix() -> str:
    return f".tmp-{re.sub(r'[^A-Za-z0-9]', '_', socket.gethostname())}-"


def _remove_abandoned(root: Path) -> None:
    """Delete temporary directories of this host's processes that died while writing."""
    for tmp in root.glob(_tmp_prefix() + "*"):
        pid = tmp.name[len(_tmp_prefix()) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def store(
    source: Path,
    hf_config: dict[str, Any],
    arrays: Mapping[ParamPath, np.ndarray],
    tokenizer: Any = None,
    weights_dtype: str | None = None,
) -> Path | None:
    """Save converted `arrays` (+ config, + tokenizer) as the entry for `source` with `weights_dtype`
    weights (the arrays' own layout: int8 matrices and their scales); returns its path.

    Writes into a temporary directory and renames it into place; replaces stale entries of the same
    source and weights dtype. Returns None when caching is off for `source` or the write failed (with a
    warning).
    """
    final = entry_path(source, weights_dtype)
    if final is None:
        return None
    root = final.parent
    tmp = root / f"{_tmp_prefix()}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(root)
        tmp.mkdir()
    except OSError as e:
        _warn_unusable(root, e)
        return None
    try:
        tree: dict[str, Any] = {}
        for path, value in arrays.items():
            _nest(tree, path, np.asarray(value))
        # Uncompressed: twice as fast to write and to read back, which is the point of this cache.
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)).save(tmp / "params", tree)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        layout = {
            path_name(path): {"shape": list(np.shape(a)), "dtype": np.asarray(a).dtype.name}
            for path, a in arrays.items()
        }
        meta = {
            "format": FORMAT_VERSION,
            "source": str(source.resolve()),
            "fingerprint": _fingerprint(source),
            "hf_config": hf_config,
            "arrays": layout,
        }
        if weights_dtype is not None:
            meta["weights_dtype"] = weights_dtype
        meta = json.loads(json.dumps(meta))  # the digest is of what lookup will read back
        meta["digest"] = _meta_digest(meta["hf_config"], meta["arrays"], weights_dtype)
        (tmp / "meta.json").write_text(json.dumps(meta))
        for stale in root.glob(_entry_prefix(source, weights_dtype) + "*"):
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(final)
    except Exception as e:  # the cache is an optimisation: failing to write it must not fail the load
        if not final.is_dir():  # (a concurrent writer that won the rename is no failure at all)
            warnings.warn(f"jaxsr: could not write the parameter cache {final}: {e}", stacklevel=2)
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
