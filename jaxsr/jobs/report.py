"""`jaxsr report OUTPUT.jsonl`: what a job produced, read back from its output.

The output is streamed one line at a time (it can hold gigabytes of responses), its complete lines only
(a running or killed job's torn last line is left out, as a resume and `jaxsr export` leave it): each
record leaves only small numbers behind (its scores, counts, seconds; the best-of-k sums and SR's
per-round sizes as running sums), and the first `SHOWN_PROMPTS` records what the page shows of them.
`summarize` returns them as a `Summary` whose `table()` is the text the CLI prints; `write_report` also
draws the plots (PNG) and writes one self-contained HTML page holding the table, the plots and the first
prompts' responses, and, for a longer output, pages of every prompt's responses (a second pass over the
same lines), each file written whole or not at all. A report shows only what the records hold: a
`generate` job's records have no scores, so its report has no reward rows or reward plots.

The best-of-k curve is exact: for each prompt, the expected maximum score of k of its scored samples drawn
without replacement (`expected_max`). Every point of a curve averages the same prompts: one curve over
every scored prompt, up to k = the fewest scored samples a prompt has, and where some prompts have more,
one over those with the most (an average over whichever prompts reach k would jump where few do).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import itertools
import json
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from jaxsr.checks import finite, user_path
from jaxsr.jobs.demo import plural, table
from jaxsr.jobs.records import EXPECTED, read_output, response_tokens
from jaxsr.jobs.runner import JOB_FILE_BYTES, complete_end, job_file, write_durably
from jaxsr.loading.files import read_small

JOB_KEYS = ("method", "model", "draft", "decoder", "reward", "n", "data", "max_new_tokens")
"""Job-file config keys the report's header shows (those set)."""
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
TIMES = ("prefill_s", "decode_s", "scoring_s", "compaction_s", "host_s", "compile_s")
"""The order the time split lists a record's parts in (other `*_s` stats after them): every `*_s` stat
but `wall_s`, the record's whole time, is a part of it."""
SHOWN_SECONDS = 0.005
"""The least a time split shows of the wall no part names, or of the parts outside the wall: less is the
rounding of the parts' sum, and shows as 0.00."""
SHOWN_K = 6
"""Points of a best-of-k curve the text table names (k = 1, 2, 4, … and the last)."""
CURVE_ROWS = ("best of k (mean)", "best of k (most samples)")
"""The table's rows of the best-of-k curves (`BestOfK.curves`), in their order."""
SHOWN_PROMPTS = 20
"""Prompts whose responses the report page shows: the output's first."""
PAGE = 100
"""Prompts on each page of every prompt's responses (written when the report page does not show all)."""
FINISHED = {True: "ended on its own", False: "cut at max_new_tokens", None: "finish not recorded"}
"""How the page says whether a response finished (its `finished`: True, False, absent)."""

T = TypeVar("T")


def max_weights(n: int, most: int | None = None) -> Iterator[np.ndarray]:
    """Row k for k = 1..`most` (default n): C(i-1, k-1)/C(n, k) for i = 1..n, the weight of the i-th
    smallest of n scores in the expected maximum of k of them drawn without replacement (the i-th is the
    maximum of the k-subsets made of it and k-1 of the i-1 below it). Each row is the one before times
    (i-k)(k+1) / (k(n-k)), a ratio of integers exact in float64: O(n) floats a row, each entry within
    about 2k roundings of the exact value (big-integer binomials took O(n³): 1,024 scores 23 s). An
    entry that falls below float64's range is 0: it only falls further in the rows after."""
    if n == 0:
        return
    i = np.arange(1, n + 1, dtype=np.float64)
    row = np.full(n, 1 / n)
    for k in range(1, (n if most is None else min(most, n)) + 1):
        yield row
        if k < n:
            row = row * (np.maximum(i - k, 0) * (k + 1) / (k * (n - k)))


