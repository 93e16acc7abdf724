"""`jaxsr demo`: what jaxsr does, measured in a few minutes on a CPU with the embedded models.

1. Best-of-N and Speculative Rejection side by side on a few AlpacaFarm prompts (SmolLM2-135M-Instruct
   generating, all-MiniLM-L6-v2 prompt/response relevance as the reward), every method at Best-of-8's
   KV memory. Wall times leave out the time JAX spent compiling (a shape compiles on its first use), as
   `jax.monitoring` reports it.
2. Speculative contrastive decoding against contrastive decoding (expert SmolLM2, amateur the shipped
   `smollm2-draft`) on the same prompts: acceptance, tokens per expert call and decoding speed (jaxsr
   times compilation apart, `stats["compile_s"]`; speeds use `stats["decode_s"]`).

It writes one JSONL record per (method, prompt) and a plot of mean best reward against generator
token-forwards. Every number printed is measured in the run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxsr.checks import check_positive_int, check_seed
from jaxsr.data import read_prompts
from jaxsr.decoding.api import contrastive_decode, speculative_contrastive_decode
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.loading.resolve import resolve_model, resolve_reward
from jaxsr.models.model import Model
from jaxsr.results import Result
from jaxsr.rewards.base import Reward
from jaxsr.search.best_of_n import best_of_n
from jaxsr.search.speculative_rejection import check_rejection_rate, speculative_rejection
from jaxsr.timing import compiling

DATA = "alpaca_farm_100"
PROMPT_BUCKET = 64  # every demo prompt's chat-templated length lies in this bucket: one prompt shape
BASE_N = 8  # the memory budget is Best-of-8's
SAMPLING = SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)
GENERATOR = "SmolLM2-135M-Instruct"
REWARD = "all-MiniLM-L6-v2 prompt/response relevance"
AMATEUR = "smollm2-draft"
OPENING = 60  # characters of an answer shown in the table


@dataclasses.dataclass(frozen=True)
class Demo:
    """The demo's settings, checked: prompts, answer length, Best-of-N sizes, SR's α, SCD's γ, seed."""

    prompts: int
    max_new_tokens: int
    ns: list[int]
    rejection_rate: float
    gamma: int
    seed: int

    @classmethod
    def checked(
        cls,
        prompts: int,
        max_new_tokens: int,
        ns: Sequence[int],
        rejection_rate: float,
        gamma: int,
        seed: int,
    ) -> Demo:
        """The settings, or a ValueError naming the first bad one (before any model loads)."""
        count = check_positive_int("prompts", prompts)
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        sizes = sorted({check_positive_int("n", n) for n in ns})
        if not sizes:
            raise ValueError("n: give at least one Best-of-N size")
        gamma, seed = check_positive_int("gamma", gamma), check_seed(seed)
        rejection_rate = check_rejection_rate(rejection_rate)
        available = len(read_prompts(DATA))
        if count > available:
            raise ValueError(f"prompts: {DATA} has {available} prompts, fewer still in one length bucket")
        return cls(count, max_new_tokens, sizes, rejection_rate, gamma, seed)

    @property
    def budget(self) -> int:
        """Every search's KV slots: Best-of-8's memory."""
        return PROMPT_BUCKET + BASE_N * bucket(self.max_new_tokens)

    @property
    def sr_label(self) -> str:
        return f"SR α={self.rejection_rate:g}"

    @property
    def common(self) -> dict[str, Any]:
        """Every call's decoding arguments."""
        return dict(max_new_tokens=self.max_new_tokens, sampling=SAMPLING, seed=self.seed)


def run_demo(
    output_dir: str | Path = "out/demo",
    *,
    prompts: int = 3,
    max_new_tokens: int = 64,
    ns: Sequence[int] = (2, 8, 16),
    rejection_rate: float = 0.5,
    gamma: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Path]:
    """Run the demo, print its tables on stdout (status lines and the progress bar on stderr) and write
    `records.jsonl` and `reward_vs_compute.png` under `output_dir`; returns their paths."""
    demo = Demo.checked(prompts, max_new_tokens, ns, rejection_rate, gamma, seed)
    out_dir = writable_dir(output_dir)  # before minutes of decoding: the results must go somewhere
    status(f"loading {GENERATOR}…")
    lm = resolve_model("smollm2", "float32")
    status("loading all-MiniLM-L6-v2 (the reward)…")
    reward = resolve_reward("minilm", "float32")
    picked = pick_prompts(lm, demo.prompts)
    emit(introduction(demo, picked))
    bar = tqdm(
        total=demo.prompts * (len(demo.ns) + 3), disable=not progress, unit="call", file=sys.stderr,
        dynamic_ncols=True,
    )  # fmt: skip
    searched = run_searches(lm, reward, picked, demo, bar)
    emit(search_report(picked, searched, demo))
    pairs = run_pairs(lm, picked, demo, bar)
    bar.close()
    emit(pair_report(pairs, demo))
    return write_outputs(out_dir, picked, {**searched, **pairs}, demo)


