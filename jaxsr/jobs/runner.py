"""Run a job: prompts in, one JSONL record per prompt out, written as soon as the call that decoded the
prompt returns (prompts decoded together in one batch finish together).

The output starts with a header line naming the job's fingerprint. Re-running the same job resumes:
prompts whose record is complete are skipped and a torn last line (from a kill) is cut off. An output
file that belongs to a different job is refused rather than mixed.

Several processes (hosts of a TPU pod or GPU VMs joined by `jax.distributed`) split a job: each decodes
a contiguous block of the prompts on its own devices into its own part file next to the output, and
when all are done process 0 merges the parts into the output (in prompt order) and removes them. The
output's directory must be one that every host sees.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from jaxsr.jobs.config import JobConfig

DATA_DIR_ENV = "JAXSR_DATA_DIR"
BUNDLED_SETS = ("alpaca_farm_100", "alpaca_farm_eval", "hh_rlhf_100")


def find_dataset(name: str) -> Path:
    """A path as given, or a bundled set by name (searched in $JAXSR_DATA_DIR and ../shared/data)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name in BUNDLED_SETS:
        roots = [os.environ.get(DATA_DIR_ENV), Path(__file__).resolve().parents[2] / ".." / "shared" / "data"]
        for root in filter(None, roots):
            candidate = Path(root) / f"{name}.json"
            if candidate.exists():
                return candidate.resolve()
    raise FileNotFoundError(f"data: {name!r} is not a file nor a bundled set found via ${DATA_DIR_ENV}")


def read_prompts(source: str, limit: int | None = None) -> list[str]:
    path = find_dataset(source)
    text = path.read_text()
    records = (
        json.loads(text)
        if path.suffix == ".json"
        else [json.loads(l) for l in text.splitlines() if l.strip()]
    )
    if not isinstance(records, list):
        raise ValueError(f"data: {path} holds a JSON {type(records).__name__}, expected a list of records")
    prompts = []
    for i, record in enumerate(records):
        prompt = record.get("prompt") if isinstance(record, dict) else record
        if not isinstance(prompt, str):
            raise ValueError(f"data: record {i} of {path} has no string `prompt`")
        prompts.append(prompt)
    return prompts[:limit] if limit is not None else prompts


