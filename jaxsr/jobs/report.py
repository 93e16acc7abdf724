"""`jaxsr report OUTPUT.jsonl`: what a job produced, read back from its output.

The output is streamed one line at a time (it can hold gigabytes of responses): each record leaves only
small numbers behind (its scores, counts, seconds; the best-of-k curve and SR's per-round sizes as running
sums). `summarize` returns them as a `Summary` whose `table()` is the text the CLI prints; `write_report`
also draws the plots (PNG) and writes one self-contained HTML page holding the table and the plots, each
file written whole or not at all. A report shows only what the records hold: a `generate` job's records
have no scores, so its report has no reward rows or reward plots.

The best-of-k curve is exact: for each prompt, the expected maximum score of k of its scored samples drawn
without replacement (`expected_max`), averaged over the prompts with at least k scored samples.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import html
import io
import json
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from jaxsr.checks import finite
from jaxsr.jobs.demo import plural, table
from jaxsr.jobs.records import EXPECTED, read_output
from jaxsr.jobs.runner import job_file, write_durably

"""What an output line must be, as error messages say it."""
JOB_KEYS = ("method", "model", "draft", "decoder", "reward", "n", "data", "max_new_tokens")
"""Job-file config keys the report's header shows (those set)."""
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
TIMES = ("prefill_s", "decode_s", "scoring_s", "compaction_s", "host_s", "compile_s", "wall_s")
"""The order the time split lists the `*_s` stats in (others after them): `wall_s` is a record's whole
time, every other one a part of it."""
SHOWN_K = 6
"""Points of the best-of-k curve the text table names (k = 1, 2, 4, … and n)."""


def expected_max(scores: Sequence[float]) -> np.ndarray:
    """E[max of k samples drawn without replacement from `scores`] for k = 1..n: with the scores sorted
    ascending s_1..s_n, Σ_i C(i-1, k-1)/C(n, k) · s_i (the i-th smallest is the maximum of the k-subsets
    made of it and k-1 of the i-1 below it). Unbiased for best-of-k from n ≥ k samples of a prompt."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64))
    return _max_weights(len(ordered)) @ ordered


@functools.lru_cache(maxsize=8)
def _max_weights(n: int) -> np.ndarray:
    """The n×n matrix of C(i-1, k-1)/C(n, k) (row k-1, column i-1), each entry rounded once from exact
    integers: prompts mostly share one sample count, so it is built once."""
    weights = np.array(
        [[math.comb(i - 1, k - 1) / math.comb(n, k) for i in range(1, n + 1)] for k in range(1, n + 1)]
    ).reshape(n, n)
    weights.setflags(write=False)  # shared by every caller through the cache
    return weights


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
    """Running means by position (k of a best-of-k curve, an SR round), over the sequences that reach it."""

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


@dataclasses.dataclass
class Summary:
    """The small numbers a job's output leaves: what the report shows."""

    output: Path
    header: dict[str, str]
    """Job, method, model, reward, … (from the job file, then each record's provenance)."""
    prompts: int = 0
    samples: int = 0
    best_scores: array = dataclasses.field(default_factory=lambda: array("d"))
    sample_scores: array = dataclasses.field(default_factory=lambda: array("d"))
    best_finished: Share = dataclasses.field(default_factory=Share)
    sample_finished: Share = dataclasses.field(default_factory=Share)
    tokens: int = 0
    """Response tokens, over the samples that list their `token_ids` (`token_samples`)."""
    token_samples: int = 0
    best_of_k: Means = dataclasses.field(default_factory=Means)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each `*_s` stat summed over the records."""
    sr: Rounds | None = None

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
        if scored:
            self.best_of_k.add(expected_max(scored))
        for sample in record["samples"]:
            self._add_sample(sample)
        self._add_stats(record)

    def _add_best(self, best: dict[str, Any]) -> None:
        if finite(best.get("score")) is not None:
            self.best_scores.append(best["score"])
        if isinstance(best.get("finished"), bool):
            self.best_finished.add(best["finished"])

    def _add_sample(self, sample: dict[str, Any]) -> None:
        self.samples += 1
        if isinstance(sample.get("finished"), bool):
            self.sample_finished.add(sample["finished"])
        if isinstance(sample.get("token_ids"), list):
            self.tokens += len(sample["token_ids"])
            self.token_samples += 1

    def _add_stats(self, record: dict[str, Any]) -> None:
        stats = record.get("stats", {})
        for key, value in stats.items():
            if key.endswith("_s") and finite(value) is not None:
                self.seconds[key] = self.seconds.get(key, 0.0) + value
        if isinstance(stats.get("batch_sizes"), list) and finite(stats.get("rounds")) is not None:
            self.sr = self.sr or Rounds()
            self.sr.add(record)

    def rows(self) -> list[tuple[str, str]]:
        """(quantity, value) of everything the records hold, in the report's order."""
        rows = [*self.header.items(), ("prompts", str(self.prompts))]
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
        if self.best_of_k.counts:
            rows.append(("best of k (mean)", _curve_text(self.best_of_k.means())))
        if self.token_samples:
            mean = self.tokens / self.token_samples
            rows.append(("response tokens", f"mean {mean:.1f}, total {self.tokens}"))
        if self.seconds:
            split = ", ".join(f"{key[:-2]} {self.seconds[key]:.2f}" for key in self.times())
            rows.append(("seconds (summed)", split))
        return rows + (self.sr.rows() if self.sr else [])

    def times(self) -> list[str]:
        """The `*_s` stats the records have, in the `TIMES` order (others after them, by name)."""
        return sorted(self.seconds, key=lambda key: (TIMES.index(key) if key in TIMES else len(TIMES), key))

    def table(self) -> str:
        """The summary as the text table the CLI prints."""
        return table(["jaxsr report", str(self.output)], [list(row) for row in self.rows()], left=(0, 1))


