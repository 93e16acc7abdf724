"""Speculative Rejection vs Best-of-N at Best-of-8's KV memory budget (the paper's efficiency figure).

SmolLM2-135M-Instruct generates; the reward is all-MiniLM-L6-v2 prompt/response relevance (or the
generator's self-likelihood). For each prompt:

- Best-of-8 runs for real at its own memory budget: its wall time and token-forwards are the unit
  of compute. Best-of-N for N up to 128 at that budget is N/8 sequential Best-of-8 batches, so its
  compute is N/8 units; its samples are the first N of 128 samples (a row's random stream depends
  only on (seed, prompt, sample index), so the first N of 128 are exactly Best-of-N's samples).
- SR runs for each α with Best-of-8's budget; the shared prompt cache lets it start far wider.

Score (the paper's): 100·(1 + mean over prompts of (max s_method − max s_Bo8)/(max s_Bo8 − min s_Bo8)).
Speedup: Best-of-N compute interpolated (in log compute) at SR's score ÷ SR's compute.
Also: Spearman correlation between partial and final reward at several decision tokens (Figure 2).

    python -m benchmarks.bench_speculative_rejection [--prompts 20] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

import jaxsr
from benchmarks.common import RESULTS, table, write_result
from jaxsr import text
from jaxsr.data import read_prompts
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.ladder import bucket
from jaxsr.loading.gguf import smollm2_path
from jaxsr.loading.resolve import resolve_reward
from jaxsr.results import Sample
from jaxsr.search.candidates import score_samples


def paper_score(best: np.ndarray, base_best: np.ndarray, base_worst: np.ndarray) -> float:
    spread = np.maximum(base_best - base_worst, 1e-9)
    return float(100 * (1 + np.mean((best - base_best) / spread)))


def interpolate_compute(score: float, curve: list[tuple[float, float]]) -> tuple[float, bool]:
    """Best-of-N compute reaching `score` (log-linear between measured N); (value, is_lower_bound)."""
    xs = [math.log(c) for c, _ in curve]
    ys = [s for _, s in curve]
    if score <= ys[0]:
        return curve[0][0], False
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys, strict=True)):
        if y0 <= score <= y1 and y1 > y0:
            return math.exp(x0 + (score - y0) / (y1 - y0) * (x1 - x0)), False
    return curve[-1][0], True  # SR beats the largest N measured: the speedup is at least this


def partial_correlations(lm, reward, prompt, ids, samples, final, tokens_at) -> dict[int, float]:
    """Spearman(partial reward at t tokens, final reward) over one prompt's samples."""
    out = {}
    for t in tokens_at:
        if reward.name.startswith("self_likelihood"):
            raise ValueError("partial correlations need a text reward")
        texts = text.decode_batch(lm.tokenizer, [s.token_ids[:t] for s in samples])
        cut = [Sample(s.token_ids[:t], t_, logprob=s.logprob) for s, t_ in zip(samples, texts, strict=True)]
        partial = [s.score for s in score_samples(lm, reward, prompt, ids, cut)]
        out[t] = float(scipy.stats.spearmanr(partial, final).statistic)
    return out


