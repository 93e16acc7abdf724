"""The `jaxsr` command: `jaxsr run CONFIG.yaml [key=value ...]`, `jaxsr demo`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.runner import run_job

DEMO_OVERRIDES = [
    "method=speculative_rejection",
    "model=smollm2",
    "reward=minilm",
    "data=alpaca_farm_100",
    "limit=2",
    "max_new_tokens=48",
    "rejection_rate=0.5",
    "memory_budget=1024",
    "output=out/demo.jsonl",
]


def join_processes(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process job (`jax.distributed`); the arguments are auto-detected on TPU pods and
    SLURM/MPI clusters when left out."""
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def run(config_path: str | None, overrides: list[str], progress: bool = True) -> Path:
    config = load_job_config(config_path, overrides)
    solve, per_call = build_solver(config)
    return run_job(config, solve, prompts_per_call=per_call, progress=progress)


def demo(overrides: list[str]) -> None:
    path = run(None, [*DEMO_OVERRIDES, *overrides])
    for line in path.read_text().splitlines()[1:]:
        record = json.loads(line)
        best = record["best"] or record["samples"][0]
        stats = record["stats"]
        print(f"\n### {record['prompt'][:200]}\n{best['text']}")
        if "batch_sizes" in stats:
            rows, score, wall = stats["batch_sizes"], best["score"], stats["wall_s"]
            print(f"[live rows per round {rows}, reward {score:.3f}, {wall:.1f} s]")
    print(f"\nrecords: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxsr", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run a job from a YAML config")
    run_parser.add_argument("config")
    run_parser.add_argument("overrides", nargs="*", metavar="key=value")
    run_parser.add_argument("--no-progress", action="store_true")
    hosts = run_parser.add_argument_group(
        "several hosts", "each process decodes a block of the prompts; process 0 merges the outputs"
    )
    hosts.add_argument("--distributed", action="store_true", help="join with jax.distributed.initialize()")
    hosts.add_argument("--coordinator", help="host:port of process 0 (these three imply --distributed)")
    hosts.add_argument("--num-processes", type=int)
    hosts.add_argument("--process-id", type=int)
    demo_parser = commands.add_parser("demo", help="run the embedded default job")
    demo_parser.add_argument("overrides", nargs="*", metavar="key=value")
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extra  # key=value items given after an option
    try:
        if args.command == "run":
            joined = (args.coordinator, args.num_processes, args.process_id)
            if args.distributed or any(x is not None for x in joined):
                join_processes(args.coordinator, args.num_processes, args.process_id)
            print(run(args.config, args.overrides, progress=not args.no_progress))
        else:
            demo(args.overrides)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxsr: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