def summarize(output: str | Path) -> Summary:
    """Read a job's output (and its job file, when there) into a `Summary`, one line at a time.
    Raises ValueError naming the file (and line) when it is missing, empty or not a jaxsr output."""
    path = Path(output)
    if not path.exists():
        raise ValueError(f"{path}: no such file (expected a jaxsr job output, a .jsonl file)")
    if not path.is_file():
        raise ValueError(f"{path}: not a file (expected a jaxsr job output, a .jsonl file)")
    summary = Summary(path, _job_header(job_file(path)))
    for record in _records(path):
        summary.add(record)
    if not summary.prompts:
        raise ValueError(f"{path}: no records (expected {EXPECTED})")
    return summary


def _records(path: Path) -> Iterator[dict[str, Any]]:
    """The output's records, each checked, read one line at a time."""
    try:
        for _, record in read_output(path):
            yield record
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def _job_header(path: Path) -> dict[str, str]:
    """The job file's fingerprint and the config keys the header shows ({} without a readable one)."""
    try:
        job = json.loads(path.read_text())
        config = job["config"]
        fingerprint = job["jaxsr_job"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
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
    """A few points of the best-of-k curve: k = 1, 2, 4, … and the largest k."""
    ks = sorted({min(2**j, len(curve)) for j in range(SHOWN_K)} | {len(curve)})
    return ", ".join(f"k={k} {curve[k - 1]:.4f}" for k in ks)


# -- plots and the page ------------------------------------------------------------------------------


def _plot_best_of_k(ax: Axes, s: Summary) -> None:
    curve = s.best_of_k.means()
    ks = range(1, len(curve) + 1)
    ax.plot(ks, curve, "o-", label="expected best of k samples")
    if s.best_scores:
        ax.axhline(np.mean(s.best_scores), color="C1", linestyle="--", label="the job's best (mean)")
    ax.set_xlabel("k (samples drawn from each prompt's scored samples)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("reward (mean over prompts)")
    ax.set_title(f"best-of-k reward, {plural(s.best_of_k.counts[0], 'prompt')} (k=1)", fontsize=9)
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
    ax.set_ylabel("rows (mean over prompts)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Speculative Rejection: batch size per round", fontsize=9)
    ax.legend()


def _plot_seconds(ax: Axes, s: Summary) -> None:
    names = s.times()
    colors = ["C7" if k == "wall_s" else "C0" for k in names]
    ax.barh([k[:-2] for k in names], [s.seconds[k] for k in names], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("seconds, summed over the records")
    ax.set_title("where the time went (wall: the whole; the rest its parts)", fontsize=9)


PLOTS: dict[str, tuple[str, Callable[[Summary], bool], Callable[[Axes, Summary], None]]] = {
    "best_of_k": ("Best-of-k reward curve", lambda s: bool(s.best_of_k.counts), _plot_best_of_k),
    "rewards": ("Reward histogram", lambda s: bool(s.best_scores or s.sample_scores), _plot_rewards),
    "sr_rounds": ("Speculative Rejection rounds", lambda s: s.sr is not None, _plot_rounds),
    "seconds": ("Time split", lambda s: bool(s.seconds), _plot_seconds),
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


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 960px; color: #222; }
h1 { font-size: 1.4em; } h1 code { font-size: 0.8em; color: #555; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { text-align: left; padding: 0.25em 0.9em; border-bottom: 1px solid #ddd; vertical-align: top; }
th { background: #f3f3f3; white-space: nowrap; }
figure { display: inline-block; width: 47%; margin: 0 1.5% 1.5em 0; vertical-align: top; }
img { width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #444; }
"""


def page(summary: Summary, plots: dict[str, bytes]) -> str:
    """The report as one HTML page: the summary table and the plots inlined as data URIs."""
    cells = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary.rows()
    )
    figures = "\n".join(
        f'<figure><img alt="{html.escape(PLOTS[name][0])}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(PLOTS[name][0])}</figcaption></figure>"
        for name, png in plots.items()
    )
    title = f"jaxsr report: {summary.output.name}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head>\n<body><h1>jaxsr report <code>{html.escape(str(summary.output))}</code>"
        f"</h1>\n<table>\n{cells}\n</table>\n{figures}\n</body></html>\n"
    )


def report_directory(output: Path) -> Path:
    """Where a report goes by default: beside the output, `out/x.jsonl` -> `out/x.report/`."""
    return output.with_name(f"{output.stem}.report")


def write_report(output: str | Path, directory: str | Path | None = None) -> Path:
    """Summarize a job's output and write its plots (`<name>.png`) and `report.html` (the table and the
    plots in one self-contained page) into `directory` (default: `report_directory(output)`); returns
    the page's path. Each file is written to a temporary name and renamed: none is left half-written."""
    summary = summarize(output)
    folder = Path(directory) if directory is not None else report_directory(summary.output)
    plots = {name: render(draw, summary) for name, (_, has, draw) in PLOTS.items() if has(summary)}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, png in plots.items():
            write_durably(folder / f"{name}.png", [png])
        write_durably(folder / "report.html", [page(summary, plots).encode()])
    except OSError as e:
        raise ValueError(f"{folder}: cannot write the report there ({e.strerror or e})") from None
    return folder / "report.html"