class JsonlOutput:
    """Append-only JSONL with a job header; knows which prompt indices are already complete."""

    def __init__(self, path: str | Path, config: JobConfig, *, read_only: bool = False):
        """`read_only`: only read the complete records (another process may still be appending)."""
        self.path = Path(path)
        self.fingerprint = config.fingerprint()
        self.done: set[int] = set()
        self._records: list[str] = []
        self.header = {"jaxsr_job": self.fingerprint, "config": dataclasses.asdict(config)}
        if self.path.exists() and self.path.stat().st_size:
            self._resume(read_only)

    def _resume(self, read_only: bool) -> None:
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if not complete and self._header_line().startswith(raw):  # killed while writing the header
            if not read_only:
                self.path.write_bytes(b"")
            return
        lines = complete.decode().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("jaxsr_job") != self.fingerprint:
            raise ValueError(
                f"output: {self.path} already holds records of a different job "
                f"({header.get('jaxsr_job', 'not a jaxsr output')}, this job is {self.fingerprint}); "
                "choose another output path or remove that file"
            )
        for line in lines[1:]:
            self.done.add(json.loads(line)["index"])
        self._records = lines[1:]
        if len(complete) < len(raw) and not read_only:  # a record torn by a kill: drop it, it is redone
            with self.path.open("r+b") as f:
                f.truncate(len(complete))

    def _header_line(self) -> bytes:
        return (json.dumps(self.header) + "\n").encode()

    def _append_line(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write(self, index: int, record: dict[str, Any]) -> None:
        """Append one record; the header goes first, with the first record (a job that fails before
        producing anything leaves no file behind)."""
        if not self.path.exists() or not self.path.stat().st_size:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append_line(json.dumps(self.header))
        line = json.dumps({"index": index, **record})
        self._append_line(line)
        self._records.append(line)
        self.done.add(index)

    def records(self) -> dict[int, str]:
        """The complete records in the file, by prompt index."""
        return {json.loads(line)["index"]: line for line in self._records}

    def replace_with(self, records: dict[int, str]) -> None:
        """Atomically (and durably) make the file the header plus `records` in prompt order."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".merging")
        with partial.open("wb") as f:
            f.write(self._header_line() + "".join(records[i] + "\n" for i in sorted(records)).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._records = [records[i] for i in sorted(records)]
        self.done = set(records)


def chunks(indices: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def part_path(output: Path, process: int, processes: int) -> Path:
    """Where process `process` of `processes` writes its records of a multi-process job."""
    return output.with_name(f"{output.stem}.part-{process:05d}-of-{processes:05d}{output.suffix}")


def run_job(
    config: JobConfig,
    solve: Callable[[list[str], int], list[dict[str, Any]]],
    *,
    prompts_per_call: int = 1,
    progress: bool = True,
) -> Path:
    """Drive `solve(prompts, first_index) -> records` over the job's pending prompts (this process's
    block of them when several processes run the job)."""
    prompts = read_prompts(config.data, config.limit)
    output = JsonlOutput(config.output, config)
    process, processes = jax.process_index(), jax.process_count()
    if processes == 1:
        _merge_parts(output, config)  # parts left by a multi-process run
        _solve_into(output, range(len(prompts)), prompts, solve, prompts_per_call, progress)
        return output.path
    block = range(process * len(prompts) // processes, (process + 1) * len(prompts) // processes)
    part = JsonlOutput(part_path(output.path, process, processes), config)
    for other in _part_files(output):  # records of earlier runs, whatever their process count
        part.done |= JsonlOutput(other, config, read_only=True).done
    part.done |= output.done
    _solve_into(part, block, prompts, solve, prompts_per_call, progress)
    multihost_utils.sync_global_devices(f"jaxsr job {output.fingerprint} decoded")
    missing = _merge_parts(output, config, len(prompts)) if process == 0 else 0
    # every process learns whether the merge found all records (and none waits on a failed process 0)
    missing = int(multihost_utils.broadcast_one_to_all(np.int32(missing)))
    if missing:
        raise ValueError(
            f"output: {missing} of {len(prompts)} records are in no part file visible from process 0; "
            f"every host must write {output.path.parent} on a filesystem they share (parts are kept)"
        )
    return output.path


def _part_files(output: JsonlOutput) -> list[Path]:
    pattern = f"{glob.escape(output.path.stem)}.part-*-of-*{glob.escape(output.path.suffix)}"
    return sorted(output.path.parent.glob(pattern))


def _merge_parts(output: JsonlOutput, config: JobConfig, total: int | None = None) -> int:
    """Fold every part file of the job (of any process count) into the output, each prompt once, and
    remove the parts. With `total`, merge only if all `total` records are there; returns how many are
    missing."""
    parts = _part_files(output)
    if not parts and total is None:
        return 0
    records = output.records()
    for path in parts:
        for index, line in JsonlOutput(path, config, read_only=True).records().items():
            records.setdefault(index, line)
    missing = 0 if total is None else total - len(records)
    if missing:
        return missing
    output.replace_with(records)
    for path in parts:
        path.unlink()
    return 0


def _solve_into(
    output: JsonlOutput,
    indices: range,
    prompts: list[str],
    solve: Callable[[list[str], int], list[dict[str, Any]]],
    prompts_per_call: int,
    progress: bool,
) -> None:
    pending = [i for i in indices if i not in output.done]
    bar = tqdm(total=len(indices), initial=len(indices) - len(pending), disable=not progress, unit="prompt")
    for chunk in chunks(pending, prompts_per_call):
        # consecutive indices share a call (their random streams are keyed by global index)
        runs: list[list[int]] = []
        for i in chunk:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            records = solve([prompts[i] for i in run], run[0])
            for i, record in zip(run, records, strict=True):
                output.write(i, record)
                bar.update(1)
    bar.close()
