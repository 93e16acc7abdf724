"""Run a job: prompts in, one JSONL record per prompt out, written as soon as the prompt is done (its
rows have ended, its search has ended). Calls take the pending prompts shortest first, so records come
out of prompt order: each carries its prompt's `index`.

The output holds nothing but records, so `datasets.load_dataset("json", ...)` reads one row per prompt;
the job (its fingerprint and config) is named in a job file beside it (`x.jsonl` -> `x.job.json`).
Re-running the same job resumes: prompts whose record is complete are skipped and a torn last line (from
a kill) is cut off. An output file that belongs to a different job is refused rather than mixed. An output
written before job files existed (the job on its first line) resumes too, and is rewritten in this form.

Several processes (hosts of a TPU pod or GPU VMs joined by `jax.distributed`) split a job: each decodes
its share of the pending prompts (dealt out by token count, so the shares take nearly the same time:
`share_of`) on its own devices into its own part file next to the output, and when all are done
process 0 merges the parts into the output (in prompt order) and removes them. The output's directory
must be one that every host sees.

One job per output: a running job holds an exclusive lock on each file it writes (`x.jsonl.lock` beside
it, taken before any model is loaded; see `jaxsr.locks`); a second job on the same output is refused at
once, naming the holder. The operating system releases the lock when the process dies, so a killed job
resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import heapq
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxsr.data import Columns, read_records
from jaxsr.decoding.inputs import Request
from jaxsr.jobs.ahead import CompileAhead, Programs, compile_workers
from jaxsr.jobs.config import JobConfig
from jaxsr.jobs.methods import Solve, Solver
from jaxsr.jobs.progress import Progress
from jaxsr.jobs.records import output_record, provenance
from jaxsr.ladder import bucket
from jaxsr.loading.files import read_small
from jaxsr.locks import holding


def job_file(output: Path) -> Path:
    """The file beside an output that names its job: `out/x.jsonl` -> `out/x.job.json`."""
    return output.with_name(f"{output.stem}.job.json")


JOB_FILE_BYTES = 1 << 20
"""The most a job file is read of (`loading.files.read_small`): its config is a few kilobytes."""


def write_durably(path: Path, pieces: Iterable[bytes]) -> None:
    """Replace `path` by the concatenated `pieces` atomically: a kill leaves the old file or the new
    one, never a mix. A failed write (a full disk) is a ValueError naming `path`."""
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror or e})") from None
    finally:
        partial.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


SYNC_EVERY = 1.0
"""Seconds between fsyncs of a job's records: a record per fsync took ~3 ms, 2.3 s of an 805-prompt
job's 26 s."""

BLOCK = 1 << 16
"""Bytes read at a time when looking for an output's last newline from its end."""