def writable_dir(output_dir: str | Path) -> Path:
    """`output_dir`, created; a ValueError where it cannot be created or written."""
    out_dir = Path(output_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output_dir: cannot create {out_dir} ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"output_dir: {out_dir} is not writable")
    return out_dir


def pick_prompts(lm: Model, count: int) -> list[tuple[int, str]]:
    """The first `count` (index, prompt) of `DATA` in one length bucket: one prompt shape."""
    in_bucket = (
        (i, p)
        for i, p in enumerate(read_prompts(DATA))
        if bucket(len(encode_prompts(lm, [p])[0])) == PROMPT_BUCKET
    )
    picked = list(itertools.islice(in_bucket, count))
    if len(picked) < count:
        raise ValueError(
            f"prompts: {DATA} has only {len(picked)} usable prompts of the {PROMPT_BUCKET} bucket"
        )
    return picked


def introduction(demo: Demo, picked: list[tuple[int, str]]) -> str:
    return (
        "jaxsr demo: Best-of-N vs Speculative Rejection, then speculative contrastive vs contrastive "
        f"decoding\n{plural(demo.prompts, 'AlpacaFarm prompt')} "
        f"({DATA} #{', #'.join(str(i) for i, _ in picked)}), "
        f"seed {demo.seed}, T=1 top-k 50, at most {demo.max_new_tokens} new tokens\n"
        f"generator {GENERATOR}; reward {REWARD}\n"
        f"KV budget {demo.budget} slots = Best-of-{BASE_N}'s memory ({PROMPT_BUCKET}-slot prompt + "
        f"{BASE_N} × {bucket(demo.max_new_tokens)}) for every search"
    )


def run_searches(
    lm: Model, reward: Reward, picked: list[tuple[int, str]], demo: Demo, bar: tqdm
) -> dict[str, list[Result]]:
    """SR and each Best-of-N on every prompt, one call each, timed less the compiling inside it."""
    began = time.time()
    status("compiling… (each batch shape compiles on first use; wall times leave that time out)")
    # SR first: it pays for the reward's one embedding of the prompt, which later calls reuse
    runs: list[tuple[str, Callable[..., list[Result]], dict[str, Any]]] = [
        (demo.sr_label, speculative_rejection, {"rejection_rate": demo.rejection_rate}),
        *((f"Best-of-{n}", best_of_n, {"n": n}) for n in demo.ns),
    ]
    searched: dict[str, list[Result]] = {label: [] for label, _, _ in runs}
    for index, prompt in picked:
        search = dict(memory_budget=demo.budget, prompt_offset=index, **demo.common)
        for label, method, options in runs:
            bar.set_description(f"#{index} {label}")
            start = time.time()
            (result,) = method(lm, reward, [prompt], **options, **search)
            end = time.time()
            # the demo's own timing of the whole call, and the compiling inside it
            result.stats.update(call_s=end - start, jax_compile_s=compiling(start, end))
            searched[label].append(result)
            bar.set_postfix_str(f"compiled {compiling(began):.0f} s")
            bar.update()
    return searched


def run_pairs(lm: Model, picked: list[tuple[int, str]], demo: Demo, bar: tqdm) -> dict[str, list[Result]]:
    """Contrastive and speculative contrastive decoding of every prompt, the draft as the amateur."""
    status(f"loading {AMATEUR} (the amateur)…")
    amateur = resolve_model(AMATEUR, "float32")
    status("compiling… (contrastive and speculative contrastive decoding, on their first prompt)")
    pairs: dict[str, list[Result]] = {"CD": [], "SCD": []}
    for index, prompt in picked:
        run = dict(prompt_offset=index, **demo.common)
        bar.set_description(f"#{index} CD")
        pairs["CD"] += contrastive_decode(lm, amateur, [prompt], **run)
        bar.update()
        bar.set_description(f"#{index} SCD")
        pairs["SCD"] += speculative_contrastive_decode(lm, amateur, [prompt], gamma=demo.gamma, **run)
        bar.update()
    return pairs