def expected_max(scores: Sequence[float], most: int | None = None) -> np.ndarray:
    """E[max of k samples drawn without replacement from `scores`] for k = 1..`most` (default n): with
    the scores sorted ascending, Σ_i C(i-1, k-1)/C(n, k) · s_i (`max_weights`). Unbiased for best-of-k
    from n ≥ k samples of a prompt; linear in the sorted scores."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64))
    return np.array([row @ ordered for row in max_weights(len(ordered), most)])


@dataclasses.dataclass
class Share:
    """How many of some responses have a property (finished), of how many."""

    hits: int = 0
    total: int = 0

    def add(self, hit: bool) -> None:
        self.hits += hit
        self.total += 1

    def text(self) -> str:
        return f"{self.hits}/{self.total} ({100 * self.hits / self.total:.0f}%)"


@dataclasses.dataclass
class Means:
    """Running means by position (an SR round), over the sequences that reach it."""

    sums: list[float] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)

    def add(self, values: Sequence[float]) -> None:
        grow = len(values) - len(self.sums)
        if grow > 0:
            self.sums += [0.0] * grow
            self.counts += [0] * grow
        for position, value in enumerate(values):
            self.sums[position] += value
            self.counts[position] += 1

    def means(self) -> list[float]:
        return [s / c for s, c in zip(self.sums, self.counts, strict=True)]


@dataclasses.dataclass
class BestOfK:
    """The best-of-k curves' sums. The expected maximum is linear in a prompt's sorted scores, so the
    prompts with the same number of scored samples are summed (their sorted scores, elementwise: a sum
    of ascending vectors is ascending) and each number's curve is computed once, when shown."""

    sorted_sums: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    prompts: Counter[int] = dataclasses.field(default_factory=Counter)
    """Prompts by their number of scored samples."""

    def add(self, scores: Sequence[float]) -> None:
        ordered = np.sort(np.asarray(scores, dtype=np.float64))
        if len(ordered):
            self.sorted_sums[len(ordered)] = self.sorted_sums.get(len(ordered), 0.0) + ordered
            self.prompts[len(ordered)] += 1

    def curve(self, samples: int) -> tuple[np.ndarray, int]:
        """The mean expected best of k for k = 1..`samples` over the prompts with at least `samples`
        scored samples (every point averages those prompts), and how many they are."""
        counts = [n for n in self.prompts if n >= samples]
        total = sum(expected_max(self.sorted_sums[n], samples) for n in counts)
        prompts = sum(self.prompts[n] for n in counts)
        return total / prompts, prompts

    def curves(self) -> list[tuple[np.ndarray, int]]:
        """The curve of every scored prompt (k up to the fewest scored samples a prompt has) and, when
        some have more, that of the prompts with the most (k up to all of theirs)."""
        return [self.curve(samples) for samples in sorted({min(self.prompts), max(self.prompts)})]


@dataclasses.dataclass
class Seconds:
    """The records' time, summed: each part (every `*_s` stat but `wall_s`) and the wall, and per record
    what makes the two add up: the wall no part names (`other`) and the parts beyond the wall
    (`outside`: outputs written before a call's wait for its programs compiled ahead counted in its
    records' `wall_s` hold that wait in their `compile_s` alone). wall + outside = parts + other."""

    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    wall: float = 0.0
    other: float = 0.0
    outside: float = 0.0

    def add(self, stats: dict[str, Any]) -> None:
        timed = {k: v for k, v in stats.items() if k.endswith("_s") and finite(v) is not None}
        wall = timed.pop("wall_s", 0.0)
        for key, value in timed.items():
            self.parts[key] = self.parts.get(key, 0.0) + value
        self.wall += wall
        gap = wall - sum(timed.values())
        self.other += max(gap, 0.0)
        self.outside += max(-gap, 0.0)

    def sides(self) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
        """The sum's two sides as (name, seconds): the wall (and the parts outside it), the parts in the
        `TIMES` order (and the wall no part names); those two only where they show."""
        order = sorted(self.parts, key=lambda k: (TIMES.index(k) if k in TIMES else len(TIMES), k))
        wall = [("wall", self.wall)]
        if self.outside >= SHOWN_SECONDS:
            wall.append(("outside the wall", self.outside))
        parts = [(key[:-2], self.parts[key]) for key in order]
        if self.other >= SHOWN_SECONDS:
            parts.append(("other", self.other))
        return wall, parts

    def text(self) -> str:
        """`wall 3.50 = prefill 0.75 + decode 2.00 + other 0.75`."""
        wall, parts = (" + ".join(f"{name} {v:.2f}" for name, v in side) for side in self.sides())
        return f"{wall} = {parts}"