def complete_end(path: Path) -> int:
    """The size of `path`'s complete lines: the offset after its last newline (0 when it has none)."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - BLOCK)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
    return 0


class JsonlOutput:
    """Append-only JSONL, one record per prompt, and beside it the job file that names the job (its
    fingerprint and config), so the records load as they are (`datasets`, pandas) while a resume can
    still tell whose records they are. Knows which prompt indices are already complete, and nothing
    else of the records: reading, resuming and merging stream the file, so memory does not grow with
    the output."""

    def __init__(
        self,
        path: str | Path,
        config: JobConfig,
        *,
        read_only: bool = False,
        prompts: Sequence[Any] | None = None,
    ):
        """`read_only`: only read the complete records (another process may still be appending).
        `prompts`: every prompt of the job's data; each record must be of the prompt at its index."""
        self.path = Path(path)
        self.job_path = job_file(self.path)
        self.config = config
        self.fingerprint = config.fingerprint()
        self.done: set[int] = set()
        self.job = {"jaxsr_job": self.fingerprint, "config": dataclasses.asdict(config)}
        self._start = 0
        """Offset of the first record (past a legacy header line)."""
        self._end = 0
        """Offset after the last complete record."""
        self._synced = float("-inf")
        """`time.monotonic()` of the last fsync of the records (the first write syncs)."""
        if self.path.exists() and self.path.stat().st_size:
            self._resume(read_only, prompts)

    def _resume(self, read_only: bool, prompts: Sequence[Any] | None) -> None:
        self._end = complete_end(self.path)
        with self.path.open("rb") as f:
            first = f.readline() if self._end else b""
        legacy = self._legacy_header(first.decode(errors="replace")) if first else None
        if legacy is not None:  # written before job files existed: the job was named on line 1
            self._start = len(first)
        renamed = self._check_owner(legacy if legacy is not None else self._named_job())
        for index, prompt, _, _ in self._scan():
            if prompts is not None:
                self._check_prompt(index, prompt, prompts)
            self.done.add(index)
        if read_only:
            return
        if legacy is not None or renamed:  # the job file names this run's config
            self._write_job_file()
        if legacy is not None:  # the records file becomes plain records
            self._rewrite(self.path, self._start, self._end)
        elif self._end < self.path.stat().st_size:  # a record torn by a kill: drop it, it is redone
            with self.path.open("r+b") as f:
                f.truncate(self._end)

    def _check_owner(self, job: dict[str, Any]) -> bool:
        """Refuse an output of another job, naming each key that differs; True when it is this job
        under other growing keys (a larger `limit`), whose job file is then rewritten."""
        if job.get("jaxsr_job") == self.fingerprint:
            return False
        stored = job.get("config")
        differing = self.config.differences(stored) if isinstance(stored, dict) else None
        if differing == []:
            return True
        if differing is None:
            whose = f"no job named in {self.job_path.name}: not a jaxsr output"
            advice = "choose another output path or remove that file"
        else:
            whose, advice = (
                "; ".join(differing),
                "set those keys back to resume it, or choose another output path",
            )
        raise ValueError(f"output: {self.path} already holds records of a different job ({whose}); {advice}")

    def _check_prompt(self, index: int, prompt: Any, prompts: Sequence[Any]) -> None:
        """A record must answer the data's prompt at its index: data edited or reordered since the
        records were written would leave records of prompts the data no longer has."""
        if index >= len(prompts):
            raise ValueError(
                f"output: {self.path} holds a record of prompt {index}, but the data has {len(prompts)} "
                "prompts; it is not this job's output"
            )
        if prompt is not _NO_PROMPT and prompt != prompts[index]:
            raise ValueError(
                f"output: {self.path} holds a record of prompt {index} for {_opening(prompt)}, but the "
                f"data's prompt {index} is {_opening(prompts[index])}: the data changed since the "
                "records were written; restore it, or choose another output path"
            )

    def lines(self) -> Iterator[tuple[int, int, int]]:
        """(prompt index, offset, length) of each complete record, read one line at a time."""
        for index, _, offset, length in self._scan():
            yield index, offset, length

    def _scan(self) -> Iterator[tuple[int, Any, int, int]]:
        """(prompt index, the record's prompt, offset, length) of each complete record."""
        with self.path.open("rb") as f:
            offset = f.seek(self._start)
            for number, line in enumerate(f, 1):
                if offset + len(line) > self._end:
                    return
                yield *_parse_record(line, number, self.path), offset, len(line)
                offset += len(line)

    def _rewrite(self, source: Path, start: int, end: int) -> None:
        """Make the output bytes [start, end) of `source`, atomically and durably, copied in blocks."""
        with source.open("rb") as f:
            f.seek(start)
            write_durably(self.path, _blocks(f, end - start))
        self._start, self._end = 0, end - start

    def _named_job(self) -> dict[str, Any]:
        """The job file beside the output ({} when absent or unreadable; refused, naming it, when it is no
        small regular file)."""
        try:
            text = read_small(self.job_path, JOB_FILE_BYTES)  # a FIFO or device there is refused
        except OSError:
            return {}
        try:
            job = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return {}
        return job if isinstance(job, dict) else {}

    @staticmethod
    def _legacy_header(line: str) -> dict[str, Any] | None:
        """The job named on an output's first line (outputs written before job files), else None."""
        try:
            first = json.loads(line)
        except json.JSONDecodeError:
            return None
        return first if isinstance(first, dict) and "index" not in first and "jaxsr_job" in first else None

    def _write_job_file(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(self.job_path, [(json.dumps(self.job, indent=1) + "\n").encode()])

    def write(self, index: int, record: dict[str, Any]) -> None:
        """Append one record; the job file is written with the first record (a job that fails before
        producing anything leaves no file behind, and a failed write no torn line). The line is in the
        file when this returns (a killed process loses nothing written); it reaches the disk at the next
        `fsync`, at most `SYNC_EVERY` seconds later or at `sync()` (a power cut loses only those
        records, and a resume redoes them)."""
        existed = self.path.exists()
        first = not existed or not self.path.stat().st_size
        line = (json.dumps({"index": index, **record}) + "\n").encode()
        size = self.path.stat().st_size if not first else 0
        try:
            if first:
                self._write_job_file()
            with self.path.open("ab") as f:
                f.write(line)
                f.flush()
                if time.monotonic() - self._synced >= SYNC_EVERY:
                    os.fsync(f.fileno())
                    self._synced = time.monotonic()
        except OSError as e:
            with contextlib.suppress(OSError):
                if not existed:  # never remove a file that was there before the job
                    self.path.unlink(missing_ok=True)
                if first:
                    self.job_path.unlink(missing_ok=True)
                else:
                    os.truncate(self.path, size)
            raise ValueError(f"output: cannot write {self.path} ({e.strerror or e})") from None
        self._end = size + len(line)
        self.done.add(index)

    def sync(self) -> None:
        """Put every record written so far on the disk (the end of a job)."""
        if not self.path.exists():
            return
        try:
            with self.path.open("rb") as f:
                os.fsync(f.fileno())
        except OSError as e:
            raise ValueError(f"output: cannot write {self.path} ({e.strerror or e})") from None
        self._synced = time.monotonic()

    def replace_with(self, where: dict[int, tuple[Path, int, int]]) -> None:
        """Atomically (and durably) make the file the records `where` points to (prompt index → file,
        offset, length), in prompt order, read one at a time."""
        self._write_job_file()
        write_durably(self.path, _gathered(where))
        self._start, self._end, self.done = 0, self.path.stat().st_size, set(where)

    def remove(self) -> None:
        """Delete the records and the job file (a part file once merged)."""
        self.path.unlink()
        self.job_path.unlink(missing_ok=True)


_NO_PROMPT = object()
"""A record without a `prompt` field (nothing to check it against)."""


def _parse_record(line: bytes, number: int, path: Path) -> tuple[int, Any]:
    """(prompt index, prompt) of a record line; a line that is no jaxsr record is refused."""
    try:
        record = json.loads(line)
        index = record["index"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError):
        index = None
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"output: line {number} of {path} is not a jaxsr record")
    return index, record.get("prompt", _NO_PROMPT)