def write_outputs(
    out_dir: Path, picked: list[tuple[int, str]], results: dict[str, list[Result]], demo: Demo
) -> dict[str, Path]:
    """The records and the plot under `out_dir`, their paths printed and returned."""
    methods = {
        demo.sr_label: "speculative_rejection",
        **{f"Best-of-{n}": "best_of_n" for n in demo.ns},
        "CD": "contrastive_decode",
        "SCD": "speculative_contrastive_decode",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "records.jsonl"
    rows = write_records(records, picked, results, methods)
    plot = out_dir / "reward_vs_compute.png"
    plot_reward_vs_compute(plot, results, demo)
    emit(f"records: {records} ({rows} lines, one per method and prompt)\nplot:    {plot}")
    return {"records": records, "plot": plot}


def status(message: str) -> None:
    """A short line on stderr (around the progress bar) saying what the demo is doing."""
    tqdm.write(message, file=sys.stderr)


def emit(text: str) -> None:
    """Report text on stdout (around the progress bar)."""
    tqdm.write(text + "\n", file=sys.stdout)


def opening(result: Result) -> str:
    """The chosen answer's first characters on one line, marked when it was cut at the token limit."""
    answer = result.best if result.best is not None else result.samples[0]
    shown = shorten(answer.text, OPENING)
    return shown if answer.finished else f"{shown} …[cut at {len(answer.token_ids)} tokens]"


def shorten(text: str, width: int) -> str:
    """`text` on one line, cut to `width` characters (an ellipsis marks the cut)."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def wrap(text: str) -> str:
    return textwrap.fill(text, width=100)


def table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """Columns padded to their widest cell: the `left` ones (text) left-aligned, numbers right-aligned."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  " + "  ".join(padded).rstrip()

    return "\n".join(line(r) for r in [header, *rows])


def forwards(result: Result, role: str) -> int:
    return int(result.stats["token_forwards"][role])


def wall(result: Result) -> float:
    """A search call's wall time less the compiling inside it."""
    return result.stats["call_s"] - result.stats["jax_compile_s"]


def start_widths(sr: list[Result]) -> str:
    """SR's first batch width (one per distinct width among the prompts)."""
    return "/".join(str(w) for w in sorted({r.stats["initial_batch"] for r in sr}))


def search_report(picked: list[tuple[int, str]], searched: dict[str, list[Result]], demo: Demo) -> str:
    """Per prompt each method's chosen answer and cost, then the means and SR's speedup."""
    ns, sr_label, budget = demo.ns, demo.sr_label, demo.budget
    lines = [
        wrap(
            f"Best-of-N vs Speculative Rejection (SR): in the {budget}-slot budget Best-of-N decodes "
            f"at most {BASE_N} rows at a time, while SR starts {start_widths(searched[sr_label])} rows "
            f"wide (the rows share one prompt cache) and stops the worst α={demo.rejection_rate:g} of the "
            "partial answers whenever the cache fills. Reward: the chosen answer's; fwd: token-forwards "
            "of the generator and the reward model; wall s: the call's wall time less the time JAX spent "
            "compiling in it."
        )
    ]
    header = ["method", "reward", "gen fwd", "reward fwd", "wall s", "chosen answer (opening)"]
    for k, (index, prompt) in enumerate(picked):
        lines.append(f"\n#{index} {shorten(prompt, 100)}")
        rows = []
        for label, results in searched.items():
            r = results[k]
            rows.append(
                [
                    label,
                    f"{r.best.score:.3f}",
                    str(forwards(r, "generator")),
                    str(forwards(r, "reward")),
                    f"{wall(r):.1f}",
                    opening(r),
                ]
            )
        lines.append(table(header, rows, left=(0, 5)))

    mean = {
        label: {
            "reward": float(np.mean([r.best.score for r in results])),
            "gen": float(np.mean([forwards(r, "generator") for r in results])),
            "rew": float(np.mean([forwards(r, "reward") for r in results])),
            "wall": float(np.mean([wall(r) for r in results])),
        }
        for label, results in searched.items()
    }
    s = mean[sr_label]
    matched = next((n for n in ns if mean[f"Best-of-{n}"]["reward"] >= s["reward"]), None)
    ref = f"Best-of-{ns[-1] if matched is None else matched}"
    bound = "≥" if matched is None else ""
    header = ["method", "mean reward", "gen fwd", "reward fwd", "wall s", f"SR's speedup vs {ref}"]
    rows = []
    for label, m in mean.items():
        speedup = ""
        if label == sr_label:
            by_forwards, by_wall = mean[ref]["gen"] / s["gen"], mean[ref]["wall"] / s["wall"]
            speedup = f"{bound}{by_forwards:.2f}× gen fwd, {bound}{by_wall:.2f}× wall"
        rows.append(
            [label, f"{m['reward']:.3f}", f"{m['gen']:.0f}", f"{m['rew']:.0f}", f"{m['wall']:.1f}", speedup]
        )
    why = (
        "the widest Best-of-N run; none reaches SR's mean reward, so the speedup is a lower bound"
        if matched is None
        else "the smallest N whose mean reward reaches SR's"
    )
    lines += [f"\nmean over the {plural(len(picked), 'prompt')}", table(header, rows, left=(0, 5))]
    lines.append(f"  ({ref}: {why})")
    return "\n".join(lines)


def pair_report(pairs: dict[str, list[Result]], demo: Demo) -> str:
    """Acceptance, tokens per expert call and decoding speed of SCD against CD over all prompts."""
    header = ["method", "tokens", "decode s", "tokens/s", "λ", "tokens/expert call", "compile s"]
    rows, speed = [], {}
    for label, results in pairs.items():
        tokens = sum(len(s.token_ids) for r in results for s in r.samples)
        decode_s = sum(r.stats["decode_s"] for r in results)
        speed[label] = tokens / decode_s
        accept, per_call = "", ""
        if label == "SCD":
            tested = sum(r.stats["tested_tokens"] for r in results)
            calls = sum(r.stats["target_calls"] for r in results)
            produced = sum(r.stats["tokens_per_target_call"] * r.stats["target_calls"] for r in results)
            accept = f"{sum(r.stats['accepted_tokens'] for r in results) / tested:.3f}" if tested else "-"
            per_call = f"{produced / calls:.2f}" if calls else "-"
        compile_s = sum(r.stats["compile_s"] for r in results)
        rows.append(
            [
                label,
                str(tokens),
                f"{decode_s:.2f}",
                f"{speed[label]:.1f}",
                accept,
                per_call,
                f"{compile_s:.1f}",
            ]
        )
    intro = (
        f"Speculative contrastive decoding (SCD, γ={demo.gamma}) vs contrastive decoding (CD): expert "
        f"{GENERATOR}, amateur {AMATEUR}, α=0.1 β=0.5, one answer to each of the "
        f"{plural(demo.prompts, 'prompt')}, at most {demo.max_new_tokens} new tokens. SCD samples CD's "
        "distribution exactly, the amateur drafting γ tokens per expert call; λ: the share of drafted "
        "tokens accepted. Speeds are tokens ÷ decode time: jaxsr times compilation apart (compile s) "
        "and it is left out."
    )
    ratio = f"  SCD ÷ CD decoding speed: {speed['SCD'] / speed['CD']:.2f}×"
    return "\n".join([wrap(intro), table(header, rows), ratio])


def write_records(
    path: Path, picked: list[tuple[int, str]], results: dict[str, list[Result]], methods: dict[str, str]
) -> int:
    """One JSON object per line per (method, prompt): no header, so `datasets` reads one row each."""
    lines = []
    for label, per_prompt in results.items():
        for (index, prompt), r in zip(picked, per_prompt, strict=True):
            answer = r.best if r.best is not None else r.samples[0]
            record: dict[str, Any] = {
                "method": methods[label],
                "label": label,
                "prompt_index": index,
                "prompt": prompt,
                "text": answer.text,
                "score": answer.score,
                "finished": answer.finished,
                "stats": r.stats,
            }
            lines.append(json.dumps(record))
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)


def plot_reward_vs_compute(path: Path, searched: dict[str, list[Result]], demo: Demo) -> None:
    """Mean best reward against mean generator token-forwards: Best-of-N's curve and SR's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    def point(results: list[Result]) -> tuple[float, float]:
        return (
            float(np.mean([forwards(r, "generator") for r in results])),
            float(np.mean([r.best.score for r in results])),
        )

    ns, sr_label = demo.ns, demo.sr_label
    bon = [point(searched[f"Best-of-{n}"]) for n in ns]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(*zip(*bon, strict=True), "o-", label="Best-of-N")
    for n, (x, y) in zip(ns, bon, strict=True):
        ax.annotate(f"N={n}", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    sr = searched[sr_label]
    label = f"Speculative Rejection ({sr_label[3:]}, starts {start_widths(sr)} rows wide)"
    ax.plot(*point(sr), "*", markersize=14, label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("generator token-forwards per prompt (mean)")
    ax.set_ylabel("best reward (mean)")
    ax.set_title(
        f"{GENERATOR}, reward {REWARD}\n{demo.prompts} AlpacaFarm prompts, ≤{demo.max_new_tokens} new "
        f"tokens, KV budget {demo.budget} slots",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
