"""Best-of-N, Speculative Rejection and TreeBoN on the CPU job setting, side by side in one run; and
self-certainty's pick of a Best-of-N set against the reward model's.

SmolLM2-135M-Instruct generates (T=1, top-k 50); the reward is all-MiniLM-L6-v2 prompt/response
relevance; AlpacaFarm prompts of the 64-token bucket (as `bench_sr_job`). Per method: generator token
positions per prompt (what each method spends), wall seconds per prompt (compile time left out), mean
best reward, the paper's score (Best-of-8 = 100), and the win-rate by the reward against the Best-of-N
whose generator positions are nearest to the method's (ties count half). TreeBoN prunes with the same
reward (MiniLM of the partial response). Each method runs once per pass, `--repeats` passes; the
fastest pass counts and a repeated call must choose the same responses.

Self-certainty: the largest Best-of-N's samples, rescored with `SelfCertainty` (no reward model); its
pick is compared with the reward's (how often they agree, and the reward of each pick against the
mean sample's).

    python -m benchmarks.bench_tree [--prompts 16] [--max-new-tokens 64] [--ns 4 8 16 32]
        [--trees 16/4/4 32/4/4] [--sr 0.5/16] [--concurrent 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

import jaxsr
from benchmarks.bench_speculative_rejection import paper_score
from benchmarks.bench_sr_job import BUCKET, SAMPLING, run_passes
from benchmarks.common import RESULTS, table, write_result
from jaxsr.data import read_prompts
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.ladder import bucket
from jaxsr.loading.resolve import resolve_model, resolve_reward
from jaxsr.rewards import SelfCertainty
from jaxsr.search.candidates import score_prompts


def generator_positions(results: list[jaxsr.Result]) -> float:
    """Mean token positions per prompt run through the generator (its prefill not counted)."""
    return float(np.mean([next(iter(r.stats["token_forwards"].values())) for r in results]))


def win_rate(results: list[jaxsr.Result], base: list[jaxsr.Result]) -> float:
    """How often a prompt's best reward beats `base`'s (ties half)."""
    mine, theirs = (np.array([r.best.score for r in rs]) for rs in (results, base))
    return float(np.mean((mine > theirs) + 0.5 * (mine == theirs)))


def calls_of(args, lm, reward, prompts) -> dict[str, Callable[[], list[jaxsr.Result]]]:
    """Every method of the run, by name."""
    common = dict(max_new_tokens=args.max_new_tokens, sampling=SAMPLING, seed=args.seed)
    calls: dict[str, Callable[[], list[jaxsr.Result]]] = {}
    for n in sorted(args.ns):
        calls[f"Best-of-{n}"] = lambda n=n: jaxsr.best_of_n(lm, reward, prompts, n=n, **common)
    budget = BUCKET + 8 * bucket(args.max_new_tokens)  # Best-of-8's KV slots, as bench_sr_job
    for setting in args.sr:
        rate, segment = setting.split("/")
        calls[f"SR α={rate} from {segment} tokens"] = lambda r=float(rate), m=int(segment): (
            jaxsr.speculative_rejection(
                lm, reward, prompts, rejection_rate=r, memory_budget=budget, min_first_segment=m,
                concurrent_prompts=args.concurrent, **common,
            )
        )  # fmt: skip
    for setting in args.trees:
        n, branch, layers = (int(x) for x in setting.split("/"))
        calls[f"TreeBoN n={n} branch={branch} layers={layers}"] = lambda n=n, b=branch, k=layers: (
            jaxsr.tree_best_of_n(
                lm, reward, prompts, n=n, branch=b, layers=k, concurrent_prompts=args.concurrent, **common
            )
        )
    return calls


def certainty_against_reward(lm, results: list[jaxsr.Result], prompts, reward_name: str) -> dict[str, Any]:
    """Self-certainty's pick of each prompt's samples against the reward's."""
    encoded = encode_prompts(lm, prompts)
    rescored = score_prompts(
        lm,
        SelfCertainty(),
        [(p, ids, r.samples) for p, ids, r in zip(prompts, encoded, results, strict=True)],
    )
    agree, picked, best, mean = [], [], [], []
    for result, by_certainty in zip(results, rescored, strict=True):
        pick = int(np.argmax([s.score for s in by_certainty]))
        rewards = np.array([s.score for s in result.samples])
        agree.append(by_certainty[pick].index == result.best.index)
        picked.append(rewards[pick])
        best.append(rewards.max())
        mean.append(rewards.mean())
    return {
        "samples_per_prompt": len(results[0].samples),
        "same_pick": float(np.mean(agree)),
        f"{reward_name}_of_certainty_pick": float(np.mean(picked)),
        f"{reward_name}_of_reward_pick": float(np.mean(best)),
        f"{reward_name}_of_mean_sample": float(np.mean(mean)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--skip-prompts", type=int, default=0, help="start after this many bucket prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ns", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--sr", nargs="+", default=["0.5/16"], help="α/first_segment")
    parser.add_argument("--trees", nargs="+", default=["16/4/4", "32/4/4"], help="n/branch/layers")
    parser.add_argument("--concurrent", type=int, default=4, help="SR and TreeBoN prompts in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="tree")
    args = parser.parse_args()

    lm = resolve_model("smollm2", "float32")
    reward = resolve_reward("minilm", "float32")
    in_bucket = (
        p for p in read_prompts("alpaca_farm_eval") if bucket(len(encode_prompts(lm, [p])[0])) == BUCKET
    )
    prompts = list(itertools.islice(in_bucket, args.skip_prompts, args.skip_prompts + args.prompts))
    calls = calls_of(args, lm, reward, prompts)
    runs, _ = run_passes(calls, args.repeats)

    bon = {name: r for name, (r, _) in runs.items() if name.startswith("Best-of")}
    positions = {name: generator_positions(r) for name, r in bon.items()}
    base = runs["Best-of-8"][0] if "Best-of-8" in runs else next(iter(bon.values()))
    base_best = np.array([r.best.score for r in base])
    base_worst = np.array([min(s.score for s in r.samples) for r in base])
    rows = []
    for name, (results, seconds) in runs.items():
        spent = generator_positions(results)
        matched = min(bon, key=lambda b: abs(np.log(positions[b] / spent)))
        rows.append(
            {
                "method": name,
                "generator_positions_per_prompt": spent,
                "wall_s_per_prompt": seconds / len(prompts),
                "mean_best_reward": float(np.mean([r.best.score for r in results])),
                "score": paper_score(np.array([r.best.score for r in results]), base_best, base_worst),
                "matched_best_of_n": matched,
                "win_rate_vs_matched": win_rate(results, bon[matched]),
            }
        )
    columns = list(rows[0])
    print(table(rows, columns))
    largest = max(bon, key=lambda b: positions[b])
    certainty = certainty_against_reward(lm, bon[largest], prompts, "minilm")
    print("self-certainty against the reward on", largest, certainty)
    plot(rows, args)
    payload = {"prompts": len(prompts), "args": vars(args), "rows": rows, "self_certainty": certainty}
    print(f"wrote {write_result(args.name, payload)}")


def plot(rows: list[dict[str, Any]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for prefix, style in (("Best-of", "o-"), ("SR", "s"), ("TreeBoN", "^")):
        mine = [r for r in rows if r["method"].startswith(prefix)]
        ax.plot(
            [r["generator_positions_per_prompt"] for r in mine],
            [r["score"] for r in mine],
            style,
            label=prefix,
        )
        for r in mine:
            ax.annotate(r["method"].split(" ", 1)[-1] if prefix != "Best-of" else r["method"][8:],
                        (r["generator_positions_per_prompt"], r["score"]), fontsize=7)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("generator token positions per prompt")
    ax.set_ylabel("score (Best-of-8 = 100)")
    ax.set_title(f"{args.prompts} AlpacaFarm prompts, {args.max_new_tokens} new tokens, MiniLM reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