def measure(lm, reward, prompt: str, i: int, args, common: dict[str, Any]) -> dict[str, Any]:
    """Best-of-8 (the unit), Best-of-128's samples, and SR for each α, on one prompt."""
    base_n, top_n = min(args.n), max(args.n)
    ids = encode_prompts(lm, [prompt])[0]
    budget = bucket(len(ids)) + base_n * bucket(args.max_new_tokens)  # what Best-of-8 occupies
    run = dict(prompt_offset=i, **common)
    base = jaxsr.best_of_n(lm, reward, [prompt], n=base_n, memory_budget=budget, **run)[0]
    full = jaxsr.best_of_n(lm, reward, [prompt], n=top_n, **run)[0]
    final = np.array([s.score for s in full.samples])
    assert [s.token_ids for s in full.samples[:base_n]] == [s.token_ids for s in base.samples]
    record: dict[str, Any] = {
        "prompt_index": i,
        "budget_slots": budget,
        "base": {"wall_s": base.stats["wall_s"], "token_forwards": base.stats["token_forwards"]},
        "bon_best": {n: float(final[:n].max()) for n in args.n},
        "base_worst": float(final[:base_n].min()),
        "sr": {},
    }
    if not reward.name.startswith("self_likelihood"):
        record["spearman_partial_final"] = partial_correlations(
            lm, reward, prompt, ids, full.samples, final, [8, 16, 32, 64]
        )
    for alpha in args.alphas:
        sr = jaxsr.speculative_rejection(
            lm, reward, [prompt], rejection_rate=alpha, memory_budget=budget, **run
        )[0]
        record["sr"][alpha] = {
            "best": sr.best.score,
            "wall_s": sr.stats["wall_s"],
            "token_forwards": sr.stats["token_forwards"],
            "batch_sizes": sr.stats["batch_sizes"],
            "round_log": sr.stats["round_log"],
            "decisions": sr.stats["decisions"],
            "timings": {
                k: sr.stats[k] for k in ("prefill_s", "decode_s", "scoring_s", "compaction_s", "host_s")
            },
        }
    if i == 0:
        steps = base.stats["token_forwards"]["generator"] - bucket(len(ids))
        record["base_round"] = {
            "batch_size": base_n,
            "end_token": args.max_new_tokens,
            "kv_bytes": budget * lm.kv_slot_bytes,
            "step_ms": 1e3 * base.stats["decode_s"] / max(1, steps // base_n),
        }
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--n", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--reward", default="minilm")
    parser.add_argument("--data", default="alpaca_farm_100")
    parser.add_argument("--name", default="speculative_rejection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bucket", type=int, default=None, help="only prompts of this length bucket (bounds compiles)"
    )
    args = parser.parse_args()

    lm = jaxsr.load_model(smollm2_path())
    reward = resolve_reward(args.reward, "float32")
    sampling = jaxsr.SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)
    prompts = read_prompts(args.data)
    if args.bucket is not None:
        prompts = [p for p in prompts if bucket(len(encode_prompts(lm, [p])[0])) == args.bucket]
    prompts = prompts[: args.prompts]
    base_n, top_n = min(args.n), max(args.n)
    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    per_prompt: list[dict[str, Any]] = []
    # compile every shape first (one prompt per prompt-length bucket) so timings exclude compilation
    first_of_bucket = {bucket(len(encode_prompts(lm, [p])[0])): p for p in reversed(prompts)}
    for prompt in first_of_bucket.values():
        measure(lm, reward, prompt, 0, args, common)
    t_all = time.perf_counter()
    for i, prompt in enumerate(prompts):
        record = measure(lm, reward, prompt, i, args, common)
        per_prompt.append(record)
        bon = f"Bo{base_n} {record['bon_best'][base_n]:.3f} Bo{top_n} {record['bon_best'][top_n]:.3f}"
        srs = " ".join(f"SR{a} {r['best']:.3f}{r['batch_sizes']}" for a, r in record["sr"].items())
        print(f"prompt {i}: {bon} {srs}", flush=True)
        write_result(args.name, {"config": vars(args), "partial": True, "per_prompt": per_prompt})

    rows = summarise(per_prompt, args)
    columns = ["method", "effective_alpha", "score", "rel_forwards", "rel_wall"]
    columns += ["speedup_forwards", "speedup_wall"]
    print(table(rows, columns))
    correlations = {}
    if "spearman_partial_final" in per_prompt[0]:
        for t in per_prompt[0]["spearman_partial_final"]:
            values = [p["spearman_partial_final"][t] for p in per_prompt]
            correlations[t] = {
                "mean": float(np.nanmean(values)),
                "min": float(np.nanmin(values)),
                "max": float(np.nanmax(values)),
            }
        print("Spearman(partial, final) by decision token:", correlations)
    path = write_result(
        args.name,
        {
            "config": vars(args),
            "summary": rows,
            "spearman": correlations,
            "per_prompt": per_prompt,
            "total_s": time.perf_counter() - t_all,
        },
    )
    plot(per_prompt, rows, args, path.with_suffix(""))
    print(f"wrote {path}")


def effective_rates(decisions: list[list[dict[str, Any]]], first: int = 4) -> str:
    """The mean effective rejection rate of each of the first decisions over prompts ("0.50/0.48/…")."""
    means = []
    for d in range(min(first, max(map(len, decisions), default=0))):
        rates = [p[d]["rate"] for p in decisions if len(p) > d]
        means.append(f"{np.mean(rates):.2f}")
    return "/".join(means)


