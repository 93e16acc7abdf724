"""A Speculative Rejection dataset job on this machine: batched Best-of-N at several N, SR one prompt
at a time, and SR with several prompts in flight (`concurrent_prompts`), side by side in one run.

SmolLM2-135M-Instruct generates (T=1, top-k 50); the reward is all-MiniLM-L6-v2 prompt/response
relevance; prompts of the 64-token bucket (`--data`: AlpacaFarm's evaluation set by default;
`--skip-prompts` starts past the ones a setting was chosen on). SR runs at Best-of-8's KV memory per
prompt; each `--sr α/first_segment` setting is one SR configuration (the first segment sets how many
rows start: the budget's response slots ÷ the segment); the first runs with each `--concurrent` count of
prompts in flight, the others with the largest count. Per method: wall seconds per prompt
(JAX compile time left out, from `jax.monitoring`), mean best reward, and the paper's score with
Best-of-8 as the base (100·(1 + mean over prompts of (max s − max s_Bo8)/(max s_Bo8 − min s_Bo8))).
Every method runs once per pass, `--repeats` passes (so drift of a shared machine hits them alike);
its fastest pass counts, and a repeated call must choose the same responses.
Speedup at equal score: Best-of-N's wall time interpolated (log-linear in wall time) at the method's
score ÷ the method's wall time. Score vs the largest Best-of-N: the difference of the two scores,
prompt by prompt, with a 95% bootstrap interval over the prompts (is a gap more than the prompts' own
spread?).

`--bon-rows 128` adds the largest Best-of-N decoding that many rows a call (the default is 64 a `data`
shard): a baseline given the memory that SR's prompts in flight hold together.

`--kv-dtypes float32 int8` adds, per KV dtype, Best-of-8 and every SR setting (at the largest
`--concurrent`) with the budget given in bytes: Best-of-8's float32 KV bytes per prompt, so an int8
cache fits more rows in the same memory (issue 29's comparison).

    python -m benchmarks.bench_sr_job [--data alpaca_farm_eval] [--prompts 24] [--skip-prompts 0]
        [--max-new-tokens 64] [--ns 8 16 32] [--sr 0.5/16 0.5/8 0.7/8]
        [--concurrent 1 4 8] [--seed 0] [--repeats 2] [--bon-rows 128] [--kv-dtypes float32 int8]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import jaxsr
from benchmarks.bench_speculative_rejection import interpolate_compute, paper_score
from benchmarks.common import RESULTS, table, write_result
from jaxsr.data import read_prompts
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.ladder import bucket
from jaxsr.loading.resolve import resolve_model, resolve_reward
from jaxsr.timing import compiling

BUCKET = 64
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)


def timed(call) -> tuple[list[jaxsr.Result], float]:
    """The call's results and its wall seconds less the time JAX spent compiling during it."""
    start = time.time()
    results = call()
    end = time.time()
    return results, end - start - compiling(start, end)


def first_batch(results: list[jaxsr.Result]) -> int:
    """Rows decoded for the first prompt at its start (SR: its first rung; Best-of-N: n)."""
    return results[0].stats.get("initial_batch", len(results[0].samples))


def check_same_answers(name: str, before: list[jaxsr.Result], after: list[jaxsr.Result]) -> None:
    """A repeated call chose the same responses (same seed): only its time may differ."""
    chosen = [[r.best.index, r.best.token_ids] for r in before]
    if chosen != [[r.best.index, r.best.token_ids] for r in after]:
        raise RuntimeError(f"{name}: a repeated call chose other responses")


