"""Run a job: prompts in, one JSONL record per prompt out, written as soon as the call that decoded the
prompt returns (prompts decoded together in one batch finish together).

The output holds nothing but records, so `datasets.load_dataset("json", ...)` reads one row per prompt;
the job (its fingerprint and config) is named in a job file beside it (`x.jsonl` -> `x.job.json`).
Re-running the same job resumes: prompts whose record is complete are skipped and a torn last line (from
a kill) is cut off. An output file that belongs to a different job is refused rather than mixed. An output
written before job files existed (the job on its first line) resumes too, and is rewritten in this form.

Several processes (hosts of a TPU pod or GPU VMs joined by `jax.distributed`) split a job: each decodes
a contiguous block of the prompts on its own devices into its own part file next to the output, and
when all are done process 0 merges the parts into the output (in prompt order) and removes them. The
output's directory must be one that every host sees.

One job per output: a running job holds an exclusive lock on each file it writes (`x.jsonl.lock` beside
it, taken before any model is loaded; see `jaxsr.locks`); a second job on the same output is refused at
once, naming the holder. The operating system releases the lock when the process dies, so a killed job
resumes.
"""

from __future__ import annotations

import contextlib
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

from jaxsr.data import read_prompts
from jaxsr.jobs.config import JobConfig
from jaxsr.jobs.methods import Solve, Solver
from jaxsr.locks import holding


def job_file(output: Path) -> Path:
    """The file beside an output that names its job: `out/x.jsonl` -> `out/x.job.json`."""
    return output.with_name(f"{output.stem}.job.json")


