"""A job's output record: the prompt's `Result` as stored, what produced it, and its input's fields.

`{"index", "prompt", "samples", "best", "stats", ["rejected"], "provenance", <the input record's other
fields>}`. The provenance (jaxsr's version, the job's fingerprint, and every key that decides what was
computed: method, models, reward, sampling, seed, ...) is in every record, so it survives outputs being
concatenated or published without their job file. An input field named like one of jaxsr's is kept as
`input_<name>`."""

from __future__ import annotations

import importlib.metadata
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
    return {key: value for key, value in sample.items() if key != "token_ids"}
