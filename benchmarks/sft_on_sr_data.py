"""The README's worked example, end to end through the configs the CLI runs: Speculative Rejection data on
AlpacaFarm prompts (`configs/speculative_rejection_sft_data.yaml`), supervised fine-tuning of SmolLM2 on
the responses it chose (`configs/train/sft_speculative_rejection.yaml`), then Best-of-8 on held-out
prompts (`configs/best_of_n_alpaca.yaml`, alpaca_farm_100) with the model before and after, with the same
seed, so each prompt's samples before and after are drawn from the same random streams.

Reports, per model: the mean reward of every held-out sample, the mean Best-of-8 reward, and the paired
difference over prompts with its standard error; the wall time of every stage (model loads and compiles
included). Table on stdout, JSON + plot under benchmarks/results/. Stages resume from `--workdir` (a
finished stage is skipped, so remove it for a timing).

    python -m benchmarks.sft_on_sr_data [--train-prompts 96] [--eval-prompts 32]
        [--workdir out/sft_on_sr_data] [--name sft_on_sr_data] [--sft key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, table, write_result
from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.runner import run_job
from jaxsr.training import load_sft_config, sft

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def records(path: Path) -> list[dict[str, Any]]:
    """A job's records in prompt order (the first line of a job's JSONL is its header)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "samples" in r), key=lambda r: r["index"])


def rewards(path: Path) -> np.ndarray:
    """[prompts, samples] rewards of a Best-of-N job."""
    return np.array([[s["score"] for s in r["samples"]] for r in records(path)])


def paired(after: np.ndarray, before: np.ndarray) -> dict[str, float]:
    """Mean of after − before over prompts, its standard error, and the share of prompts that rose."""
    delta = after - before
    return {
        "mean": float(delta.mean()),
        "standard_error": float(delta.std(ddof=1) / np.sqrt(len(delta))) if len(delta) > 1 else float("nan"),
        "share_up": float((delta > 0).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-prompts", type=int, default=96)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--workdir", default="out/sft_on_sr_data")
    parser.add_argument("--name", default="sft_on_sr_data")
    parser.add_argument("--sft", nargs="*", default=[], help="overrides of the SFT config (key=value)")
    args = parser.parse_args()
    work = Path(args.workdir)
    walls: dict[str, float] = {}

    def stage(name: str, call):
        start = time.perf_counter()
        value = call()
        walls[name] = time.perf_counter() - start
        print(f"{name}: {walls[name]:.0f} s", flush=True)
        return value

    data = load_job_config(
        CONFIGS / "speculative_rejection_sft_data.yaml",
        [f"limit={args.train_prompts}", f"output={work / 'speculative_rejection.jsonl'}"],
    )
    stage("data: speculative rejection", lambda: run_job(data, build_solver))
    training = load_sft_config(
        CONFIGS / "train" / "sft_speculative_rejection.yaml",
        [f"data={data.output}", f"output_dir={work / 'sft'}", *args.sft],
    )
    final = stage("fine-tuning", lambda: sft(training))
    evaluations: dict[str, Path] = {}
    for label, model in (("before", training.model), ("after", str(final))):
        evaluation = load_job_config(
            CONFIGS / "best_of_n_alpaca.yaml",
            [
                f"model={model}",
                f"limit={args.eval_prompts}",
                f"max_new_tokens={data.max_new_tokens}",
                f"output={work / f'best_of_8_{label}.jsonl'}",
            ],
        )
        stage(f"held-out Best-of-{evaluation.n}, {label}", lambda e=evaluation: run_job(e, build_solver))
        evaluations[label] = Path(evaluation.output)

    scores = {label: rewards(path) for label, path in evaluations.items()}
    report = json.loads((Path(training.output_dir) / "sft.json").read_text())
    history = report["history"]
    rows = [
        {
            "model": label,
            "mean sample reward": float(s.mean()),
            "mean Best-of-8 reward": float(s.max(axis=1).mean()),
        }
        for label, s in scores.items()
    ]
    change = {
        "sample": paired(scores["after"].mean(axis=1), scores["before"].mean(axis=1)),
        "best_of_8": paired(scores["after"].max(axis=1), scores["before"].max(axis=1)),
    }
    print(table(rows, ["model", "mean sample reward", "mean Best-of-8 reward"]))
    print("training loss by step: " + ", ".join(f"{h['step']}: {h['loss']:.3f}" for h in history))
    for name, c in change.items():
        print(
            f"{name} reward after − before: {c['mean']:+.4f} ± {c['standard_error']:.4f} (s.e. over "
            f"{len(scores['after'])} prompts), up on {c['share_up']:.0%} of them"
        )
    total = sum(walls.values())
    print(f"total wall: {total / 60:.1f} min")
    plot(scores, history, args)
    path = write_result(
        args.name,
        {
            "args": vars(args),
            "data_config": dataclasses.asdict(data),
            "sft_config": report["config"],
            "sft_data": report["data"],
            "sft_history": history,
            "rows": rows,
            "change_after_minus_before": change,
            "wall_s": walls,
            "wall_s_total": total,
        },
    )
    print(f"wrote {path}")


def plot(scores: dict[str, np.ndarray], history: list[dict[str, Any]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.8))
    bins = np.linspace(min(s.min() for s in scores.values()), max(s.max() for s in scores.values()), 30)
    for label, s in scores.items():
        left.hist(s.ravel(), bins=bins, alpha=0.5, label=f"{label} (mean {s.mean():.3f})")
    left.set_xlabel("reward of a held-out sample")
    left.set_ylabel("samples")
    left.legend(fontsize=8)
    before, after = scores["before"].max(axis=1), scores["after"].max(axis=1)
    middle.scatter(before, after, s=14)
    bounds = [min(before.min(), after.min()), max(before.max(), after.max())]
    middle.plot(bounds, bounds, color="gray", linestyle="--", linewidth=1)
    middle.set_xlabel("Best-of-8 reward before")
    middle.set_ylabel("after fine-tuning")
    middle.set_title("one point per held-out prompt", fontsize=9)
    right.plot([h["step"] for h in history], [h["loss"] for h in history], "o-")
    right.set_xlabel("step")
    right.set_ylabel("loss of the step's batch (response tokens)")
    fig.suptitle(
        f"SR data on {args.train_prompts} AlpacaFarm prompts → SFT of SmolLM2 → "
        f"{args.eval_prompts} held-out prompts"
    )
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