def _write_durably(path: Path, data: bytes) -> None:
    """Replace `path` by `data` atomically: a kill leaves the old file or the new one, never a mix."""
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class JsonlOutput:
    """Append-only JSONL, one record per prompt, and beside it the job file that names the job (its
    fingerprint and config), so the records load as they are (`datasets`, pandas) while a resume can
    still tell whose records they are. Knows which prompt indices are already complete."""

    def __init__(self, path: str | Path, config: JobConfig, *, read_only: bool = False):
        """`read_only`: only read the complete records (another process may still be appending)."""
        self.path = Path(path)
        self.job_path = job_file(self.path)
        self.fingerprint = config.fingerprint()
        self.done: set[int] = set()
        self._records: list[str] = []
        self.job = {"jaxsr_job": self.fingerprint, "config": dataclasses.asdict(config)}
        if self.path.exists() and self.path.stat().st_size:
            self._resume(read_only)

    def _resume(self, read_only: bool) -> None:
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        lines = complete.decode(errors="replace").splitlines()
        legacy = self._legacy_header(lines[0]) if lines else None
        if legacy is not None:  # written before job files existed: the job was named on line 1
            lines = lines[1:]
        owner = legacy if legacy is not None else self._named_job()
        if owner != self.fingerprint:
            whose = f"job {owner}" if owner else f"no job named in {self.job_path.name}: not a jaxsr output"
            raise ValueError(
                f"output: {self.path} already holds records of a different job ({whose}; this job is "
                f"{self.fingerprint}); choose another output path or remove that file"
            )
        for number, line in enumerate(lines, 1):
            try:
                index = json.loads(line)["index"]
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
                index = None
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"output: line {number} of {self.path} is not a jaxsr record")
            self.done.add(index)
        self._records = lines
        if read_only:
            return
        if legacy is not None:  # move the job to its own file; the records file becomes plain records
            self._write_job_file()
            _write_durably(self.path, "".join(line + "\n" for line in lines).encode())
        elif len(complete) < len(raw):  # a record torn by a kill: drop it, it is redone
            with self.path.open("r+b") as f:
                f.truncate(len(complete))

    def _named_job(self) -> str | None:
        """The fingerprint in the job file beside the output (None when absent or unreadable)."""
        try:
            return json.loads(self.job_path.read_text()).get("jaxsr_job")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            return None

    @staticmethod
    def _legacy_header(line: str) -> str | None:
        try:
            first = json.loads(line)
        except json.JSONDecodeError:
            return None
        return first.get("jaxsr_job") if isinstance(first, dict) and "index" not in first else None

    def _write_job_file(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_durably(self.job_path, (json.dumps(self.job, indent=1) + "\n").encode())

    def write(self, index: int, record: dict[str, Any]) -> None:
        """Append one record; the job file is written with the first record (a job that fails before
        producing anything leaves no file behind, and a failed write no torn line)."""
        existed = self.path.exists()
        first = not existed or not self.path.stat().st_size
        line = json.dumps({"index": index, **record})
        size = self.path.stat().st_size if not first else 0
        try:
            if first:
                self._write_job_file()
            with self.path.open("a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                if not existed:  # never remove a file that was there before the job
                    self.path.unlink(missing_ok=True)
                if first:
                    self.job_path.unlink(missing_ok=True)
                else:
                    os.truncate(self.path, size)
            raise ValueError(f"output: cannot write {self.path} ({e.strerror or e})") from None
        self._records.append(line)
        self.done.add(index)

    def records(self) -> dict[int, str]:
        """The complete records in the file, by prompt index."""
        return {json.loads(line)["index"]: line for line in self._records}

    def replace_with(self, records: dict[int, str]) -> None:
        """Atomically (and durably) make the file `records` in prompt order."""
        ordered = [records[i] for i in sorted(records)]
        self._write_job_file()
        _write_durably(self.path, "".join(line + "\n" for line in ordered).encode())
        self._records = ordered
        self.done = set(records)

    def remove(self) -> None:
        """Delete the records and the job file (a part file once merged)."""
        self.path.unlink()
        self.job_path.unlink(missing_ok=True)


def chunks(indices: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def part_path(output: Path, process: int, processes: int) -> Path:
    """Where process `process` of `processes` writes its records of a multi-process job."""
    return output.with_name(f"{output.stem}.part-{process:05d}-of-{processes:05d}{output.suffix}")


def run_job(config: JobConfig, build: Callable[[JobConfig], Solver], *, progress: bool = True) -> Path:
    """Run the job: lock the files this process writes, read the prompts, build the solver (which
    loads the models), check every prompt, then drive `solve(prompts, first_index) -> records` over
    the pending prompts (this process's block of them when several processes run the job)."""
    output_path, process, processes = Path(config.output), jax.process_index(), jax.process_count()
    with contextlib.ExitStack() as held:
        if process == 0:
            held.enter_context(holding(output_path, beside=[job_file(output_path)]))
        if processes > 1:
            part = part_path(output_path, process, processes)
            held.enter_context(holding(part, beside=[job_file(part)]))
        prompts = read_prompts(config.data, config.limit)
        output = JsonlOutput(output_path, config)
        if output.done and max(output.done) >= len(prompts):
            raise ValueError(
                f"output: {output.path} holds a record of prompt {max(output.done)}, but the data has "
                f"{len(prompts)} prompts; it is not this job's output"
            )
        solver = build(config)
        solver.check(prompts)
        solve, prompts_per_call = solver.solve, solver.prompts_per_call
        if processes == 1:
            _merge_parts(output, config)  # parts left by a multi-process run
            _solve_into(output, range(len(prompts)), prompts, solve, prompts_per_call, progress)
            return output.path
        return _run_part(output, config, prompts, solve, prompts_per_call, progress)


def _run_part(
    output: JsonlOutput,
    config: JobConfig,
    prompts: list[str],
    solve: Solve,
    prompts_per_call: int,
    progress: bool,
) -> Path:
    """This process's block of a multi-process job into its part file; process 0 then merges."""
    process, processes = jax.process_index(), jax.process_count()
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
    parts = [JsonlOutput(path, config, read_only=True) for path in _part_files(output)]
    if not parts and total is None:
        return 0
    records = output.records()
    for part in parts:
        for index, line in part.records().items():
            records.setdefault(index, line)
    missing = 0 if total is None else total - len(records)
    if missing:
        return missing
    output.replace_with(records)
    for part in parts:
        part.remove()
    return 0


def _solve_into(
    output: JsonlOutput,
    indices: range,
    prompts: list[str],
    solve: Solve,
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
