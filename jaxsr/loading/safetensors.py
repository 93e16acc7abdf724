"""Read safetensors files (single or sharded) as memory-mapped numpy arrays.

The format is read directly (8-byte header size, JSON header, raw little-endian data) so that bfloat16
tensors map to `ml_dtypes.bfloat16` without torch or a copy, and so that a truncated or corrupt file is
reported with its name before any tensor is used.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxsr.loading.files import CheckpointError, inside, read_json

MAX_DIMS = 8  # no model tensor has more; numpy refuses past 64
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file, memory-mapped (nothing is read until used)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated or not a safetensors file (header too long)")
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict) or not all(
        isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and isinstance(info.get("shape"), list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in info["shape"])
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in info["data_offsets"])
        for name, info in header.items()
        if name != "__metadata__"
    ):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a table of dtype/shape/data_offsets)")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_len = max((info["data_offsets"][1] for info in header.values()), default=0)
    if data_start + data_len > size:
        raise CheckpointError(
            f"{path}: truncated: header promises {data_start + data_len} bytes, file has {size}"
        )
    _check_ranges(path, header, size - data_start)
    mapped = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) if data_len else None
    )
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if len(shape) > MAX_DIMS or any(n >= 2**48 for n in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has an impossible shape {list(shape)[:8]}")
        if end - start != dtype.itemsize * math.prod(shape):  # Python ints: no overflow
            raise CheckpointError(f"{path}: tensor {name!r} byte range does not match its shape")
        tensors[name] = (
            mapped[start:end].view(dtype).reshape(shape) if end > start else np.zeros(shape, dtype)
        )
    return tensors


def _check_ranges(path: Path, header: dict, data_len: int) -> None:
    """The tensors' byte ranges tile the data buffer, as the reference reader requires: in order, each
    starting where the one before ends, the last ending at the file's end (no overlap, no gap)."""
    end = 0
    for name, (start, stop) in sorted(
        ((n, i["data_offsets"]) for n, i in header.items()), key=lambda x: x[1]
    ):
        if start != end or stop < start:
            raise CheckpointError(
                f"{path}: tensor {name!r}'s byte range [{start}, {stop}) overlaps or leaves a gap"
            )
        end = stop
    if end != data_len:
        raise CheckpointError(
            f"{path}: {data_len - end} bytes after the last tensor's data (a corrupt header)"
        )


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """A directory's tensors by name, from `model.safetensors` or a sharded index."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no `weight_map` object")
            owner = {
                k: str(inside(directory, v, index).relative_to(directory)) for k, v in weight_map.items()
            }
            files = sorted(set(owner.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            weight_map, owner = {}, {}
            if len(files) > 1:  # which file's tensors would win is no choice to make silently
                raise CheckpointError(
                    f"{directory}: {len(files)} weights files ({', '.join(files)}) and no "
                    "model.safetensors.index.json naming which tensor is in which; keep one, or add the index"
                )
        if not files:
            pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt*")
            )
            hint = (
                f" Found pickle-based {pickled}; jaxsr never unpickles checkpoints. Convert once with "
                "`transformers`: AutoModel.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)."
                if pickled
                else ""
            )
            raise CheckpointError(f"{directory}: no *.safetensors weights found.{hint}")
        self._tensors: dict[str, np.ndarray] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json is missing")
            tensors = read_safetensors(path)
            if owner:  # each tensor from the shard the index names, whatever the others hold
                tensors = {k: v for k, v in tensors.items() if owner.get(k) == name}
            self._tensors.update(tensors)
        missing = set(weight_map) - set(self._tensors)
        if missing:
            raise CheckpointError(
                f"{directory}: tensor {sorted(missing)[0]!r} is listed in the index but not in its shard"
            )

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write `tensors` as one safetensors file, atomically (a temporary file renamed into place)."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header: dict[str, dict] = {}
    offset = 0
    arrays = {name: np.ascontiguousarray(t) for name, t in sorted(tensors.items())}
    for name, array in arrays.items():
        if array.dtype not in names:
            raise TypeError(f"tensors: {name!r} has dtype {array.dtype}, which safetensors cannot hold")
        header[name] = {
            "dtype": names[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for array in arrays.values():
            f.write(array.tobytes())
    partial.replace(path)