@dataclasses.dataclass
class Rounds:
    """Speculative Rejection's decisions over the prompts: rounds, first batches, rows per round, and the
    partial responses it stopped (when records list them under `rejected`)."""

    rounds: Counter[int] = dataclasses.field(default_factory=Counter)
    first_batch: Counter[int] = dataclasses.field(default_factory=Counter)
    batch_sizes: Means = dataclasses.field(default_factory=Means)
    live_rows: Means = dataclasses.field(default_factory=Means)
    rejected: Share = dataclasses.field(default_factory=Share)
    """Stopped partial responses (`total`, over the records that have a `rejected` list) and those of them
    stopped because the memory could not hold them (`hits`: `forced`)."""
    rejected_prompts: int = 0

    def add(self, record: dict[str, Any]) -> None:
        stats = record["stats"]
        sizes = _numbers(stats["batch_sizes"])
        self.rounds[int(stats["rounds"])] += 1
        if sizes:
            self.first_batch[int(sizes[0])] += 1
        self.batch_sizes.add(sizes)
        log = stats.get("round_log")
        if isinstance(log, list):
            self.live_rows.add(_numbers(r.get("live_rows") for r in log if isinstance(r, dict)))
        if isinstance(record.get("rejected"), list):
            self.rejected_prompts += 1
            for stopped in record["rejected"]:
                self.rejected.add(isinstance(stopped, dict) and stopped.get("forced") is True)

    def rows(self) -> list[tuple[str, str]]:
        total = self.rounds.total()
        mean_rounds = sum(r * c for r, c in self.rounds.items()) / total
        rows = [
            (
                "SR rounds per prompt",
                f"mean {mean_rounds:.2f} (min {min(self.rounds)}, max {max(self.rounds)})",
            ),
            ("SR first batch", _counted(self.first_batch, "prompt")),
            ("SR rows per round", _listed(self.batch_sizes.means())),
        ]
        if self.live_rows.counts:
            rows.append(("SR live rows per round", _listed(self.live_rows.means())))
        if self.rejected_prompts:
            count, per_prompt = self.rejected.total, self.rejected.total / self.rejected_prompts
            forced = f"{self.rejected.hits} forced by the memory"
            rows.append(("SR rejected", f"{count} ({per_prompt:.2f} per prompt; {forced})"))
        return rows


@dataclasses.dataclass(frozen=True)
class Entry:
    """What the pages show of one prompt: its index, its prompt, and its responses by role: the chosen
    one and the lowest-scored sample (a record without a best: its first sample), each as its `text`,
    `score` and `finished`."""

    index: int
    prompt: Any
    responses: tuple[tuple[str, dict[str, Any]], ...]


def entry_of(record: dict[str, Any]) -> Entry:
    """A record's `Entry` (the worst only where two samples or more are scored: else it is the chosen)."""
    samples, best = record["samples"], record.get("best")
    scored = [s for s in samples if finite(s.get("score")) is not None]
    if best is not None:
        shown = [("chosen", best)]
        if len(scored) > 1:
            shown.append(("worst", min(scored, key=lambda s: s["score"])))
    else:
        shown = [(f"sample 1 of {len(samples)}", samples[0])] if samples else []
    kept = tuple((role, {k: s.get(k) for k in ("text", "score", "finished")}) for role, s in shown)
    return Entry(record["index"], record["prompt"], kept)


