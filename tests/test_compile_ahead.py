"""A job compiles its calls' programs ahead of them (`jaxsr.jobs.ahead`): each program once, on the
compiling threads, none in a call; the records are those of a job that compiles in its calls, on one
device and on a mesh; an error in compiling surfaces in the call that needs the program."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import hf_fixtures as H
import jax
import pytest

from jaxsr import timing
from jaxsr.jobs.ahead import CompileAhead, compile_workers
from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import Solver, build_solver
from jaxsr.jobs.runner import run_job

PROMPTS = ["Hi.", "Yes?", "Name a color you like.", "Count from one to ten, slowly.", "Say " + "hello " * 12]
PROMPTS += ["Ok.", "No.", "Why?"]
"""Byte-tokenized with the chat template, 22-95 tokens: five prompts of the 32-token bucket, two of 64 and
one of 128, all of one length class (one call, streaming through one slab)."""
PROGRAMS = ("prefill", "empty_slab", "insert", "decode_loop")
COUNTS = [3, 1, 1, 1]
"""A prefill per length bucket; the slab's programs once."""
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""A program lowered to be compiled (or read from the persistent compilation cache): once per program."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("byte-llama")
    return H.build_llama_with_tokenizer("LlamaForCausalLM", H.byte_tokenizer(), directory, 21)


@pytest.fixture
def job(model_dir, tmp_path) -> Path:
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": p} for p in PROMPTS]))
    path = tmp_path / "job.yaml"
    path.write_text(
        f"method: generate\nmodel: {model_dir}\ndata: {data}\nmax_new_tokens: 4\nnum_samples: 2\n"
        "max_rows: 4\nseed: 0\n"
    )
    return path


@dataclasses.dataclass
class Compiles:
    """Programs lowered during a job: by name, on which thread, and whether inside a call."""

    lowered: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)
    in_call: bool = False

    def listen(self, event: str, start: float, end: float, **kw) -> None:
        if event == LOWERED:
            name = kw.get("fun_name", "").removeprefix("jit(").removesuffix(")")
            self.lowered.append((name, threading.current_thread().name, self.in_call))

    def in_calls(self) -> list[str]:
        """The programs the main thread lowered inside a call."""
        return [name for name, thread, in_call in self.lowered if in_call and thread == "MainThread"]

    def count(self, name: str) -> int:
        return sum(n == name for n, _, _ in self.lowered)


def run(job: Path, monkeypatch, workers: int, *overrides: str) -> tuple[list[dict], Compiles]:
    """The job's records (stats left out, in prompt order) and what it compiled, from empty caches."""
    monkeypatch.setenv("JAXSR_COMPILE_WORKERS", str(workers))
    output = job.parent / f"out-{workers}-{len(overrides)}.jsonl"
    config = load_job_config(job, [f"output={output}", *overrides])
    compiles = Compiles()

    def build(config) -> Solver:
        solver = build_solver(config)

        def solve(request, write):
            compiles.in_call = True
            try:
                solver.solve(request, write)
            finally:
                compiles.in_call = False

        return dataclasses.replace(solver, solve=solve)

    jax.clear_caches()
    jax.monitoring.register_event_time_span_listener(compiles.listen)
    try:
        run_job(config, build, progress=False)
    finally:
        jax.monitoring.unregister_event_time_span_listener(compiles.listen)
    records = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda r: r["index"])
    return [{k: v for k, v in r.items() if k != "stats"} for r in records], compiles


