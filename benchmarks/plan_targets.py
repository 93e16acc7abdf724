"""Plan one job for several accelerator targets, each a fresh `jaxsr plan` process, and time it.

Each target is planned in its own process (as a user runs `jaxsr plan`), XLA's persistent compilation
cache off so that every program compiles; the plans go to `benchmarks/results/plans/<name>_<target>.json`
and a summary with each plan's wall time to `benchmarks/results/plans/<name>.json`.

    python -m benchmarks.plan_targets configs/speculative_rejection_gemma2_9b.yaml --name gemma2_9b_sr \\
        --target h100x8 --target v5e-8:mesh_model=4 --target v6e-8 --target v5p-8

A target is a `jaxsr plan --target` name, optionally with `:key=value,...` overrides of the job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import RESULTS, table, write_result

GIB = 2**30


def plan_one(config: str, name: str, spec: str) -> dict[str, Any]:
    """Plan `config` for the target `spec` (`v5e-8:key=value,...`) in a fresh process: the plan's
    JSON, the command and its wall time."""
    target, _, overrides = spec.partition(":")
    tag = spec.replace(":", "_").replace(",", "_").replace("=", "-")
    out = RESULTS / "plans" / f"{name}_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    job = [config, "--target", target, *filter(None, overrides.split(","))]
    command = ["jaxsr", "plan", *job, "--json", os.path.relpath(out)]
    env = {**os.environ, "JAXSR_CACHE_DIR": "off"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    plan = json.loads(out.read_text())
    out.write_text(
        json.dumps({"command": " ".join(command), "wall_s_to_plan": seconds, "plan": plan}, indent=2)
    )
    return {
        "spec": spec,
        "command": " ".join(command),
        "seconds": seconds,
        "plan": plan,
        "printed": done.stdout,
    }


def row(result: dict[str, Any]) -> dict[str, Any]:
    """A summary row of one target's plan."""
    plan = result["plan"]
    peaks, usable = plan["peak_bytes"], plan["target"]["usable_bytes"]
    loops = {name: peak for name, peak in peaks.items() if name.startswith("decode_loop")}
    highest = max(loops, key=loops.get)
    return {
        "target": result["spec"],
        "mesh": f"{plan['mesh']['data']} × {plan['mesh']['model']}",
        "first batch": plan["rows"],
        "token loop peak (GiB)": f"{loops[highest] / GIB:.1f} of {usable / GIB:.2f} ({highest})",
        "compaction peak (GiB)": f"{peaks['compact'] / GIB:.1f}" if "compact" in peaks else "",
        "tokens/s": f"{plan['decode_step']['job_tokens_per_s']:,.0f}",
        "minutes to plan": round(result["seconds"] / 60, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--name", required=True)
    parser.add_argument("--target", action="append", required=True, metavar="TARGET[:key=value,...]")
    args = parser.parse_args()
    results = [plan_one(args.config, args.name, spec) for spec in args.target]
    for result in results:
        print(result["printed"])
    rows = [row(r) for r in results]
    total = sum(r["seconds"] for r in results)
    print(table(rows, list(rows[0])))
    print(f"\n{len(results)} targets planned in {total / 60:.1f} minutes")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the environment's record: no libtpu in this process
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "commit": commit,
        "config": args.config,
        "targets": rows,
        "total_s": total,
        "commands": [r["command"] for r in results],
    }
    write_result(f"plans/{args.name}", summary)


if __name__ == "__main__":
    main()