def run_passes(
    calls: dict[str, Callable[[], list[jaxsr.Result]]], repeats: int
) -> tuple[dict[str, tuple[list[jaxsr.Result], float]], dict[str, list[float]]]:
    """Every call once per pass, `repeats` passes (so drift of a shared machine hits them alike): each
    call's results with its fastest pass, and every pass's seconds; a repeated call must choose the
    same responses."""
    runs: dict[str, tuple[list[jaxsr.Result], float]] = {}
    walls: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        for name, call in calls.items():
            results, seconds = timed(call)
            walls[name].append(seconds)
            if name in runs:
                check_same_answers(name, runs[name][0], results)
            runs[name] = (results, min(walls[name]))
            print(
                f"pass {repeat + 1}, {name} (first batch {first_batch(results)}): {seconds:.1f} s",
                flush=True,
            )
    return runs, walls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="alpaca_farm_eval", help="a shipped prompt set or a file")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--skip-prompts", type=int, default=0, help="start after this many bucket prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ns", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--sr", nargs="+", default=["0.5/16", "0.5/8", "0.7/8"], help="α/first_segment")
    parser.add_argument("--concurrent", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="passes over every method; the fastest counts")
    parser.add_argument("--name", default="sr_job")
    parser.add_argument(
        "--bon-rows", type=int, nargs="*", default=[],
        help="also run the largest Best-of-N with this many rows a call",
    )  # fmt: skip
    parser.add_argument(
        "--kv-dtypes", nargs="*", default=[], choices=["float32", "int8"],
        help="also run Best-of-8 and SR with the KV cache in each, at a budget in bytes",
    )  # fmt: skip
    args = parser.parse_args()

    lm = resolve_model("smollm2", "float32")
    reward = resolve_reward("minilm", "float32")
    in_bucket = (p for p in read_prompts(args.data) if bucket(len(encode_prompts(lm, [p])[0])) == BUCKET)
    prompts = list(itertools.islice(in_bucket, args.skip_prompts, args.skip_prompts + args.prompts))
    budget = BUCKET + 8 * bucket(args.max_new_tokens)  # Best-of-8's KV slots
    common = dict(max_new_tokens=args.max_new_tokens, sampling=SAMPLING, seed=args.seed)
    calls: dict[str, Callable[[], list[jaxsr.Result]]] = {}
    for n in sorted(args.ns):
        calls[f"Best-of-{n}"] = lambda n=n: jaxsr.best_of_n(lm, reward, prompts, n=n, **common)
    curve_names = set(calls)
    for max_rows in args.bon_rows:
        calls[f"Best-of-{max(args.ns)}, {max_rows} rows a call"] = lambda r=max_rows: jaxsr.best_of_n(
            lm, reward, prompts, n=max(args.ns), max_rows=r, **common
        )
    settings = [tuple(setting.split("/")) for setting in args.sr]
    for i, (rate, segment) in enumerate(settings):
        for concurrent in args.concurrent if i == 0 else [max(args.concurrent)]:
            calls[f"SR α={rate} from {segment} tokens, {concurrent} in flight"] = (
                lambda r=float(rate), m=int(segment), c=concurrent: jaxsr.speculative_rejection(
                    lm, reward, prompts, rejection_rate=r, memory_budget=budget, concurrent_prompts=c,
                    min_first_segment=m, **common,
                )
            )  # fmt: skip
    calls.update(kv_dtype_calls(lm, reward, prompts, budget, settings, args))
    runs, walls = run_passes(calls, args.repeats)

    def best(results: list[jaxsr.Result]) -> np.ndarray:
        return np.array([r.best.score for r in results])

    base = runs[f"Best-of-{min(args.ns)}"][0]
    base_best, base_worst = best(base), np.array([min(s.score for s in r.samples) for r in base])
    rows: list[dict[str, Any]] = []
    for name, (results, seconds) in runs.items():
        rows.append(
            {
                "method": name,
                "first_batch": first_batch(results),
                "wall_s_per_prompt": seconds / len(prompts),
                "wall_s_per_prompt_each_pass": [w / len(prompts) for w in walls[name]],
                "mean_best_reward": float(best(results).mean()),
                "best_rewards": best(results).tolist(),
                "score": paper_score(best(results), base_best, base_worst),
                "stage_s_per_prompt": stage_split(results),
            }
        )
    curve = [(r["wall_s_per_prompt"], r["score"]) for r in rows if r["method"] in curve_names]
    largest = rows[len(args.ns) - 1]
    for row in rows:
        equal, lower_bound = interpolate_compute(row["score"], curve)
        row["speedup_at_equal_score"] = equal / row["wall_s_per_prompt"]
        row["speedup_is_lower_bound"] = lower_bound
        row["wall_vs_largest_bon"] = row["wall_s_per_prompt"] / largest["wall_s_per_prompt"]
        row["score_vs_largest_bon"] = paired_difference(row, largest, base_best, base_worst)
    columns = [
        "method",
        "first_batch",
        "wall_s_per_prompt",
        "mean_best_reward",
        "score",
        "speedup_at_equal_score",
        "wall_vs_largest_bon",
        "score_vs_largest_bon",
    ]
    print(table([{**r, "score_vs_largest_bon": shown(r["score_vs_largest_bon"])} for r in rows], columns))
    print(table([{"method": r["method"], **r["stage_s_per_prompt"]} for r in rows], ["method", *STAGES]))
    plot(rows, curve_names, args)
    path = write_result(
        args.name,
        {"prompts": len(prompts), "memory_budget_slots": budget, "args": vars(args), "rows": rows},
    )
    print(f"wrote {path}")


