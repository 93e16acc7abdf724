"""Prompt sets: the ones shipped inside the package, found by name, and any JSON/JSONL file of prompts.

A set is a JSON list (or JSONL) of records with a string `prompt` (or of plain strings). By name, a set is
looked up first in the folders of `$JAXSR_DATA_DIR` (`os.pathsep`-separated; `NAME.json` or
`NAME.jsonl`), then among the sets bundled here (see `README.md` beside this file for their sources and
licences), so a user's folder can add sets or shadow a bundled one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxsr.checks import check_positive_int
from jaxsr.loading.files import MissingFileError

DATA_DIR_ENV = "JAXSR_DATA_DIR"
BUNDLED_DIR = Path(__file__).resolve().parent
SUFFIXES = (".json", ".jsonl")


def bundled_sets() -> list[str]:
    """Names of the prompt sets shipped with jaxsr."""
    return sorted(p.stem for p in BUNDLED_DIR.iterdir() if p.suffix in SUFFIXES)


def find_dataset(name: str) -> Path:
    """A path as given, else a set by name from `$JAXSR_DATA_DIR`, else a bundled set."""
    if not isinstance(name, str | os.PathLike):
        raise TypeError(f"data: expected a file path or a prompt set's name, got {type(name).__name__}")
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.exists():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(f"data: {str(name)!r} is {kind}, expected a JSON/JSONL file or a set name")
    roots = [Path(r).expanduser() for r in os.environ.get(DATA_DIR_ENV, "").split(os.pathsep) if r]
    for root in [*roots, BUNDLED_DIR]:
        for suffix in SUFFIXES:
            candidate = root / f"{name}{suffix}"
            if candidate.is_file():
                return candidate.resolve()
    raise MissingFileError(
        f"data: {name!r} is neither a file nor a known prompt set (bundled: {', '.join(bundled_sets())}; "
        f"more sets can be added as NAME.json/NAME.jsonl in a folder named by ${DATA_DIR_ENV})"
    )


def read_prompts(source: str, limit: int | None = None) -> list[str]:
    """The prompts of a set (a name or a path), the first `limit` of them when given."""
    if limit is not None:
        limit = check_positive_int("limit", limit)
    path = find_dataset(source)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data: {path} is not UTF-8 text (byte {e.start})") from None
    if path.suffix == ".json":
        records = _parse(path, text, line=None)
    else:
        # JSON lines end at "\n" only: str.splitlines would also split inside strings at U+2028 etc.
        lines = text.split("\n")
        records = [_parse(path, line, line=n) for n, line in enumerate(lines, 1) if line.strip()]
    if not isinstance(records, list):
        raise ValueError(f"data: {path} holds a JSON {type(records).__name__}, expected a list of records")
    if not records:
        raise ValueError(f"data: {path} holds no prompts")
    prompts = []
    for i, record in enumerate(records):
        prompt = record.get("prompt") if isinstance(record, dict) else record
        if not isinstance(prompt, str):
            raise ValueError(f"data: record {i} of {path} has no string `prompt`")
        if not prompt.strip():
            raise ValueError(f"data: record {i} of {path} has an empty prompt")
        prompts.append(prompt)
    return prompts[:limit] if limit is not None else prompts


def _parse(path: Path, text: str, line: int | None) -> object:
    """One JSON document (the whole file, or JSONL line `line`), its error naming the file and line."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"data: {path} is nested too deeply to be prompt records") from None
    except ValueError as e:
        if not isinstance(e, json.JSONDecodeError):  # e.g. an integer of thousands of digits
            raise ValueError(f"data: {path}: {e}") from None
        where = f"line {line if line is not None else e.lineno} column {e.colno}"
        raise ValueError(f"data: {path} is not valid JSON{'L' if line else ''} at {where}: {e.msg}") from None