def _opening(prompt: Any, width: int = 60) -> str:
    """A prompt as an error message shows it: its first characters."""
    shown = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return repr(shown if len(shown) <= width else shown[:width] + "…")


def _blocks(f: BinaryIO, size: int) -> Iterator[bytes]:
    """`size` bytes of `f` from where it stands, a block at a time."""
    while size > 0:
        block = f.read(min(BLOCK, size))
        if not block:
            return
        size -= len(block)
        yield block


def _gathered(where: dict[int, tuple[Path, int, int]]) -> Iterator[bytes]:
    """The records `where` points to, in prompt order (each source file opened once)."""
    with contextlib.ExitStack() as opened:
        files: dict[Path, BinaryIO] = {}
        for index in sorted(where):
            path, offset, length = where[index]
            if path not in files:
                files[path] = opened.enter_context(path.open("rb"))
            files[path].seek(offset)
            yield files[path].read(length)


def chunks(indices: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def part_path(output: Path, process: int, processes: int) -> Path:
    """Where process `process` of `processes` writes its records of a multi-process job."""
    return output.with_name(f"{output.stem}.part-{process:05d}-of-{processes:05d}{output.suffix}")


def run_job(config: JobConfig, build: Callable[[JobConfig], Solver], *, progress: bool = True) -> Path:
    """Run the job: lock the files this process writes, read the prompts, build the solver (which
    loads the models), check every prompt, then drive `solve` over the pending prompts (this process's
    share of them when several processes run the job). Status lines and a bar go to stderr when
    `progress`; the summary at the end always."""
    output_path, process, processes = Path(config.output), jax.process_index(), jax.process_count()
    report = Progress(progress)
    with contextlib.ExitStack() as held:
        if process == 0:
            held.enter_context(holding(output_path, beside=[job_file(output_path)]))
        if processes > 1:
            part = part_path(output_path, process, processes)
            held.enter_context(holding(part, beside=[job_file(part)]))
        with report.phase("read", f"reading {config.data} and {output_path}…"):
            records = read_records(config.data, columns=Columns(*_column_keys(config)))
            everything = [record.prompt for record in records]
            prompts = everything[: config.limit]
            output = JsonlOutput(output_path, config, prompts=everything, read_only=process != 0)
        if processes == 1 and output.done.issuperset(range(len(prompts))) and not _part_files(output):
            report.status(f"{output.path}: all {len(prompts)} prompts are done; nothing to load")
            return output.path
        with report.phase("load", f"loading {_models(config)}…"):
            solver = build(config)
        with report.phase("check", f"checking {len(prompts)} prompts…"):
            request = solver.check(prompts)
        source = provenance(config)
        shape = lambda i, result: output_record(result, records[i].fields, source, config)
        per_call, budget = solver.prompts_per_call, config.max_new_tokens
        work = Work(request, solver.solve, per_call, budget, shape, solver.programs, solver.length_class)
        if processes == 1:
            _merge_parts(output, config)  # parts left by a multi-process run
            pending = [i for i in range(len(prompts)) if i not in output.done]
            _solve_into(output, pending, work, report, len(prompts) - len(pending))
        else:
            _run_part(output, config, work, report)
        report.finish(str(output.path))
        return output.path


def _column_keys(config: JobConfig) -> tuple[str | None, str | None, str | None]:
    """The job keys that say where the data holds its prompts, and the system prompt."""
    return config.prompt_field, config.messages_field, config.system_prompt


def _models(config: JobConfig) -> str:
    """The models a job loads, as its status line names them."""
    named = [f"model {config.model}"]
    if config.draft is not None:
        named.append(f"draft {config.draft}")
    if config.reward is not None:
        named.append(f"reward {config.reward}")
    return ", ".join(named)


def _run_part(output: JsonlOutput, config: JobConfig, work: Work, report: Progress) -> None:
    """This process's share of a multi-process job into its part file; process 0 then merges."""
    prompts, process, processes = work.prompts, jax.process_index(), jax.process_count()
    part = JsonlOutput(part_path(output.path, process, processes), config)
    done = set(output.done)
    for other in _part_files(output):  # records of earlier runs, whatever their process count
        done |= JsonlOutput(other, config, read_only=True).done
    mask = np.isin(np.arange(len(prompts)), list(done))
    # process 0's view of what is done (a shared filesystem may show the others an older one)
    mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
    pending = [i for i in range(len(prompts)) if not mask[i]]
    weights = [length + work.max_new_tokens for length in work.lengths]
    share = share_of(pending, weights, process, processes)
    tokens = sum(work.lengths[i] for i in share)
    report.status(
        f"process {process} of {processes}: {len(share)} of {len(pending)} pending prompts ({tokens} tokens)"
    )
    _solve_into(part, share, work, report)
    multihost_utils.sync_global_devices(f"jaxsr job {output.fingerprint} decoded")
    missing = _merge_parts(output, config, len(prompts)) if process == 0 else 0
    # every process learns whether the merge found all records (and none waits on a failed process 0)
    missing = int(multihost_utils.broadcast_one_to_all(np.int32(missing)))
    if missing:
        raise ValueError(
            f"output: {missing} of {len(prompts)} records are in no part file visible from process 0; "
            f"every host must write {output.path.parent} on a filesystem they share (parts are kept)"
        )


def share_of(pending: list[int], weights: list[int], process: int, processes: int) -> list[int]:
    """Process `process`'s share of the pending prompts, balanced by weight (a prompt's tokens and its
    new-token budget): heaviest first, each to the process with the least weight so far (ties: fewer
    prompts, then the lower process), so no process waits on one that got the long prompts."""
    loads = [(0, 0, p) for p in range(processes)]  # (weight, prompts, process): a heap
    mine = []
    for i in sorted(pending, key=lambda i: (-weights[i], i)):
        weight, count, owner = heapq.heappop(loads)
        heapq.heappush(loads, (weight + weights[i], count + 1, owner))
        if owner == process:
            mine.append(i)
    return mine


def _part_files(output: JsonlOutput) -> list[Path]:
    pattern = f"{glob.escape(output.path.stem)}.part-*-of-*{glob.escape(output.path.suffix)}"
    return sorted(output.path.parent.glob(pattern))


def _merge_parts(output: JsonlOutput, config: JobConfig, total: int | None = None) -> int:
    """Fold every part file of the job (of any process count) into the output, each prompt once, and
    remove the parts. With `total`, merge only if all `total` records are there; returns how many are
    missing. Records are streamed: memory holds where each one lies, not the records."""
    parts = [JsonlOutput(path, config, read_only=True) for path in _part_files(output)]
    if not parts and total is None:
        return 0
    where: dict[int, tuple[Path, int, int]] = {}
    for source in [output, *parts] if output.path.exists() else parts:
        for index, offset, length in source.lines():
            where.setdefault(index, (source.path, offset, length))
    missing = 0 if total is None else sum(i not in where for i in range(total))  # past a limit: not counted
    if missing:
        return missing
    output.replace_with(where)
    for part in parts:
        part.remove()
    return 0


@dataclasses.dataclass(frozen=True)
class Work:
    """A job's prompts (prepared by the solver's check), the solver's call, the prompts a call takes
    (None: a whole length bucket), each response's token budget, and how a prompt's result becomes its
    output record (`shape(index, result) -> record`)."""

    request: Request
    solve: Solve
    prompts_per_call: int | None
    max_new_tokens: int
    shape: Callable[[int, dict[str, Any]], dict[str, Any]]
    programs: Callable[[list[int]], Programs] | None = None
    """A call's programs by its prompts' token counts, compiled ahead of it (None: in the call)."""
    length_class: Callable[[int], int] = bucket
    """A prompt's length class by its token count: a call's prompts share one."""

    @property
    def prompts(self) -> list[Any]:
        return list(self.request.prompts)

    @property
    def lengths(self) -> list[int]:
        """Each prompt's token count as the generator reads it."""
        return [len(ids) for ids in self.request.encoded]


def _solve_into(output: JsonlOutput, pending: list[int], work: Work, report: Progress, done: int = 0) -> None:
    """Solve the `pending` prompts into `output`, by length: a call takes up to `prompts_per_call`
    prompts (all, when None) of one length class, so its batches pad little (each prompt keeps its
    index, and so its random streams and its record's place). Each record is written as soon as its
    prompt is done and carries its `index`. The calls' programs
    are compiled ahead of them (`jobs.ahead`) where the method says which they are; the seconds a call
    waits for them count in its records' `compile_s` and, as every part of a record's time, in its
    `wall_s`."""
    lengths, length_class = work.lengths, work.length_class
    pending = sorted(pending, key=lambda i: (length_class(lengths[i]), lengths[i]))
    calls = [
        chunk
        for _, same_class in itertools.groupby(pending, key=lambda i: length_class(lengths[i]))
        for chunk in chunks(list(same_class), work.prompts_per_call or len(pending))
    ]
    waited = 0.0

    def write(index: int, result: dict[str, Any]) -> None:
        start = time.perf_counter()
        stats = result.get("stats", {})
        if waited and "compile_s" in stats:  # this call's share of the wait: compiling, within the wall
            stats["compile_s"] += waited
            stats["wall_s"] += waited
        record = work.shape(index, result)
        output.write(index, record)
        report.wrote(index, record, time.perf_counter() - start)

    report.start({i: lengths[i] for i in pending}, work.max_new_tokens, done)
    try:
        with _compiling_ahead(work, calls) as ahead:
            for n, chunk in enumerate(calls):
                waited = ahead.ready(n) / len(chunk) if ahead is not None else 0.0
                work.solve(work.request.subset(chunk), write)
    finally:  # what was written reaches the disk, the job ended or not
        output.sync()


@contextlib.contextmanager
def _compiling_ahead(work: Work, calls: list[list[int]]) -> Iterator[CompileAhead | None]:
    """The calls' programs compiling ahead on `compile_workers()` threads (None: each call compiles its
    own, as a method without `programs` or JAXSR_COMPILE_WORKERS=0 does)."""
    workers = compile_workers()
    if work.programs is None or workers == 0 or not calls:
        yield None
        return
    ahead = CompileAhead([work.programs([work.lengths[i] for i in chunk]) for chunk in calls], workers)
    try:
        yield ahead
    finally:
        ahead.close()
