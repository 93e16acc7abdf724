"""A job's output record: the prompt's `Result` as stored, what produced it, and its input's fields.

`{"index", "prompt", "samples", "best", "stats", ["rejected"], "provenance", <the input record's other
fields>}`. The provenance (jaxsr's version, the job's fingerprint, and every key that decides what was
computed: method, models, reward, sampling, seed, ...) is in every record, so it survives outputs being
concatenated or published without their job file. An input field named like one of jaxsr's is kept as
`input_<name>`."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxsr.jobs.config import PLACEMENT_KEYS, JobConfig

OWN_FIELDS = ("index", "prompt", "samples", "best", "stats", "rejected", "provenance")
"""The fields jaxsr writes in a record."""
NOT_PROVENANCE = (*PLACEMENT_KEYS, "limit", "keep_token_ids", "keep_samples")
"""Job keys that change where or how much is written, not what a record's numbers are."""


def provenance(config: JobConfig) -> dict[str, Any]:
    """What produced a job's records: jaxsr's version, the job's fingerprint, the keys its method uses."""
    keys = sorted(config.used_keys() - set(NOT_PROVENANCE))
    return {"jaxsr": _version(), "job": config.fingerprint(), **{key: getattr(config, key) for key in keys}}


def _version() -> str:
    try:
        return importlib.metadata.version("jaxsr")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "unknown"


def output_record(
    result: dict[str, Any], fields: dict[str, Any], source: dict[str, Any], config: JobConfig
) -> dict:
    """A result (`Result.to_dict()`) as the job stores it: samples and token ids as the job keeps them,
    then its provenance `source` and the input record's `fields`."""
    record = dict(result)
    if not config.keep_samples:
        record["samples"] = [] if record["best"] is None else [record["best"]]
    if not config.keep_token_ids:
        for key in ("samples", "rejected"):
            if key in record:
                record[key] = [_without_ids(s) for s in record[key]]
        record["best"] = None if record["best"] is None else _without_ids(record["best"])
    record["provenance"] = source
    for name, value in fields.items():
        record[f"input_{name}" if name in OWN_FIELDS else name] = value
    return record


def _without_ids(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample with its token ids replaced by their count (`num_tokens`): the text stays, and so does
    what the summary and the report count."""
    return {
        **{key: value for key, value in sample.items() if key != "token_ids"},
        "num_tokens": len(sample["token_ids"]),
    }


def response_tokens(sample: dict[str, Any]) -> int | None:
    """A stored sample's length in tokens: its token ids', or its `num_tokens` where the job kept no ids
    (`keep_token_ids: false`); None where it holds neither."""
    ids, count = sample.get("token_ids"), sample.get("num_tokens")
    if isinstance(ids, list):
        return len(ids)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


EXPECTED = (
    "one JSON object per line with an integer `index` >= 0, a `prompt`, and a `samples` list of samples "
    "(objects with a `text`)"
)


def read_output(path: Path, end: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each record of a job output, read a line at a time (up to byte `end`,
    where a job still appending has its last complete line); a line that is no record is refused
    naming the file, the line and what is wrong."""
    with path.open("rb") as f:
        offset = 0
        for number, line in enumerate(f, 1):
            offset += len(line)
            if end is not None and offset > end:
                return
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # ValueError: bad JSON or bad UTF-8
                record = None
            problem = record_problem(record)
            if problem:
                raise ValueError(
                    f"output: line {number} of {path} is not a jaxsr record ({problem}); expected {EXPECTED}"
                )
            yield number, record


def record_problem(record: Any) -> str | None:
    """What makes `record` no jaxsr output record (None when it is one)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    index = record.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return "no integer `index` >= 0"
    if "prompt" not in record:
        return "no `prompt`"
    samples, best = record.get("samples"), record.get("best")
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        return "no `samples` list of objects"
    if best is not None and not isinstance(best, dict):
        return "`best` is neither an object nor null"
    for sample in [*samples, *([best] if best else [])]:
        if not isinstance(sample.get("text"), str):
            return "a sample has no `text`"
        score = sample.get("score")
        if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
            return f"a score is {score!r}, not a number"
    for field in ("stats", "provenance"):
        if not isinstance(record.get(field, {}), dict):
            return f"`{field}` is not an object"
    return None
