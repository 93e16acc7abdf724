"""`jaxsr report`: the exact best-of-k estimator, the summary of a hand-checkable output, reports of real
generate / Best-of-N / SR job outputs, refusal of files that are not job outputs, and the HTML page as
headless Chromium draws it."""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import hf_fixtures as H
import numpy as np
import pytest
from matplotlib import image

from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.report import expected_max, report_directory, summarize, write_report
from jaxsr.jobs.runner import job_file, run_job

# -- the best-of-k estimator ---------------------------------------------------------------------------


def enumerated_max(scores: list[float], k: int) -> float:
    """The mean maximum over every k-subset of `scores`: what `expected_max` must equal."""
    maxima = [max(subset) for subset in itertools.combinations(scores, k)]
    return math.fsum(maxima) / len(maxima)


@pytest.mark.parametrize("seed", range(12))
def test_expected_max_equals_the_mean_over_every_k_subset(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    # some cases with ties (integer scores), the rest continuous and unsorted
    scores = rng.integers(-3, 3, n).astype(float) if seed % 3 == 0 else rng.normal(0, 5, n)
    curve = expected_max(list(scores))
    assert curve.shape == (n,)
    for k in range(1, n + 1):
        assert abs(curve[k - 1] - enumerated_max(list(scores), k)) <= 1e-12, (list(scores), k)


def test_expected_max_by_hand():
    # k=1: the mean; k=2: max of {1,2}, {1,3}, {2,3} = 2, 3, 3; k=3: the maximum
    assert expected_max([3.0, 1.0, 2.0]) == pytest.approx([2.0, 8 / 3, 3.0], abs=1e-15)
    assert expected_max([]).shape == (0,)


# -- a hand-checkable output ---------------------------------------------------------------------------


def sample(score: float | None, finished: bool, tokens: int | None = None) -> dict:
    out = {"text": "x", "score": score, "finished": finished, "logprob": None, "index": None}
    return out if tokens is None else {**out, "token_ids": list(range(tokens))}


def sr_stats(sizes: list[int], live: list[int], **seconds: float) -> dict:
    log = [{"batch_size": b, "live_rows": r} for b, r in zip(sizes, live, strict=True)]
    return {**seconds, "rounds": len(sizes), "batch_sizes": sizes, "round_log": log}


RECORDS = [
    {  # scores 1, 3: best 3 (unfinished); best of 1 = 2, best of 2 = 3
        "index": 1,
        "prompt": "b",
        "samples": [sample(1.0, True, 2), sample(3.0, False, 4)],
        "best": sample(3.0, False, 4),
        "stats": sr_stats([4, 2], [4, 1], prefill_s=0.5, decode_s=1.0, wall_s=2.0),
        "rejected": [
            {**sample(0.5, False, 1), "decision": 0, "at_token": 5, "forced": False},
            {**sample(0.7, False, 1), "decision": 0, "at_token": 5, "forced": True},
            {**sample(0.2, False, 3), "decision": 1, "at_token": 9, "forced": False},
        ],
    },
    {  # scores 2, 4, 6: best 6; best of 1 = 4, of 2 = (4 + 6 + 6) / 3, of 3 = 6
        "index": 0,
        "prompt": [{"role": "user", "content": "a"}],
        "samples": [sample(2.0, True, 1), sample(4.0, True, 1), sample(6.0, True, 1)],
        "best": sample(6.0, True, 1),
        "stats": sr_stats([4], [3], prefill_s=0.25, decode_s=1.0, wall_s=1.5),
        "rejected": [],
    },
    {  # nothing scored, no token ids, no stats: counts in prompts and finished shares only
        "index": 2,
        "id": "c",
        "prompt": "c",
        "samples": [sample(None, False)],
        "best": None,
        "provenance": {"model": "not the job file's", "jaxsr": "0.1.0"},
    },
]
JOB = {
    "jaxsr_job": "0123456789abcdef",
    "config": {"method": "speculative_rejection", "model": "m", "reward": "r", "draft": None, "n": 4}
    | {"max_new_tokens": 8, "temperature": 0.7, "top_k": 50, "top_p": 1.0, "seed": 3, "num_samples": 1},
}


@pytest.fixture
def output(tmp_path) -> Path:
    path = tmp_path / "out" / "job.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    job_file(path).write_text(json.dumps(JOB))
    return path


def test_summary_of_a_small_output(output):
    s = summarize(output)
    assert (s.prompts, s.samples) == (3, 6)
    assert (s.best_finished.hits, s.best_finished.total) == (1, 2)
    assert (s.sample_finished.hits, s.sample_finished.total) == (4, 6)
    assert list(s.best_scores) == [3.0, 6.0] and sorted(s.sample_scores) == [1, 2, 3, 4, 6]
    # best of k: mean over the prompts with >= k scored samples
    assert s.best_of_k.means() == pytest.approx([3.0, (3 + 16 / 3) / 2, 6.0], abs=1e-12)
    assert s.best_of_k.counts == [2, 2, 1]
    assert (s.tokens, s.token_samples) == (9, 5)
    assert s.seconds == pytest.approx({"prefill_s": 0.75, "decode_s": 2.0, "wall_s": 3.5})
    assert s.sr is not None and dict(s.sr.rounds) == {2: 1, 1: 1} and dict(s.sr.first_batch) == {4: 2}
    assert s.sr.batch_sizes.means() == [4, 2] and s.sr.live_rows.means() == [3.5, 1]
    assert (s.sr.rejected.hits, s.sr.rejected.total, s.sr.rejected_prompts) == (1, 3, 2)
    # the job file names the job; a record's provenance adds what the job file does not say
    assert s.header["job"] == "0123456789abcdef" and s.header["model"] == "m"
    assert s.header["jaxsr"] == "0.1.0" and "draft" not in s.header and "num_samples" not in s.header
    assert s.header["sampling"] == "temperature 0.7, top_k 50, top_p 1.0"


def test_summary_table_shows_the_numbers(output):
    text = summarize(output).table()
    rows = {line.split("  ")[1].strip(): line.strip() for line in text.splitlines()}
    expected = {
        "prompts": "3",
        "samples per prompt": "2.00",
        "finished (best)": "1/2 (50%)",
        "finished (samples)": "4/6 (67%)",
        "best reward": "mean 4.5000, median 4.5000",
        "sample reward": "mean 3.2000, median 3.0000",
        "best of k (mean)": "k=1 3.0000, k=2 4.1667, k=3 6.0000",
        "response tokens": "mean 1.8, total 9",
        "seconds (summed)": "prefill 0.75, decode 2.00, wall 3.50",
        "SR rounds per prompt": "mean 1.50 (min 1, max 2)",
        "SR first batch": "4 (2 prompts)",
        "SR rows per round": "4, 2",
        "SR live rows per round": "3.50, 1",
        "SR rejected": "3 (1.50 per prompt; 1 forced by the memory)",
    }
    for name, value in expected.items():
        assert re.fullmatch(rf"{re.escape(name)}\s+{re.escape(value)}", rows[name]), rows[name]
    assert text.splitlines()[0].split() == ["jaxsr", "report", str(output)]


def test_report_is_one_self_contained_page_and_its_plots(output):
    page = write_report(output)
    folder = report_directory(output)
    assert page == folder / "report.html" and folder == output.parent / "job.report"
    pngs = {p.stem: p.read_bytes() for p in folder.glob("*.png")}
    assert set(pngs) == {"best_of_k", "rewards", "sr_rounds", "seconds"}
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(f"{n}.png" for n in pngs), "report.html"])
    html = page.read_text()
    inlined = [base64.b64decode(d) for d in re.findall(r'src="data:image/png;base64,([^"]+)"', html)]
    assert sorted(inlined) == sorted(pngs.values())  # each plot inlined as written
    assert not re.search(r"<script|<link|https?://|src=\"(?!data:)", html)  # nothing fetched or run
    assert "not the job file" not in html and "speculative_rejection" in html


