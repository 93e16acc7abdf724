"""Reading a checkpoint's own files: errors that name the file (and the line or field), and paths that
stay inside the checkpoint directory."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model it claims to be."""


class MissingFileError(FileNotFoundError, ValueError):
    """A path argument names nothing: a FileNotFoundError, and (as every bad argument) a ValueError."""


METADATA_BYTES = 256 << 20
"""The most a metadata file (a config, an index, a job config) may hold: more is no such file."""
READ_BLOCK = 1 << 16
"""Bytes `read_small` reads at a time."""


def read_small(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a small regular file. It is opened without blocking (a FIFO would block a plain
    open until a writer came) and read only when it is a regular file: a FIFO, device, socket or
    directory (or a link to one) is refused, and a file past `limit` bytes (METADATA_BYTES by default)
    once that many are read, a block at a time (a link to /dev/zero cannot fill the memory, and a small
    file takes no more than its size); OSError as `open` raises it."""
    limit = METADATA_BYTES if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: not a regular file (a {_kind(mode)}), expected a file of text")
        blocks, size = [], 0
        while size <= limit and (block := os.read(fd, min(READ_BLOCK, limit + 1 - size))):
            blocks.append(block)
            size += len(block)
    finally:
        os.close(fd)
    if size > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes, too large for a metadata file")
    return b"".join(blocks)


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")]
    return next((name for test, name in kinds if test(mode)), "device or special file")


def is_panic(error: BaseException) -> bool:
    """Whether `error` is a Rust panic surfacing through pyo3 (`PanicException`, a BaseException, not an
    Exception): what the tokenizers library raises when a tokenizer file trips its regex engine."""
    return type(error).__name__ == "PanicException"


def read_json(path: Path, expected: type = dict) -> Any:
    """The JSON value of `path` (a small regular file: `read_small`), which must be an `expected` (a
    JSON object by default)."""
    try:
        value = json.loads(read_small(path).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply to be a checkpoint file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(value, expected):
        kinds = {dict: "an object", list: "a list"}
        raise CheckpointError(
            f"{path}: holds a JSON {type(value).__name__}, expected {kinds.get(expected, expected.__name__)}"
        )
    return value


def inside(directory: Path, name: object, listed_in: Path) -> Path:
    """`directory / name` for a file name read from `listed_in`, refused if it leads out of `directory`."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{listed_in}: expected a file name, got {name!r}")
    # Lexical, not resolved: a hub snapshot's files are symlinks into the cache's blob folder.
    parts = Path(os.path.normpath(name)).parts
    if Path(name).is_absolute() or parts[:1] == ("..",):
        raise CheckpointError(f"{listed_in}: {name!r} points outside {directory}")
    return directory / name


_REQUIRED = object()


def _default(key: str, default: Any) -> Any:
    """What an absent (or null) field reads as: `default`, unless the field is required."""
    if default is _REQUIRED:
        raise ValueError(f"field {key!r} is missing")
    return default


MAX_COUNT = 2**30
"""Sizes (vocabularies, widths, context lengths) are int32 on device: a config past this is broken."""


def positive_int(config: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """`config[key]`, which must be a positive integer below 2**30 (`default` where the key is absent
    or null)."""
    value = config.get(key)
    if value is None:
        return _default(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_COUNT:
        raise ValueError(f"field {key!r}: expected a positive integer below 2**30, got {value!r}")
    return value


def small_epsilon(config: Mapping[str, Any], key: str, default: float) -> float:
    """A normalisation epsilon: positive and small (a large one flattens every activation)."""
    eps = positive_float(config, key, default)
    if eps >= 0.1:
        raise ValueError(f"field {key!r}: expected a small positive number, got {eps}")
    return eps


def flag(config: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """A true/false field."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"field {key!r}: expected true or false, got {value!r}")
    return value


def positive_float(config: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> float:
    """`config[key]`, which must be a finite positive number (`default` where absent or null)."""
    value = config.get(key)
    if value is None:
        return _default(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"field {key!r}: expected a finite positive number, got {value!r}")
    return float(value)


def with_file(path: Path, read: Callable[..., T], *args: Any) -> T:
    """`read(*args)`, its ValueError reworded to name `path` (the file or checkpoint its arguments
    came from) unless it already does."""
    try:
        return read(*args)
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise CheckpointError(f"{path}: {e}") from None