STAGES = ("prefill_s", "decode_s", "scoring_s", "compaction_s", "host_s")
RESAMPLES = 10_000


def paired_difference(row: dict, largest: dict, base_best: np.ndarray, base_worst: np.ndarray) -> dict:
    """`row`'s score minus the largest Best-of-N's, prompt by prompt (each prompt's term of
    `paper_score`), with a 95% bootstrap interval over the prompts (a fixed seed: reruns agree) and
    each prompt's term (to pool runs over other prompts)."""
    spread = np.maximum(base_best - base_worst, 1e-9)
    terms = 100 * (np.array(row["best_rewards"]) - np.array(largest["best_rewards"])) / spread
    draws = np.random.default_rng(0).integers(0, len(terms), (RESAMPLES, len(terms)))
    low, high = np.percentile(terms[draws].mean(axis=1), [2.5, 97.5])
    return {"mean": float(terms.mean()), "ci95": [float(low), float(high)], "terms": terms.tolist()}


def shown(difference: dict) -> str:
    low, high = difference["ci95"]
    return f"{difference['mean']:+.1f} [{low:+.1f}, {high:+.1f}]"


def stage_split(results: list[jaxsr.Result]) -> dict[str, float]:
    """Mean seconds per prompt in each stage of the searches' own accounting (compiling left out)."""
    return {stage: float(np.mean([r.stats.get(stage, 0.0) for r in results])) for stage in STAGES}


def kv_dtype_calls(lm, reward, prompts, budget_slots: int, settings, args) -> dict[str, Callable]:
    """Best-of-8 and each SR setting per `--kv-dtypes` entry, at `budget_slots` float32 slots' bytes."""
    budget = f"{budget_slots * lm.kv_slot_bytes}B"
    common = dict(max_new_tokens=args.max_new_tokens, sampling=SAMPLING, seed=args.seed, memory_budget=budget)
    calls: dict[str, Callable[[], list[jaxsr.Result]]] = {}
    for kv_dtype in args.kv_dtypes:
        model = lm.with_kv_dtype(None if kv_dtype == "float32" else kv_dtype)
        suffix = f", {kv_dtype} KV in {budget}"
        calls["Best-of-8" + suffix] = lambda m=model: jaxsr.best_of_n(m, reward, prompts, n=8, **common)
        for rate, segment in settings:
            calls[f"SR α={rate} from {segment} tokens{suffix}"] = (
                lambda m=model, r=float(rate), s=int(segment): jaxsr.speculative_rejection(
                    m, reward, prompts, rejection_rate=r, min_first_segment=s,
                    concurrent_prompts=max(args.concurrent), **common,
                )
            )  # fmt: skip
    return calls


def plot(rows: list[dict[str, Any]], curve_names: set[str], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    bon = [r for r in rows if r["method"] in curve_names]
    ax.plot(
        [r["wall_s_per_prompt"] for r in bon], [r["score"] for r in bon], "o-", label="Best-of-N, batched"
    )
    for r in bon:
        ax.annotate(r["method"].removeprefix("Best-of-"), (r["wall_s_per_prompt"], r["score"]))
    for r in rows:
        if r["method"] not in curve_names:
            ax.plot(r["wall_s_per_prompt"], r["score"], "s", label=r["method"])
    ax.set_xscale("log")
    ax.set_xlabel("wall seconds per prompt (this CPU, compile time left out)")
    ax.set_ylabel("score (Best-of-8 = 100)")
    ax.set_title(f"SR job: {args.prompts} prompts of {args.data}, {args.max_new_tokens} new tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
