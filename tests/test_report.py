"""`jaxsr report`: the exact best-of-k estimator (its float weights against exact fractions, and its
speed), curves whose every point averages the same prompts, a time split that adds up (a job counts its
wait for programs compiled ahead in the wall too), the summary of a hand-checkable output, the responses
the pages show (escaped, paged), reports of real generate / Best-of-N / SR job outputs, refusal of files
that are not job outputs or job files (a FIFO, a device, a huge file), a running job's torn last line,
and the HTML page as headless Chromium draws it."""

from __future__ import annotations

import base64
import dataclasses
import html
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import time
from fractions import Fraction
from pathlib import Path

import hf_fixtures as H
import numpy as np
import pytest
from matplotlib import image
from matplotlib.figure import Figure
from refusals import within

from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.progress import Progress
from jaxsr.jobs.report import (
    JOB_FILE_BYTES,
    PAGE,
    PLOTS,
    SHOWN_PROMPTS,
    Seconds,
    expected_max,
    max_weights,
    report_directory,
    summarize,
    write_report,
)
from jaxsr.jobs.runner import Work, _solve_into, job_file, run_job

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


@pytest.mark.parametrize("n", [1, 2, 3, 10, 33, 80])
def test_max_weights_equal_the_exact_binomial_ratios(n):
    for k, row in enumerate(max_weights(n), 1):
        exact = [Fraction(math.comb(i - 1, k - 1), math.comb(n, k)) for i in range(1, n + 1)]
        assert [w == 0 for w in row] == [e == 0 for e in exact], (n, k)  # i < k: exactly no weight
        for w, e in zip(row, exact, strict=True):
            assert e == 0 or abs(w - e) <= 1e-12 * e, (n, k, w, float(e))
    assert len(list(max_weights(n, most=2))) == min(n, 2)


def test_expected_max_of_4096_samples_for_every_k_takes_well_under_a_second():
    scores = np.random.default_rng(0).normal(10, 1, 4096)
    start = time.perf_counter()
    curve = expected_max(scores)
    seconds = time.perf_counter() - start
    assert seconds < 1.0, seconds  # exact big integers: 23 s for 1,024 samples, 4,096 never ended
    assert curve.shape == (4096,) and np.all(np.diff(curve) >= 0)
    assert curve[0] == pytest.approx(scores.mean(), rel=1e-12) and curve[-1] == pytest.approx(scores.max())
    assert expected_max(scores, most=5) == pytest.approx(curve[:5], rel=1e-15)


# -- a hand-checkable output ---------------------------------------------------------------------------


def sample(score: float | None, finished: bool, tokens: int | None = None, text: str = "x") -> dict:
    out = {"text": text, "score": score, "finished": finished, "logprob": None, "index": None}
    return out if tokens is None else {**out, "token_ids": list(range(tokens))}


def sr_stats(sizes: list[int], live: list[int], **seconds: float) -> dict:
    log = [{"batch_size": b, "live_rows": r} for b, r in zip(sizes, live, strict=True)]
    return {**seconds, "rounds": len(sizes), "batch_sizes": sizes, "round_log": log}