@dataclasses.dataclass
class Summary:
    """The small numbers a job's output leaves, and its first prompts' entries: what the report shows."""

    output: Path
    header: dict[str, str]
    """Job, method, model, reward, … (from the job file, then each record's provenance)."""
    end: int = 0
    """The size of the output's complete lines: what was read (and what the response pages read)."""
    torn: bool = False
    """Whether a torn last line (a job still writing it, or killed) was left out."""
    prompts: int = 0
    samples: int = 0
    best_scores: array = dataclasses.field(default_factory=lambda: array("d"))
    sample_scores: array = dataclasses.field(default_factory=lambda: array("d"))
    best_finished: Share = dataclasses.field(default_factory=Share)
    sample_finished: Share = dataclasses.field(default_factory=Share)
    tokens: int = 0
    """Response tokens, over the samples that list their `token_ids` or `num_tokens` (`token_samples`)."""
    token_samples: int = 0
    best_of_k: BestOfK = dataclasses.field(default_factory=BestOfK)
    seconds: Seconds = dataclasses.field(default_factory=Seconds)
    sr: Rounds | None = None
    shown: list[Entry] = dataclasses.field(default_factory=list)
    """The first `SHOWN_PROMPTS` records' entries, in the output's order."""

    def add(self, record: dict[str, Any]) -> None:
        """Count one record in."""
        self.prompts += 1
        for key, value in record.get("provenance", {}).items():
            if value is not None and key not in SAMPLING_KEYS:  # sampling: one row of its own
                self.header.setdefault(key, _text(value))
        best = record.get("best")
        if best is not None:
            self._add_best(best)
        scored = _numbers(s.get("score") for s in record["samples"])
        self.sample_scores.extend(scored)
        self.best_of_k.add(scored)
        for sample in record["samples"]:
            self._add_sample(sample)
        self._add_stats(record)
        if len(self.shown) < SHOWN_PROMPTS:
            self.shown.append(entry_of(record))

    def _add_best(self, best: dict[str, Any]) -> None:
        if finite(best.get("score")) is not None:
            self.best_scores.append(best["score"])
        if isinstance(best.get("finished"), bool):
            self.best_finished.add(best["finished"])

    def _add_sample(self, sample: dict[str, Any]) -> None:
        self.samples += 1
        if isinstance(sample.get("finished"), bool):
            self.sample_finished.add(sample["finished"])
        tokens = response_tokens(sample)
        if tokens is not None:
            self.tokens += tokens
            self.token_samples += 1

    def _add_stats(self, record: dict[str, Any]) -> None:
        stats = record.get("stats", {})
        self.seconds.add(stats)
        if isinstance(stats.get("batch_sizes"), list) and finite(stats.get("rounds")) is not None:
            self.sr = self.sr or Rounds()
            self.sr.add(record)

    def rows(self) -> list[tuple[str, str]]:
        """(quantity, value) of everything the records hold, in the report's order."""
        rows = [*self.header.items(), ("prompts", str(self.prompts))]
        if self.torn:
            rows.append(("left out", "a torn last line (a job still writing it, or killed)"))
        rows.append(("samples per prompt", f"{self.samples / self.prompts:.2f}"))
        for name, share in (
            ("finished (best)", self.best_finished),
            ("finished (samples)", self.sample_finished),
        ):
            if share.total:
                rows.append((name, share.text()))
        for name, scores in (("best reward", self.best_scores), ("sample reward", self.sample_scores)):
            if scores:
                rows.append((name, f"mean {np.mean(scores):.4f}, median {np.median(scores):.4f}"))
        if self.best_of_k.prompts:
            for name, (curve, prompts) in zip(CURVE_ROWS, self.best_of_k.curves(), strict=False):
                rows.append((name, f"{_curve_text(curve)} ({_curve_prompts(len(curve), prompts)})"))
        if self.token_samples:
            mean = self.tokens / self.token_samples
            rows.append(("response tokens", f"mean {mean:.1f}, total {self.tokens}"))
        if self.seconds.parts or self.seconds.wall:
            rows.append(("seconds (summed)", self.seconds.text()))
        return rows + (self.sr.rows() if self.sr else [])

    def table(self) -> str:
        """The summary as the text table the CLI prints."""
        return table(["jaxsr report", str(self.output)], [list(row) for row in self.rows()], left=(0, 1))


