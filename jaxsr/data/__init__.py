"""Prompt sets: the ones shipped inside the package, found by name, and any JSON, JSONL or Parquet file.

A set is a list of records (a JSON list, JSON lines, or a Parquet table's rows), or of plain strings. A
record's prompt is a string or a conversation (`{"role", "content"}` messages, system and multi-turn,
ending in the user turn to answer), under `messages` or else `prompt` — or under the column `Columns`
names; its other fields travel with it (a job carries them into the prompt's output record). By name, a
set is looked up first in the folders of `$JAXSR_DATA_DIR` (`os.pathsep`-separated; `NAME.json`,
`NAME.jsonl` or `NAME.parquet`), then among the sets bundled here (see `README.md` beside this file for
their sources and licences), so a user's folder can add sets or shadow a bundled one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jaxsr import text
from jaxsr.checks import check_positive_int, user_path
from jaxsr.loading.files import MissingFileError

DATA_DIR_ENV = "JAXSR_DATA_DIR"
BUNDLED_DIR = Path(__file__).resolve().parent
SUFFIXES = (".json", ".jsonl", ".parquet")


def bundled_sets() -> list[str]:
    """Names of the prompt sets shipped with jaxsr."""
    return sorted(p.stem for p in BUNDLED_DIR.iterdir() if p.suffix in SUFFIXES)


def find_dataset(name: str) -> Path:
    """A path as given, else a set by name from `$JAXSR_DATA_DIR`, else a bundled set."""
    if not isinstance(name, str | os.PathLike):
        raise TypeError(f"data: expected a file path or a prompt set's name, got {type(name).__name__}")
    path = user_path("data", name)
    if path.is_file():
        return path
    if path.exists():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(f"data: {str(name)!r} is {kind}, expected a JSON/JSONL/Parquet file or a set name")
    roots = [user_path(DATA_DIR_ENV, r) for r in os.environ.get(DATA_DIR_ENV, "").split(os.pathsep) if r]
    for root in [*roots, BUNDLED_DIR]:
        for suffix in SUFFIXES:
            candidate = root / f"{name}{suffix}"
            if candidate.is_file():
                return candidate.resolve()
    raise MissingFileError(
        f"data: {name!r} is neither a file nor a known prompt set (bundled: {', '.join(bundled_sets())}; "
        f"more sets can be added as NAME.json/.jsonl/.parquet in a folder named by ${DATA_DIR_ENV})"
    )


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where a set's records hold their prompt, and a system prompt for those that have none."""

    prompt_field: str | None = None
    """The column holding a string prompt or a conversation (None: `messages`, else `prompt`)."""
    messages_field: str | None = None
    """The column holding a conversation (it must be one)."""
    system_prompt: str | None = None
    """A system message put before every prompt that has none (a string prompt becomes a conversation)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt of a set, and the record's other fields (carried into its output record)."""

    prompt: str | text.Messages
    fields: dict[str, Any]


def read_records(source: str, limit: int | None = None, columns: Columns = Columns()) -> list[PromptRecord]:
    """The prompts of a set (a name or a path) with their records' other fields, the first `limit`
    of them when given. A record that holds no prompt is refused naming the file, the record and what
    was expected."""
    if limit is not None:
        limit = check_positive_int("limit", limit)
    path = find_dataset(source)
    records = _load(path)
    if not isinstance(records, list):
        raise ValueError(f"data: {path} holds a JSON {type(records).__name__}, expected a list of records")
    if not records:
        raise ValueError(f"data: {path} holds no prompts")
    prompts = [
        _prompt_record(record, columns, f"data: record {i} of {path}") for i, record in enumerate(records)
    ]
    return prompts[:limit] if limit is not None else prompts


def read_prompts(
    source: str, limit: int | None = None, columns: Columns = Columns()
) -> list[str | text.Messages]:
    """The prompts of a set (strings and conversations), the first `limit` of them when given."""
    return [record.prompt for record in read_records(source, limit, columns)]


def _load(path: Path) -> Any:
    """A set's records as Python values: a Parquet table's rows, a JSON document, or JSON lines."""
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data: {path} is not UTF-8 text (byte {e.start})") from None
    if path.suffix == ".json":
        return _parse(path, content, line=None)
    # JSON lines end at "\n" only: str.splitlines would also split inside strings at U+2028 etc.
    return [_parse(path, line, line=n) for n, line in enumerate(content.split("\n"), 1) if line.strip()]


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(f"data: reading {path} needs pyarrow (pip install pyarrow)") from None
    try:
        return parquet.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's ArrowInvalid and kin for a file that is not Parquet
        raise ValueError(f"data: {path} is not a readable Parquet file ({e})") from None


def _prompt_record(record: Any, columns: Columns, where: str) -> PromptRecord:
    """A record's prompt (checked, the system prompt put first) and its other fields."""
    if isinstance(record, str):
        prompt, fields, name = record, {}, "prompt"
    elif isinstance(record, dict):
        name = (
            columns.messages_field
            or columns.prompt_field
            or ("messages" if "messages" in record else "prompt")
        )
        if name not in record:
            raise ValueError(
                f"{where} has no `{name}` field: expected a string prompt or a conversation there "
                "(prompt_field / messages_field name another column)"
            )
        prompt, fields = record[name], {k: v for k, v in record.items() if k != name}
    else:
        raise ValueError(
            f"{where} is a {type(record).__name__}, expected a string or an object with a prompt"
        )
    try:
        prompt = _checked_prompt(prompt, f"`{name}`", conversation=name == columns.messages_field)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return PromptRecord(_with_system(prompt, columns.system_prompt), fields)


def _checked_prompt(prompt: Any, name: str, conversation: bool) -> str | text.Messages:
    if isinstance(prompt, str) and not conversation:
        if not prompt.strip():
            raise ValueError(f"{name} is an empty prompt")
        return prompt
    if not conversation and not text.is_conversation(prompt):
        raise ValueError(f"{name} is a {type(prompt).__name__}, expected a string or a list of messages")
    return text.check_conversation(name, prompt)


def _with_system(prompt: str | text.Messages, system: str | None) -> str | text.Messages:
    """The prompt with `system` as its first message, unless it has one already (or none is given)."""
    messages = text.as_messages(prompt)
    if system is None or messages[0]["role"] == "system":
        return prompt
    return [{"role": "system", "content": system}, *messages]


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