SIX = 'six </pre><script>alert("x")</script>'
"""A response whose text would end the page's <pre> and run a script, were it not escaped."""
RECORDS = [
    {  # scores 1, 3: best 3 (unfinished); best of 1 = 2, best of 2 = 3
        "index": 1,
        "prompt": "b",
        "samples": [sample(1.0, True, 2, "one <b>"), sample(3.0, False, 4, "three & 'q'")],
        "best": sample(3.0, False, 4, "three & 'q'"),
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
        "samples": [sample(2.0, True, 1, "two"), sample(4.0, True, 1), sample(6.0, True, 1, SIX)],
        "best": sample(6.0, True, 1, SIX),
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
    # best of k: each curve averages the same prompts at every k; every prompt's up to k = 2 (the
    # fewest scored samples of a prompt), the one prompt with 3 up to k = 3
    (every, n_every), (most, n_most) = s.best_of_k.curves()
    assert (n_every, n_most) == (2, 1)
    assert every == pytest.approx([3.0, (3 + 16 / 3) / 2], abs=1e-12)
    assert most == pytest.approx([4.0, 16 / 3, 6.0], abs=1e-12)
    assert (s.tokens, s.token_samples) == (9, 5)
    assert s.seconds.parts == pytest.approx({"prefill_s": 0.75, "decode_s": 2.0})
    assert (s.seconds.wall, s.seconds.other, s.seconds.outside) == pytest.approx((3.5, 0.75, 0.0))
    assert not s.torn and s.end == output.stat().st_size
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
        "best of k (mean)": "k=1 3.0000, k=2 4.1667 (2 prompts with ≥ 2 scored samples)",
        "best of k (most samples)": "k=1 4.0000, k=2 5.3333, k=3 6.0000 (1 prompt with ≥ 3 scored samples)",
        "response tokens": "mean 1.8, total 9",
        "seconds (summed)": "wall 3.50 = prefill 0.75 + decode 2.00 + other 0.75",
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


def scored_record(index: int, scores: list[float], **fields) -> dict:
    """A record of prompt `index` whose samples have `scores` (finished), its best the highest."""
    samples = [sample(v, True, text=f"p{index} s{j}") for j, v in enumerate(scores)]
    best = max(samples, key=lambda x: x["score"]) if samples else None
    return {"index": index, "prompt": f"prompt {index}", "samples": samples, "best": best, **fields}


def write_output(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def drawn(name: str, summary) -> Figure:
    """The plot `name` of a summary, drawn on a figure of its own."""
    figure = Figure()
    PLOTS[name][2](figure.add_subplot(), summary)
    return figure


def test_every_point_of_a_best_of_k_curve_averages_the_same_prompts(tmp_path):
    # SR kept 6 samples of one prompt and 5 of each other: averaged over whichever prompts reach k, the
    # curve jumped at k = 6 to that one prompt's best (0.707)
    rng = np.random.default_rng(1)
    scores = [list(rng.uniform(0, 0.3, 5)) for _ in range(4)] + [[0.1, 0.2, 0.3, 0.4, 0.5, 0.707]]
    s = summarize(write_output(tmp_path / "sr.jsonl", [scored_record(i, v) for i, v in enumerate(scores)]))
    (every, n_every), (most, n_most) = s.best_of_k.curves()
    by_hand = [math.fsum(enumerated_max(v, k) for v in scores) / 5 for k in range(1, 6)]
    assert n_every == 5 and every == pytest.approx(by_hand, abs=1e-12)
    assert n_most == 1 and most == pytest.approx([enumerated_max(scores[4], k) for k in range(1, 7)])
    lines = {line.get_label(): list(line.get_ydata()) for line in drawn("best_of_k", s).axes[0].get_lines()}
    assert lines["5 prompts with ≥ 5 scored samples"] == pytest.approx(by_hand, abs=1e-12)
    assert lines["1 prompt with ≥ 6 scored samples"] == pytest.approx(most, abs=1e-12)


def test_a_4096_sample_output_is_summarized_in_well_under_a_second(tmp_path):
    scores = list(np.random.default_rng(2).normal(0, 1, 4096))
    path = write_output(tmp_path / "big.jsonl", [scored_record(0, scores), scored_record(1, scores[::-1])])
    start = time.perf_counter()
    table = summarize(path).table()
    assert time.perf_counter() - start < 1.0
    assert f"k=4096 {max(scores):.4f} (2 prompts with ≥ 4096 scored samples)" in table


def test_the_time_split_adds_up_with_what_lies_outside_the_wall_beside_it(tmp_path):
    # an output written before a call's wait for the programs compiled ahead counted in the wall: the
    # first call's two prompts hold the wait (40 s) in compile_s alone, so compile (43 s) > wall (19 s)
    waited = {"prefill_s": 1.0, "decode_s": 4.0, "scoring_s": 1.0, "compile_s": 21.5, "wall_s": 7.5}
    stats = [waited, waited, {"prefill_s": 1.0, "decode_s": 2.0, "scoring_s": 1.0, "wall_s": 4.0}]
    records = [{"index": i, "prompt": "p", "samples": [], "stats": st} for i, st in enumerate(stats)]
    s = summarize(write_output(tmp_path / "bon.jsonl", records))
    assert s.seconds.text() == (
        "wall 19.00 + outside the wall 40.00 = prefill 3.00 + decode 10.00 + scoring 3.00 + compile 43.00"
    )
    bars: dict[float, float] = {}
    for bar in drawn("seconds", s).axes[0].patches:
        bars[bar.get_y()] = bars.get(bar.get_y(), 0.0) + bar.get_width()
    assert list(bars.values()) == pytest.approx([59.0, 59.0])  # the two bars are equally long


@dataclasses.dataclass
class Prompts:
    """What a job's calls read of a `Request`: prompts and their token ids, each under its index."""

    prompts: list
    encoded: list
    indices: list

    def subset(self, chosen: list[int]) -> Prompts:
        return Prompts(*([part[i] for i in chosen] for part in (self.prompts, self.encoded, self.indices)))


class Kept:
    """A job output that keeps its records in memory."""

    def __init__(self) -> None:
        self.records: dict[int, dict] = {}

    def write(self, index: int, record: dict) -> None:
        self.records[index] = record

    def sync(self) -> None:
        pass


def test_a_call_s_wait_for_its_programs_counts_in_its_records_wall_too(monkeypatch):
    monkeypatch.setenv("JAXSR_COMPILE_WORKERS", "1")

    def solve(request: Prompts, write) -> None:
        for index in request.indices:
            write(index, {"samples": [], "stats": {"decode_s": 0.01, "compile_s": 0.0, "wall_s": 0.01}})

    programs = lambda lengths: {"the one shape": lambda: time.sleep(0.3)}  # the first call waits for it
    work = Work(Prompts(list("abcd"), [[1]] * 4, [0, 1, 2, 3]), solve, 2, 4, lambda i, r: r, programs)
    output = Kept()
    _solve_into(output, [0, 1, 2, 3], work, Progress(False))
    seconds = Seconds()
    for record in output.records.values():
        seconds.add(record["stats"])
    assert seconds.parts["compile_s"] >= 0.25
    assert seconds.wall == pytest.approx(0.04 + seconds.parts["compile_s"]) and seconds.outside < 1e-12


def test_the_page_shows_each_prompt_s_chosen_and_worst_response_escaped(output):
    text = write_report(output).read_text()
    assert html.escape(SIX) in text and SIX not in text  # never markup
    entries = re.findall(r"<details>.*?</details>", text, re.S)  # in the output's order: prompts 1, 0, 2
    summaries = [re.search(r"<summary>(.*?)</summary>", e)[1] for e in entries]
    assert summaries == [
        "prompt 1: b — chosen: score 3.0000, cut at max_new_tokens; worst: score 1.0000, ended on its own",
        "prompt 0: a — chosen: score 6.0000, ended on its own; worst: score 2.0000, ended on its own",
        "prompt 2: c — sample 1 of 1: unscored, cut at max_new_tokens",
    ]
    shown = [re.findall(r"<pre>(.*?)</pre>", e, re.S) for e in entries]  # prompt, chosen, worst
    assert shown == [
        ["b", html.escape("three & 'q'"), html.escape("one <b>")],
        ["[user]\na", html.escape(SIX), "two"],
        ["c", "x"],
    ]
    assert "<dt>chosen: score 3.0000, cut at max_new_tokens</dt>" in entries[0]
    assert "every prompt" in text and not (report_directory(output) / "responses").exists()


def test_every_prompt_s_responses_are_paged(tmp_path):
    count = 2 * PAGE + 7
    records = [scored_record(i, [float(i), -1.0]) for i in range(count)]  # chosen: f"p{i} s0"
    report = write_report(write_output(tmp_path / "long.jsonl", records))
    folder = report.parent / "responses"
    names = ["0001.html", "0002.html", "0003.html"]
    assert sorted(p.name for p in folder.iterdir()) == names
    pages = [(folder / name).read_text() for name in names]
    chosen = [re.findall(r"<dt>chosen: [^<]*</dt><dd><pre>(.*?)</pre>", page) for page in pages]
    assert [len(c) for c in chosen] == [PAGE, PAGE, 7]
    assert list(itertools.chain(*chosen)) == [f"p{i} s0" for i in range(count)]  # each once, in order
    text = report.read_text()
    assert len(re.findall("<details>", text)) == SHOWN_PROMPTS and f"the first 20 of {count}" in text
    assert re.findall(r'href="(responses/[^"]+)"', text) == [f"responses/{name}" for name in names]
    assert '"0002.html">next<' in pages[0] and ">previous<" not in pages[0]
    assert '"0002.html">previous<' in pages[2] and ">next<" not in pages[2]
    assert all('href="../report.html"' in page for page in pages)
    # a shorter output reported into the same folder leaves none of the longer one's pages
    write_report(write_output(tmp_path / "long.jsonl", records[: PAGE + 1]))
    assert sorted(p.name for p in folder.iterdir()) == names[:2]


def test_a_running_job_s_torn_last_line_is_left_out(output):
    with output.open("a") as f:
        f.write(json.dumps(RECORDS[0])[:40])  # a record being written
    s = summarize(output)
    assert (s.prompts, s.torn) == (3, True) and "a torn last line" in s.table()
    assert len(re.findall("<details>", write_report(output).read_text())) == 3
    output.write_text(json.dumps(RECORDS[0])[:40])
    with pytest.raises(ValueError, match=re.escape(f"{output}: no records")):
        summarize(output)


def test_a_job_file_that_is_a_fifo_a_device_or_huge_is_refused_naming_it(output):
    job = job_file(output)
    job.unlink()
    os.mkfifo(job)  # no writer: a plain open waits for one forever
    with within(5), pytest.raises(ValueError, match=re.escape(f"{job}: not a regular file")):
        summarize(output)
    job.unlink()
    job.symlink_to("/dev/zero")  # endless: read whole, it fills the memory
    with within(5), pytest.raises(ValueError, match=re.escape(f"{job}: not a regular file")):
        write_report(output)
    assert not report_directory(output).exists()
    job.unlink()
    with job.open("wb") as f:
        f.truncate(JOB_FILE_BYTES + 1)  # sparse
    with within(5), pytest.raises(ValueError, match=re.escape(f"{job}: larger than {JOB_FILE_BYTES} bytes")):
        summarize(output)
    os.truncate(job, JOB_FILE_BYTES)  # read, and no JSON: the header is the records'
    assert summarize(output).header == {"model": "not the job file's", "jaxsr": "0.1.0"}


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


def adds_up(seconds: Seconds) -> bool:
    """Whether each record's parts (compiling ahead of its call included) add up to its wall."""
    return seconds.wall > 0 and seconds.other < 1e-6 and seconds.outside < 1e-6


@pytest.mark.slow
def test_report_of_a_generate_job_shows_no_rewards(outputs):
    page = write_report(outputs["generate"])
    assert plots(page) == {"seconds"}
    s = summarize(outputs["generate"])
    assert (s.prompts, s.samples, s.header["method"]) == (3, 6, "generate")
    assert not s.best_scores and not s.sample_scores and s.sr is None
    assert "reward" not in s.table() and "reward" not in page.read_text()
    assert {"prefill_s", "decode_s", "compile_s"} <= set(s.seconds.parts) and s.seconds.wall > 0
    assert adds_up(s.seconds)
    assert 0 < s.tokens <= 6 * 8


@pytest.mark.slow
def test_report_of_a_best_of_n_job(outputs):
    page = write_report(outputs["best_of_n"])
    assert plots(page) == {"best_of_k", "rewards", "seconds"}
    s = summarize(outputs["best_of_n"])
    assert (s.prompts, s.samples, s.header["n"], s.header["reward"]) == (3, 12, "4", "self_likelihood")
    ((curve, prompts),) = s.best_of_k.curves()
    assert prompts == 3 and adds_up(s.seconds)
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
    assert {"compaction_s", "scoring_s"} <= set(s.seconds.parts) and adds_up(s.seconds)
