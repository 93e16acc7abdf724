"""A distillation run's record as a benchmark result: `OUTPUT_DIR/distill.json` with this machine's
environment and the command that ran it, under benchmarks/results/NAME.json, and the curve of λ
(raw and at the sampling's top-k) against the response tokens trained on, NAME.png.

    python -m benchmarks.report_distill OUTPUT_DIR --name NAME --run-command "jaxsr train distill ..."
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS, write_result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--name", required=True)
    parser.add_argument("--run-command", required=True, help="the command that produced OUTPUT_DIR")
    args = parser.parse_args()
    report = json.loads((Path(args.output_dir) / "distill.json").read_text())
    path = write_result(args.name, {"run_command": args.run_command, **report})
    print(f"wrote {path}")
    plot(report, args.name)


def plot(report: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = report["history"]
    tokens = [h["tokens"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key in [k for k in history[0] if k.startswith("lambda")]:
        ax.plot(tokens, [h[key] for h in history], "o-", label=key.replace("lambda", "λ").replace("_", " "))
    ax.set_xlabel("training tokens (the history's `tokens`)")
    ax.set_ylabel("acceptance rate λ on held-out responses")
    c = report.get("cost_ratio")
    ax.set_title(f"draft of {report['config']['teacher']}" + (f", c = {c:.3f}" if c else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
