"""Compile a job's programs ahead of its calls. A job knows every call's shapes before the first runs,
and XLA compiles a program on one core: worker threads (one per core by default, at a lower scheduling
priority than the calls' own threads) compile the programs of the calls in the order the calls run
while the main thread runs the earlier calls, so that a call finds its programs in jax's caches. Each
set of programs (a batch shape) is compiled once. A call waits only for its own sets (their workers
then compile at the calls' priority), and compiles itself those no worker has begun; an error in
compiling a set is raised by the call that needs it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from jaxsr import timing

Programs = dict[Hashable, Callable[[], None]]
"""A call's programs: each set under a key (calls with the same key share it) and what compiles it."""

WORKERS_VARIABLE = "JAXSR_COMPILE_WORKERS"
"""Environment variable: threads compiling ahead (0: each call compiles its own programs). Default: one
per core this process may use."""

WORKER_NICENESS = 10
"""How much nicer than the main thread a worker compiles (`os.setpriority`), until a call waits for it."""


def compile_workers() -> int:
    """Threads compiling ahead: `JAXSR_COMPILE_WORKERS`, else one per core this process may use."""
    value = os.environ.get(WORKERS_VARIABLE, "").strip()
    if value:
        if not value.isdigit():
            raise ValueError(f"{WORKERS_VARIABLE}: expected a number of threads >= 0, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CompileAhead:
    """Compiles each call's programs (`calls[n]`, call n's) on `workers` threads, in call order."""

    def __init__(self, calls: Sequence[Programs], workers: int):
        self._compiles = {key: compile_ for programs in calls for key, compile_ in programs.items()}
        self._calls = [list(programs) for programs in calls]
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="jaxsr-compile")
        self._threads: dict[Hashable, int] = {}
        """The worker compiling each set begun, by native thread id."""
        self._niceness = _niceness()
        """The main thread's (the calls')."""
        self._futures: dict[Hashable, Future] = {
            key: self._pool.submit(self._aside, key, compile_) for key, compile_ in self._compiles.items()
        }

    def ready(self, call: int) -> float:
        """Wait until call `call`'s programs are compiled, compiling here those no worker has begun
        (raising what compiling one of them raised); the seconds it took, counted as compiling."""
        start = time.time()
        for key in self._calls[call]:
            if self._futures[key].cancel():  # not begun: compile it here rather than wait for a worker
                self._futures[key] = _run(self._compiles[key])
            elif not self._futures[key].done():  # a call waits for it: no longer aside
                _prioritize(self._threads.get(key), self._niceness)
            self._futures[key].result()
        end = time.time()
        if end > start:
            timing.waited(start, end)
        return end - start

    def close(self) -> None:
        """Drop the compiles not yet begun (the job ended or failed); those under way finish aside."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _aside(self, key: Hashable, compile_: Callable[[], None]) -> None:
        """Compile `key`'s set on a worker, at a lower scheduling priority than the calls' threads: they
        take the cores when they run, the compiles the cycles they leave (until a call waits for it)."""
        thread = threading.get_native_id()
        _prioritize(thread, min(19, self._niceness + WORKER_NICENESS))
        self._threads[key] = thread
        with timing.compiling_aside():
            compile_()


def _niceness() -> int:
    """This thread's niceness (Linux; 0 elsewhere)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if sys.platform == "linux" else 0


def _prioritize(thread: int | None, niceness: int) -> None:
    """Set a thread's niceness (Linux: per thread; raising a priority may be refused, and is skipped)."""
    if thread is not None and sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, niceness)


def _run(compile_: Callable[[], None]) -> Future:
    """`compile_()` run on this thread, as a finished future (its error held for `result`)."""
    future: Future = Future()
    try:
        compile_()
    except Exception as e:
        future.set_exception(e)
    else:
        future.set_result(None)
    return future
