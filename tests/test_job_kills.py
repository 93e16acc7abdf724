"""Jobs resume after SIGKILL: a running `jaxsr run` (a Speculative Rejection and a Best-of-N job) killed
at five random moments and resumed after each writes the records of an uninterrupted run (every prompt
once, the same tokens, texts and choices; scores and log-probabilities to float32 rounding, as resumed
calls pack other prompts together)."""

from __future__ import annotations

import itertools
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_jobs_cli
import yaml
from test_jobs_cli import read_jsonl, without_stats

from jaxsr.jobs.runner import job_file

model_dir = test_jobs_cli.model_dir  # the fixture: a tiny random Llama with a byte-level tokenizer

WORDS = ["red", "blue", "green", "tan", "gray", "pink", "gold", "jade"]
WORDS += ["navy", "teal", "plum", "rust", "lime", "sand", "rose", "ruby"]
PROMPTS = [form.format(w) for form in ("Say {}.", "Pick {}", "{}?", "Name {}", "A {}!") for w in WORDS]
"""80 short prompts, one length bucket: the job writes each record as its search ends (Speculative
Rejection) or as its rows end (Best-of-N), some tens a second here, after a few seconds of loading and
compiling."""
KILLS = 5
LEFT = 24
"""Records still unwritten when a kill's trigger fires: the signal lands at most a few records' time
later, while the job still runs."""
SEED = 20240531
"""The kill moments' seed: the same moments each run (up to timing)."""


METHODS = {
    "speculative_rejection": {
        "n": 8,
        "rejection_rate": 0.5,
        "memory_budget": 192,  # the first decision comes at 17 tokens, then every few tokens
        "concurrent_prompts": 2,
    },
    # two slots of 4 rows: a slot's prompt is written as soon as its rows end, the next takes its place
    "best_of_n": {"n": 4},
}


@pytest.fixture(params=list(METHODS))
def job(model_dir, tmp_path, request) -> Path:
    """A search job's YAML file (no output: each run names its own)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    config = {
        "method": request.param,
        "model": str(model_dir),
        "data": str(data),
        "reward": "self_likelihood",
        "max_new_tokens": 32,
        "seed": 0,
        **METHODS[request.param],
    }
    if request.param == "best_of_n":
        config["max_rows"] = 8
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def complete_records(path: Path) -> tuple[int, bool]:
    """(how many complete lines `path` holds, whether a torn line follows them)."""
    text = path.read_bytes() if path.exists() else b""
    return text.count(b"\n"), not text.endswith(b"\n") and bool(text)


def run(command: list[str], output: Path, kill_at: int | None = None, delay: float = 0.0):
    """Run `command`; with `kill_at`, SIGKILL it `delay` seconds after `output` holds `kill_at`
    complete records. Returns (exit status, its stderr, [(seconds since the start, complete
    records)] at each change of the output's size)."""
    start, size, timeline = time.monotonic(), 0, []
    log = output.parent.with_suffix(".stderr.txt")
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    try:
        while process.poll() is None and time.monotonic() < start + 300:
            now = output.stat().st_size if output.exists() else 0
            if now != size:
                size = now
                timeline.append((time.monotonic() - start, complete_records(output)[0]))
                if kill_at is not None and timeline[-1][1] >= kill_at:
                    time.sleep(delay)
                    break
            time.sleep(0.002)
    finally:
        if kill_at is not None or process.poll() is None:
            process.send_signal(signal.SIGKILL)  # a no-op if it already exited
        process.wait()
    text = log.read_text()
    log.unlink()
    return process.returncode, text, timeline


def split_floats(value):
    """`value` with each float replaced by a marker, and its floats in order."""
    if isinstance(value, float):
        return "<float>", [value]
    if isinstance(value, list):
        parts = [split_floats(v) for v in value]
        return [p[0] for p in parts], [f for p in parts for f in p[1]]
    if isinstance(value, dict):
        parts = {k: split_floats(v) for k, v in value.items()}
        return {k: p[0] for k, p in parts.items()}, [f for p in parts.values() for f in p[1]]
    return value, []


def assert_same_records(records: list[dict], expected: list[dict]) -> None:
    """Everything but the stats exactly (prompts, token ids, texts, flags, which sample is best), and
    each float (scores, log-probabilities) to float32 rounding."""
    for record, reference in zip(records, expected, strict=True):
        (exact, floats), (exact_ref, floats_ref) = (
            split_floats(without_stats(r)) for r in (record, reference)
        )
        assert exact == exact_ref, f"prompt {reference['index']}"
        assert floats == pytest.approx(floats_ref, rel=1e-5, abs=1e-6), f"prompt {reference['index']}"


@pytest.mark.slow
def test_five_kills_at_random_moments_then_resume_give_the_uninterrupted_records(job, tmp_path):
    def command(output: Path) -> list[str]:
        return [sys.executable, "-m", "jaxsr.cli", "run", str(job), f"output={output}", "--no-progress"]

    reference = tmp_path / "reference" / "job.jsonl"
    reference.parent.mkdir()
    code, err, timeline = run(command(reference), reference)
    assert code == 0, err[-3000:]
    _, expected = read_jsonl(reference)
    assert [r["index"] for r in expected] == list(range(len(PROMPTS)))
    # the time a record takes here (decoding and writing it), from the uninterrupted run
    gaps = [(t - t0) / (n - n0) for (t0, n0), (t, n) in itertools.pairwise(timeline) if n > n0]
    record = statistics.median(gaps)

    output = tmp_path / "killed" / "job.jsonl"
    output.parent.mkdir()
    rng = random.Random(SEED)
    kills = []  # (trigger, complete records after the kill, whether a line was torn)
    for k in range(KILLS):
        done, _ = complete_records(output)
        room = len(PROMPTS) - LEFT - done  # triggers leave room for the kills after this one
        trigger = done + rng.randint(1, max(1, room // (KILLS - k)))
        delay = rng.uniform(0, 4 * record)  # a few records later: mid-search, mid-write or between
        code, err, _ = run(command(output), output, kill_at=trigger, delay=delay)
        written, torn = complete_records(output)
        kills.append((trigger, written, torn))
        assert code == -signal.SIGKILL, f"kill {k} missed the job ({kills}): {err[-3000:]}"
        assert done < written < len(PROMPTS), kills  # mid-job: records written by this run, not all
        lines = output.read_bytes().splitlines()[:written]
        indices = [json.loads(line)["index"] for line in lines]
        assert len(set(indices)) == len(indices), f"kill {k}: a prompt's record twice: {sorted(indices)}"

    code, err, _ = run(command(output), output)
    assert code == 0, err[-3000:]
    spec, records = read_jsonl(output)
    assert spec["jaxsr_job"] == json.loads(job_file(reference).read_text())["jaxsr_job"]
    assert [r["index"] for r in records] == list(range(len(PROMPTS))), kills  # each prompt exactly once
    assert_same_records(records, expected)
    # nothing left behind: no torn line, lock, part or .partial file
    assert output.read_bytes().endswith(b"\n")
    assert sorted(p.name for p in output.parent.iterdir()) == ["job.job.json", "job.jsonl", "job.report"]
    print(f"a record: {record:.3f} s; kills (trigger, records at the kill, torn line): {kills}")