@pytest.mark.parametrize("mesh", [[], ["mesh_data=-1"]], ids=["one device", "8 devices"])
def test_each_program_compiles_once_ahead_and_none_in_a_call_with_the_same_records(job, monkeypatch, mesh):
    ahead_records, ahead = run(job, monkeypatch, 2, *mesh)
    assert [ahead.count(name) for name in PROGRAMS] == COUNTS
    assert ahead.in_calls() == []  # every program was ready before the call that runs it
    workers = {thread for name, thread, _ in ahead.lowered if name in PROGRAMS} - {"MainThread"}
    assert workers  # (the main thread compiles the sets no worker had begun when a call needed them)

    records, inline = run(job, monkeypatch, 0, *mesh)
    assert [inline.count(name) for name in PROGRAMS] == COUNTS
    assert set(inline.in_calls()) >= set(PROGRAMS)
    assert ahead_records == records
    assert [len(r["samples"]) for r in records] == [2] * len(PROMPTS)


@pytest.mark.slow  # runs an SD job twice from empty caches, compiled ahead and in its calls
def test_a_two_model_job_compiles_ahead_too(job, monkeypatch):
    pair = ["method=speculative_decode", f"draft={load_job_config(job).model}", "gamma=2", "limit=3"]
    ahead_records, ahead = run(job, monkeypatch, 1, *pair)
    # two prefill buckets (2 prompts of 32 slots, 1 of 64), one slab; the draft is the model, so one
    # prefill serves both
    assert [ahead.count(name) for name in PROGRAMS] == [2, 1, 1, 1]
    assert ahead.in_calls() == []
    records, _ = run(job, monkeypatch, 0, *pair)
    assert ahead_records == records


def compiles_after(events: list[str], name: str, wait: threading.Event | None = None, fail: bool = False):
    def compile_() -> None:
        if wait is not None:
            assert wait.wait(timeout=30)
        if fail:
            raise RuntimeError(f"{name} does not compile")
        events.append(f"{name} on {threading.current_thread().name}")

    return compile_


def test_a_compile_error_surfaces_in_the_call_that_needs_the_program():
    events: list[str] = []
    calls = [{"a": compiles_after(events, "a")}, {"b": compiles_after(events, "b", fail=True)}]
    ahead = CompileAhead(calls, workers=1)
    try:
        ahead.ready(0)
        with pytest.raises(RuntimeError, match="b does not compile"):
            ahead.ready(1)
        with pytest.raises(RuntimeError, match="b does not compile"):  # and again, never a hang
            ahead.ready(1)
    finally:
        ahead.close()


def test_a_call_compiles_itself_what_no_worker_has_begun_and_waits_for_what_one_has():
    events: list[str] = []
    release = threading.Event()
    calls = [{"slow": compiles_after(events, "slow", release)}, {"next": compiles_after(events, "next")}]
    calls.append({"slow": calls[0]["slow"], "next": calls[1]["next"]})  # shares both: compiled once
    ahead = CompileAhead(calls, workers=1)
    try:
        time.sleep(0.05)  # the one worker takes "slow" and blocks on it
        ahead.ready(1)  # "next" has not begun: compiled here, not after "slow"
        assert events == ["next on MainThread"]
        release.set()
        ahead.ready(0)
        ahead.ready(2)
        assert len(events) == 2 and events[1].startswith("slow on jaxsr-compile")
    finally:
        ahead.close()


def test_compiling_aside_is_not_a_stage_s_compiling_but_its_wait_is():
    watch = timing.Stopwatch()

    def aside() -> None:
        with timing.compiling_aside():
            jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((13, 7), "float32")).compile()

    thread = threading.Thread(target=aside)
    thread.start()
    thread.join()
    assert watch.split()[1] == 0.0
    start = time.time()
    time.sleep(0.2)  # a stage waiting for programs compiled aside
    timing.waited(start, start + 0.2)
    assert watch.split()[1] == pytest.approx(0.2)


def test_the_workers_are_one_per_core_unless_told(monkeypatch):
    monkeypatch.delenv("JAXSR_COMPILE_WORKERS", raising=False)
    assert compile_workers() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("JAXSR_COMPILE_WORKERS", "0")
    assert compile_workers() == 0
    monkeypatch.setenv("JAXSR_COMPILE_WORKERS", "two")
    with pytest.raises(ValueError, match="JAXSR_COMPILE_WORKERS"):
        compile_workers()