def test_report_directory_is_chosen_and_rewritten_whole(output, tmp_path):
    other = tmp_path / "elsewhere" / "r"
    assert write_report(output, other) == other / "report.html"
    first = (other / "report.html").read_text()
    assert write_report(str(output), str(other)) == other / "report.html"
    assert (other / "report.html").read_text() == first
    assert not list(other.glob("*.partial"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write the report there"):
        write_report(output, tmp_path / "file" / "r")


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
        ("", "not a JSON object"),
        ('{"samples": []}', "no integer `index` >= 0"),
        ('{"index": -1, "samples": []}', "no integer `index` >= 0"),
        ('{"index": true, "samples": []}', "no integer `index` >= 0"),
        ('{"index": 0, "samples": []}', "no `prompt`"),
        ('{"index": 0, "prompt": "p"}', "no `samples` list of objects"),
        ('{"index": 0, "prompt": "p", "samples": [1]}', "no `samples` list of objects"),
        ('{"index": 0, "prompt": "p", "samples": [], "best": 3}', "`best` is neither an object nor null"),
        ('{"index": 0, "prompt": "p", "samples": [{"score": 1.0}]}', "a sample has no `text`"),
        (
            '{"index": 0, "prompt": "p", "samples": [{"text": "t", "score": "high"}]}',
            "a score is 'high', not a number",
        ),
        ('{"index": 0, "prompt": "p", "samples": [], "stats": []}', "`stats` is not an object"),
    ],
)
def test_a_line_that_is_not_a_record_is_named(output, line, problem):
    good = json.dumps(RECORDS[0])
    output.write_text(f"{good}\n{line}\n{good}\n")
    message = (
        f"output: line 2 of {output} is not a jaxsr record ({problem}); expected one JSON object per line"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        write_report(output)
    assert not report_directory(output).exists()


def test_missing_empty_and_non_file_outputs_are_refused(output, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'no.jsonl'}: no such file")):
        summarize(tmp_path / "no.jsonl")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: not a file")):
        summarize(tmp_path)
    output.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{output}: no records")):
        summarize(output)


def test_an_unreadable_job_file_leaves_the_header_to_the_records(output):
    job_file(output).write_text("{not json")
    header = summarize(output).header
    assert header == {"model": "not the job file's", "jaxsr": "0.1.0"}
    job_file(output).unlink()
    assert summarize(output).header == header


# -- headless Chromium draws the page --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)"
)
def test_chromium_draws_the_page_with_its_plots(output, tmp_path):
    page = write_report(output)
    shot = tmp_path / "page.png"
    command = [
        "chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
        "--window-size=1200,2000", "--hide-scrollbars", page.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    pixels = image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1200)
    colours = np.unique((pixels * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200 and pixels.std() > 0.05  # text, lines and bars, not a blank page
    # matplotlib's first colour (C0, #1f77b4) is drawn: the inlined plots were decoded and shown
    c0 = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=-1) < 0.02
    assert c0.sum() > 2000


# -- real job outputs ------------------------------------------------------------------------------------

JOBS = {
    "generate": ["method=generate", "num_samples=2", "max_new_tokens=8"],
    "best_of_n": ["method=best_of_n", "reward=self_likelihood", "n=4", "max_new_tokens=12"],
    "speculative_rejection": [
        "method=speculative_rejection", "reward=self_likelihood", "n=8", "rejection_rate=0.5",
        "memory_budget=192", "max_new_tokens=32",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    """Each method's output of 3 prompts from a tiny random Llama with the byte tokenizer."""
    root = tmp_path_factory.mktemp("jobs")
    model = H.build_llama_with_tokenizer("LlamaForCausalLM", H.byte_tokenizer(), root / "model", 21)
    data = root / "prompts.json"
    data.write_text(json.dumps([{"prompt": p} for p in ["Name a color.", "Say hi.", "Count to three."]]))
    common = [f"model={model}", f"data={data}", "seed=0"]
    return {
        method: run_job(
            load_job_config(None, [*common, *keys, f"output={root / method}.jsonl"]),
            build_solver,
            progress=False,
        )
        for method, keys in JOBS.items()
    }


def plots(page: Path) -> set[str]:
    return {p.stem for p in page.parent.glob("*.png")}


@pytest.mark.slow
def test_report_of_a_generate_job_shows_no_rewards(outputs):
    page = write_report(outputs["generate"])
    assert plots(page) == {"seconds"}
    s = summarize(outputs["generate"])
    assert (s.prompts, s.samples, s.header["method"]) == (3, 6, "generate")
    assert not s.best_scores and not s.sample_scores and s.sr is None
    assert "reward" not in s.table() and "reward" not in page.read_text()
    assert {"prefill_s", "decode_s", "compile_s", "wall_s"} <= set(s.seconds)
    assert 0 < s.tokens <= 6 * 8


@pytest.mark.slow
def test_report_of_a_best_of_n_job(outputs):
    page = write_report(outputs["best_of_n"])
    assert plots(page) == {"best_of_k", "rewards", "seconds"}
    s = summarize(outputs["best_of_n"])
    assert (s.prompts, s.samples, s.header["n"], s.header["reward"]) == (3, 12, "4", "self_likelihood")
    curve = s.best_of_k.means()
    # best of all n samples is the job's best; best of 1 is a sample's mean reward
    assert len(curve) == 4 and curve[-1] == pytest.approx(np.mean(s.best_scores), abs=1e-12)
    assert curve[0] == pytest.approx(np.mean(s.sample_scores), abs=1e-12)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(curve))


@pytest.mark.slow
def test_report_of_a_speculative_rejection_job(outputs):
    page = write_report(outputs["speculative_rejection"])
    assert plots(page) == {"best_of_k", "rewards", "sr_rounds", "seconds"}
    s = summarize(outputs["speculative_rejection"])
    assert s.sr is not None and dict(s.sr.first_batch) == {8: 3}
    assert s.sr.batch_sizes.means()[0] == 8 and s.sr.batch_sizes.means()[-1] <= 4
    assert min(s.sr.rounds) >= 2 and re.search(r"\n  SR rows per round +8, ", s.table())
    assert {"compaction_s", "scoring_s"} <= set(s.seconds)