def summarize(output: str | Path) -> Summary:
    """Read a job's output (and its job file, when there) into a `Summary`, one line at a time.
    Raises ValueError naming the file (and line) when it is missing, empty or not a jaxsr output, or
    when its job file is no regular file of at most `JOB_FILE_BYTES`."""
    path = user_path("output", output)
    if not path.exists():
        raise ValueError(f"{path}: no such file (expected a jaxsr job output, a .jsonl file)")
    if not path.is_file():
        raise ValueError(f"{path}: not a file (expected a jaxsr job output, a .jsonl file)")
    summary = Summary(path, _job_header(job_file(path)))
    try:
        summary.end = complete_end(path)
        summary.torn = summary.end < path.stat().st_size
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    for record in _records(path, summary.end):
        summary.add(record)
    if not summary.prompts:
        raise ValueError(f"{path}: no records (expected {EXPECTED})")
    return summary


def _records(path: Path, end: int) -> Iterator[dict[str, Any]]:
    """The output's records up to byte `end`, each checked, read one line at a time."""
    try:
        for _, record in read_output(path, end):
            yield record
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def _job_header(path: Path) -> dict[str, str]:
    """The job file's fingerprint and the config keys the header shows ({} without a readable one)."""
    try:
        text = read_small(path, JOB_FILE_BYTES)  # a FIFO or device there is refused
    except OSError:
        return {}
    try:
        job = json.loads(text)
        config = job["config"]
        fingerprint = job["jaxsr_job"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return {}
    if not isinstance(config, dict):
        return {}
    header = {"job": str(fingerprint)}
    header.update({key: _text(config[key]) for key in JOB_KEYS if config.get(key) is not None})
    sampling = {key: config[key] for key in SAMPLING_KEYS if key in config}
    if sampling:
        header["sampling"] = _text(sampling)
    if config.get("seed") is not None:
        header["seed"] = _text(config["seed"])
    return header


def _numbers(values: Iterable[Any]) -> list[float]:
    """The finite numbers among `values`."""
    return [v for v in values if finite(v) is not None]


def _text(value: Any) -> str:
    """A header value on one line: a mapping as `key value, …`."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    return str(value)


def _counted(counts: Counter[Any], noun: str) -> str:
    """`8 (3 prompts), 6 (1 prompt)`: each value with how many have it, the commonest first."""
    return ", ".join(f"{value} ({plural(count, noun)})" for value, count in counts.most_common())


def _listed(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" if v == int(v) else f"{v:.2f}" for v in values)


def _curve_text(curve: Sequence[float]) -> str:
    """A few points of a best-of-k curve: k = 1, 2, 4, … and the largest k."""
    ks = sorted({min(2**j, len(curve)) for j in range(SHOWN_K)} | {len(curve)})
    return ", ".join(f"k={k} {curve[k - 1]:.4f}" for k in ks)


def _curve_prompts(samples: int, prompts: int) -> str:
    """Which prompts every point of a best-of-k curve averages: `2 prompts with ≥ 3 scored samples`."""
    return f"{plural(prompts, 'prompt')} with ≥ {plural(samples, 'scored sample')}"


# -- plots ---------------------------------------------------------------------------------------------


def _plot_best_of_k(ax: Axes, s: Summary) -> None:
    for curve, prompts in s.best_of_k.curves():
        ax.plot(range(1, len(curve) + 1), curve, "o-", label=_curve_prompts(len(curve), prompts))
    if s.best_scores:
        ax.axhline(np.mean(s.best_scores), color="C3", linestyle="--", label="the job's best (mean)")
    ax.set_xlabel("k (samples drawn from each prompt's scored samples)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("expected best reward of k (mean over the prompts)")
    ax.set_title("best-of-k reward: each curve averages the same prompts at every k", fontsize=9)
    ax.legend()


def _plot_rewards(ax: Axes, s: Summary) -> None:
    kinds = [
        (name, np.asarray(v)) for name, v in (("best", s.best_scores), ("samples", s.sample_scores)) if v
    ]
    bins = np.histogram_bin_edges(np.concatenate([v for _, v in kinds]), bins=30)
    for name, values in kinds:
        ax.hist(values, bins=bins, density=True, alpha=0.55, label=f"{name} ({len(values)})")
    ax.set_xlabel("reward")
    ax.set_ylabel("density")
    ax.set_title("reward of the best responses and of all samples", fontsize=9)
    ax.legend()


def _plot_rounds(ax: Axes, s: Summary) -> None:
    sr = s.sr
    assert sr is not None
    for name, means in (("rows decoded", sr.batch_sizes), ("live rows", sr.live_rows)):
        if means.counts:
            ax.plot(range(1, len(means.sums) + 1), means.means(), "o-", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("rows (mean over the prompts that reach the round)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Speculative Rejection: batch size per round", fontsize=9)
    ax.legend()


SPLIT_STYLE = {
    "wall": {"color": "C7"},
    "outside the wall": {"color": "C3", "hatch": "//"},
    "other": {"color": "0.85"},
}
"""How the time split draws the wall, the parts outside it and the wall no part names (the parts: C0…)."""


def _plot_seconds(ax: Axes, s: Summary) -> None:
    parts = itertools.cycle(f"C{i}" for i in (0, 1, 2, 4, 5, 6, 8, 9))
    for y, side in enumerate(s.seconds.sides()):
        left = 0.0
        for name, seconds in side:
            style = SPLIT_STYLE.get(name) or {"color": next(parts)}
            ax.barh(y, seconds, height=0.6, left=left, label=name, edgecolor="white", **style)
            left += seconds
    ax.set_yticks([0, 1], ["wall", "its parts"])
    ax.set_ylim(2.5, -0.5)  # top down, with room below the bars for the legend
    ax.set_xlabel("seconds, summed over the records")
    ax.set_title("where the time went: the wall and its parts add up", fontsize=9)
    ax.legend(fontsize=8, ncols=3, loc="lower center")


PLOTS: dict[str, tuple[str, Callable[[Summary], bool], Callable[[Axes, Summary], None]]] = {
    "best_of_k": (
        "Best-of-k reward curve (every point of a curve averages the same prompts)",
        lambda s: bool(s.best_of_k.prompts),
        _plot_best_of_k,
    ),
    "rewards": ("Reward histogram", lambda s: bool(s.best_scores or s.sample_scores), _plot_rewards),
    "sr_rounds": ("Speculative Rejection rounds", lambda s: s.sr is not None, _plot_rounds),
    "seconds": (
        "Time split: each record's wall is the sum of its parts, compile included (older outputs left a "
        "wait for compiles out of the wall: it is shown beside it)",
        lambda s: bool(s.seconds.parts or s.seconds.wall),
        _plot_seconds,
    ),
}
"""Each plot: its caption, whether the summary has its data, and how it is drawn."""


def render(draw: Callable[[Axes, Summary], None], summary: Summary) -> bytes:
    """One plot of the summary as PNG bytes (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    try:
        draw(ax, summary)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=120)
    finally:
        plt.close(fig)
    return png.getvalue()


# -- the pages -----------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 960px; color: #222; }
h1 { font-size: 1.4em; } h1 code { font-size: 0.8em; color: #555; } h2 { font-size: 1.15em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { text-align: left; padding: 0.25em 0.9em; border-bottom: 1px solid #ddd; vertical-align: top; }
th { background: #f3f3f3; white-space: nowrap; }
figure { display: inline-block; width: 47%; margin: 0 1.5% 1.5em 0; vertical-align: top; }
img { width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #444; }
details { border-bottom: 1px solid #ddd; padding: 0.35em 0; }
summary { cursor: pointer; }
dt { font-weight: 600; font-size: 0.9em; margin-top: 0.5em; }
dd { margin: 0; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f7f7f7; padding: 0.5em; margin: 0.2em 0; }
nav { margin: 1em 0; line-height: 1.8; } nav a { margin-right: 0.5em; }
"""


def _document(title: str, body: str) -> str:
    """A self-contained HTML page: nothing is fetched or run."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head>\n<body>{body}</body></html>\n"
    )


def page(summary: Summary, plots: dict[str, bytes]) -> str:
    """The report as one HTML page: the summary table, the plots inlined as data URIs, and the first
    prompts' responses (with links to the pages of them all, where those are written)."""
    cells = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary.rows()
    )
    figures = "\n".join(
        f'<figure><img alt="{html.escape(PLOTS[name][0])}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(PLOTS[name][0])}</figcaption></figure>"
        for name, png in plots.items()
    )
    shown = len(summary.shown)
    which = "every prompt" if shown == summary.prompts else f"the first {shown} of {summary.prompts} prompts"
    pages = page_count(summary)
    every = (
        f"<nav>All {summary.prompts} prompts, {PAGE} a page: "
        + " ".join(f'<a href="{_page_name(n, "responses/")}">{n}</a>' for n in range(1, pages + 1))
        + "</nav>"
        if pages
        else ""
    )
    body = (
        f"<h1>jaxsr report <code>{html.escape(str(summary.output))}</code></h1>\n<table>\n{cells}\n"
        f"</table>\n{figures}\n<h2>Responses</h2>\n<p>{html.escape(_responses_intro(which))}</p>\n"
        + "\n".join(_details(entry) for entry in summary.shown)
        + f"\n{every}\n"
    )
    return _document(f"jaxsr report: {summary.output.name}", body)


def _responses_intro(which: str) -> str:
    return (
        f"Responses of {which}, in the output's order (the order they finished): the prompt, the chosen "
        "response and the lowest-scored sample, each with its score and whether it ended on its own or "
        "was cut at max_new_tokens."
    )


def _details(entry: Entry) -> str:
    """One prompt as a <details> element: a line naming it and its responses' scores, opening onto the
    prompt and the responses (every text escaped)."""
    items = "".join(
        f"<dt>{html.escape(_about(role, sample))}</dt><dd><pre>{html.escape(sample['text'])}</pre></dd>"
        for role, sample in entry.responses
    )
    line = "; ".join(_about(role, sample) for role, sample in entry.responses) or "no response"
    opening = _shortened(_last_turn(entry.prompt))
    return (
        f"<details><summary>{html.escape(f'prompt {entry.index}: {opening} — {line}')}</summary>"
        f"<dl><dt>prompt</dt><dd><pre>{html.escape(_prompt_text(entry.prompt))}</pre></dd>{items}</dl></details>"
    )


def _about(role: str, sample: dict[str, Any]) -> str:
    """`chosen: score 0.7071, ended on its own`."""
    score = "unscored" if finite(sample["score"]) is None else f"score {sample['score']:.4f}"
    finished = sample["finished"] if isinstance(sample["finished"], bool) else None
    return f"{role}: {score}, {FINISHED[finished]}"


def _is_conversation(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
    )


def _prompt_text(prompt: Any) -> str:
    """A prompt as the page shows it: a text as it is, a conversation a turn at a time, else JSON."""
    if isinstance(prompt, str):
        return prompt
    if _is_conversation(prompt):
        return "\n\n".join(f"[{m.get('role', '?')}]\n{m['content']}" for m in prompt)
    return json.dumps(prompt, ensure_ascii=False, indent=1)


def _last_turn(prompt: Any) -> str:
    """What a prompt's summary line opens with: a conversation's last turn, else the prompt's text."""
    return prompt[-1]["content"] if _is_conversation(prompt) else _prompt_text(prompt)


def _shortened(text: str, width: int = 80) -> str:
    """`text` on one line, cut to `width` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def page_count(summary: Summary) -> int:
    """How many pages of every prompt's responses the report has: none when its page shows them all."""
    return 0 if summary.prompts <= len(summary.shown) else math.ceil(summary.prompts / PAGE)


def _page_name(number: int, folder: str = "") -> str:
    return f"{folder}{number:04d}.html"


def _responses_page(summary: Summary, number: int, entries: list[Entry]) -> str:
    """Page `number` of every prompt's responses: its entries between links to the report and to the
    pages before and after it."""
    pages, first = page_count(summary), (number - 1) * PAGE + 1
    links = ['<a href="../report.html">report</a>', f"page {number} of {pages}"]
    if number > 1:
        links.append(f'<a href="{_page_name(number - 1)}">previous</a>')
    if number < pages:
        links.append(f'<a href="{_page_name(number + 1)}">next</a>')
    nav = f"<nav>{' · '.join(links)}</nav>"
    which = f"prompts {first}–{first + len(entries) - 1} of {summary.prompts}"
    body = (
        f"<h1>jaxsr report <code>{html.escape(str(summary.output))}</code></h1>\n{nav}\n"
        f"<p>{html.escape(_responses_intro(which))}</p>\n"
        + "\n".join(_details(entry) for entry in entries)
        + f"\n{nav}\n"
    )
    return _document(f"jaxsr report: {summary.output.name}, responses page {number}", body)


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """`items` in lists of `size` (the last may be shorter)."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_pages(summary: Summary, folder: Path) -> None:
    """Every prompt's responses, `PAGE` to a page (`responses/0001.html`, …), read again from the output
    up to the summary's `end`, where the report page does not show them all; removes the pages of an
    earlier report there that this one has not."""
    pages = folder / "responses"
    written = set()
    if page_count(summary):
        pages.mkdir(exist_ok=True)
        entries = (entry_of(record) for record in _records(summary.output, summary.end))
        for number, batch in enumerate(_batched(entries, PAGE), 1):
            written.add(_page_name(number))
            write_durably(pages / _page_name(number), [_responses_page(summary, number, batch).encode()])
    for stale in pages.glob("[0-9]*.html") if pages.is_dir() else []:
        if stale.name not in written:
            stale.unlink()


def report_directory(output: Path) -> Path:
    """Where a report goes by default: beside the output, `out/x.jsonl` -> `out/x.report/`."""
    return output.with_name(f"{output.stem}.report")


def write_report(output: str | Path, directory: str | Path | None = None) -> Path:
    """Summarize a job's output and write its plots (`<name>.png`), `report.html` (the table, the plots
    and the first prompts' responses in one self-contained page) and, for a longer output, the pages of
    every prompt's responses (`responses/`) into `directory` (default: `report_directory(output)`);
    returns the page's path. Each file is written to a temporary name and renamed: none is left
    half-written."""
    chosen = None if directory is None else user_path("directory", directory)
    summary = summarize(output)
    folder = chosen or report_directory(summary.output)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        plots = {name: render(draw, summary) for name, (_, has, draw) in PLOTS.items() if has(summary)}
        for name, png in plots.items():
            write_durably(folder / f"{name}.png", [png])
        _write_pages(summary, folder)
        write_durably(folder / "report.html", [page(summary, plots).encode()])
    except OSError as e:
        raise ValueError(f"{folder}: cannot write the report there ({e.strerror or e})") from None
    return folder / "report.html"