def _forwards(stats_forwards: dict[str, int]) -> int:
    return sum(stats_forwards.values())


def summarise(per_prompt: list[dict[str, Any]], args) -> list[dict[str, Any]]:
    base_n = min(args.n)
    base_best = np.array([p["bon_best"][base_n] for p in per_prompt])
    base_worst = np.array([p["base_worst"] for p in per_prompt])
    rows = []
    curve_f, curve_w = [], []
    for n in args.n:
        score = paper_score(np.array([p["bon_best"][n] for p in per_prompt]), base_best, base_worst)
        rows.append(
            {"method": f"BoN N={n}", "score": score, "rel_forwards": n / base_n, "rel_wall": n / base_n}
        )
        curve_f.append((n / base_n, score))
        curve_w.append((n / base_n, score))
    for alpha in args.alphas:
        best = np.array([p["sr"][alpha]["best"] for p in per_prompt])
        score = paper_score(best, base_best, base_worst)
        rel_f = float(
            np.mean(
                [
                    _forwards(p["sr"][alpha]["token_forwards"]) / _forwards(p["base"]["token_forwards"])
                    for p in per_prompt
                ]
            )
        )
        rel_w = float(np.mean([p["sr"][alpha]["wall_s"] / p["base"]["wall_s"] for p in per_prompt]))
        need_f, lower_f = interpolate_compute(score, curve_f)
        need_w, lower_w = interpolate_compute(score, curve_w)
        rows.append(
            {
                "method": f"SR α={alpha}",
                "effective_alpha": effective_rates([p["sr"][alpha]["decisions"] for p in per_prompt]),
                "score": score,
                "rel_forwards": rel_f,
                "rel_wall": rel_w,
                "speedup_forwards": f"{'≥' if lower_f else ''}{need_f / rel_f:.2f}",
                "speedup_wall": f"{'≥' if lower_w else ''}{need_w / rel_w:.2f}",
            }
        )
    return rows


def plot(per_prompt, rows, args, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bon = [r for r in rows if r["method"].startswith("BoN")]
    sr = [r for r in rows if r["method"].startswith("SR")]
    ax.plot([r["rel_forwards"] for r in bon], [r["score"] for r in bon], "o-", label="Best-of-N")
    for r in sr:
        ax.plot(r["rel_forwards"], r["score"], "s", label=r["method"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"generator + reward token-forwards relative to Best-of-{min(args.n)}")
    ax.set_ylabel("score (paper's metric)")
    ax.set_title("Speculative Rejection vs Best-of-N (SmolLM2-135M)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.parent / f"{stem.name}_score_vs_compute.png", dpi=120)

    first = per_prompt[0]
    base = first["base_round"]
    fig, panels = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
    label = f"Best-of-{base['batch_size']}"
    for panel, key in zip(panels, ("batch_size", "kv_bytes", "step_ms"), strict=True):
        panel.step([0, base["end_token"]], [base[key]] * 2, where="post", label=label)
    for alpha, sr in first["sr"].items():
        log = sr["round_log"]
        edges = [r["start_token"] for r in log] + [log[-1]["end_token"]]
        series = {
            "batch_size": [r["live_rows"] for r in log],
            "kv_bytes": [r["kv_bytes"] for r in log],
            "step_ms": [1e3 * r["decode_s"] / max(r["steps"], 1) for r in log],
        }
        for panel, values in zip(panels, series.values(), strict=True):
            panel.step(edges, [*values, values[-1]], where="post", label=f"SR α={alpha}")
    panels[0].set_ylabel("live rows")
    panels[0].set_yscale("log", base=2)
    panels[1].set_ylabel("KV cache bytes")
    panels[2].set_ylabel("ms per decode step")
    panels[2].set_xlabel("generated tokens")
    panels[0].legend(fontsize=7)
    panels[0].set_title("One prompt: batch, KV memory and step time over decoding")
    fig.tight_layout()
    fig.savefig(stem.parent / f"{stem.name}_batch_and_memory.png", dpi=120)


if __name__ == "__main__":
    RESULTS.mkdir(exist_ok=True)
    main()
