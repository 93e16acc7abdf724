"""The `jaxsr` command: `jaxsr run CONFIG.yaml [key=value ...]`, `jaxsr report OUTPUT.jsonl`,
`jaxsr export OUTPUT.jsonl --sft PATH --preference PATH`,
`jaxsr demo [--prompts K ...]`, `jaxsr train sft|distill CONFIG.yaml [key=value ...]`,
`jaxsr plan CONFIG.yaml --target v5e-8 [key=value ...]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

# Parsing and `--help` import no jax: each command imports what it runs inside its own functions (jax,
# and transformers where a model is read, take seconds to import).

TRAINERS = {
    "sft": ("supervised fine-tuning on the chosen responses of a results JSONL", "SFTConfig",
            "the fine-tuned model's directory"),
    "distill": ("distil a draft/amateur from a teacher's own samples", "DistillConfig",
                "the draft's directory"),
}  # fmt: skip
"""`jaxsr train STAGE`: (help, config class, what it prints)."""
PAIRS = ("best_vs_worst", "best_vs_random")
"""`jaxsr export --pairs`: `jobs.export.PAIRS` written out, since importing that module imports jax (a
test holds the two equal)."""


def join_processes(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process job (`jax.distributed`); the arguments are auto-detected on TPU pods and
    SLURM/MPI clusters when left out."""
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    except (ValueError, RuntimeError, IndexError) as e:  # what jax raises for an unusable address
        raise ValueError(f"--coordinator/--num-processes/--process-id: cannot join ({e})") from None


def use_compilation_cache() -> None:
    """Keep XLA's compiled programs across runs in `~/.cache/jaxsr/xla` (a second `jaxsr demo`, or a
    job resumed after a kill, skips most compilation), unless JAX_COMPILATION_CACHE_DIR names another
    place or JAXSR_CACHE_DIR is off. An entry that cannot be written (a full disk) or read (one a full
    disk cut short) is skipped without a warning per program: the run needs no cache (it compiles
    instead), and a file it does need names the problem itself."""
    import jax

    from jaxsr.loading.param_cache import cache_root

    if jax.config.jax_compilation_cache_dir is None and cache_root() is not None:
        jax.config.update("jax_compilation_cache_dir", str(Path.home() / ".cache" / "jaxsr" / "xla"))
    warnings.filterwarnings("ignore", message="Error (writing|reading) persistent compilation cache entry")


class _Parser(argparse.ArgumentParser):
    """argparse, its usage errors one line naming the bad argument (not the usage block), exit code 2;
    subcommands' parsers are of this class too (`add_subparsers` makes them so)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if kwargs.get("nargs") == "*":  # else argparse lists `key=value` among the missing arguments
            kwargs.setdefault("default", [])
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def run(config_path: str | None, overrides: list[str], progress: bool = True) -> Path:
    """Run a job; process 0 then writes its report beside the output. Returns the output's path."""
    import jax

    from jaxsr.jobs.config import load_job_config
    from jaxsr.jobs.methods import build_solver
    from jaxsr.jobs.report import write_report
    from jaxsr.jobs.runner import run_job

    config = load_job_config(config_path, overrides)
    output = run_job(config, build_solver, progress=progress)
    if jax.process_index() == 0:
        print(f"report: {write_report(output)}", file=sys.stderr)
    return output


def report(output: str, directory: str | None) -> Path:
    """Print a job output's summary table and write its report (plots and one HTML page)."""
    from jaxsr.jobs.report import summarize, write_report

    print(summarize(output).table())
    return write_report(output, directory)


def plan(
    config_path: str, overrides: list[str], target_name: str, json_path: str | None, **planning: Any
) -> str:
    """A job's plan for a TPU slice or a GPU host as a table (and as JSON at `json_path`); `planning`:
    `plan_job`'s prompt_tokens, layers and all_rungs."""
    from jaxsr.jobs.config import load_job_config
    from jaxsr.plans import plan_dict, plan_job, plan_table, target

    quiet_libtpu(target_name)
    job = plan_job(load_job_config(config_path, overrides), target(target_name), **planning)
    if json_path is not None:
        Path(json_path).expanduser().write_text(json.dumps(plan_dict(job), indent=2) + "\n")
    return plan_table(job)


def quiet_libtpu(target_name: str) -> None:
    """Name a TPU host for libtpu before jax starts it (a plan on a machine without TPUs): else libtpu
    looks for one and prints a page of warnings (`plans.targets` does the same where it starts it)."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", str(target_name))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="jaxsr", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_report, _add_export, _add_demo, _add_train, _add_plan):
        add(commands)
    args, extra = parser.parse_known_args(argv)
    with_overrides = ("run", "train", "plan")
    unknown = [i for i in extra if args.command not in with_overrides or "=" not in i or i.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in with_overrides:
        args.overrides += extra  # key=value items given after an option
    use_compilation_cache()
    try:
        args.handle(args)
    # OSError: a file or hub download that fails; ImportError: an optional package it needs (a plan's)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"jaxsr: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was written stays complete, and a re-run resumes
        print("jaxsr: interrupted", file=sys.stderr)
        return 130
    return 0


def _add_run(commands: Any) -> None:
    parser = commands.add_parser("run", help="run a job from a YAML config")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--no-progress", action="store_true")
    hosts = parser.add_argument_group(
        "several hosts", "each process decodes a block of the prompts; process 0 merges the outputs"
    )
    hosts.add_argument("--distributed", action="store_true", help="join with jax.distributed.initialize()")
    hosts.add_argument("--coordinator", help="host:port of process 0 (these three imply --distributed)")
    hosts.add_argument("--num-processes", type=int)
    hosts.add_argument("--process-id", type=int)
    parser.set_defaults(handle=_run_command)


def _run_command(args: argparse.Namespace) -> None:
    joined = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed or any(x is not None for x in joined):
        join_processes(*joined)
    print(run(args.config, args.overrides, progress=not args.no_progress))


def _add_report(commands: Any) -> None:
    parser = commands.add_parser(
        "report",
        help="a job output's summary table, plots and one self-contained HTML page",
        description="Prints the summary and the page's path; the plots and report.html go to --dir.",
    )
    parser.add_argument("output", help="a job's output JSONL")
    parser.add_argument("--dir", metavar="DIR", help="where to write (default: OUTPUT's stem + .report/)")
    parser.set_defaults(handle=lambda args: print(report(args.output, args.dir)))


def _add_export(commands: Any) -> None:
    parser = commands.add_parser(
        "export",
        help="SFT and preference sets (TRL's conversational layouts) from a job's output",
        description="Prints what each set got. A set with no row is refused and nothing is written.",
    )
    parser.add_argument("output", help="a job's output JSONL")
    parser.add_argument(
        "--sft", metavar="PATH", help="write each prompt's conversation and best response (`messages`)"
    )
    parser.add_argument(
        "--preference", metavar="PATH", help="write `prompt` / `chosen` / `rejected` pairs, with their scores"
    )
    parser.add_argument(
        "--pairs",
        choices=PAIRS,
        default=PAIRS[0],
        help="the best against the worst (default) or another at random",
    )
    parser.add_argument(
        "--min-margin",
        type=float,
        default=0.0,
        help="keep pairs whose score margin is at least this (and > 0)",
    )
    parser.add_argument(
        "--keep-truncated",
        action="store_true",
        help="also answer and choose with responses cut at max_new_tokens (default: the best finished one)",
    )
    parser.add_argument("--seed", type=int, default=0, help="best_vs_random's draws (default 0)")
    parser.set_defaults(handle=_export_command)


def _export_command(args: argparse.Namespace) -> None:
    from jaxsr.jobs.export import export

    for written in export(
        args.output, sft=args.sft, preference=args.preference, pairs=args.pairs,
        min_margin=args.min_margin, keep_truncated=args.keep_truncated, seed=args.seed,
    ):  # fmt: skip
        print(written.summary())


def _add_demo(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="Best-of-N vs Speculative Rejection and SCD vs CD on a few prompts with the embedded models",
        description="Measured in the run: a table, a JSONL of the records and a plot under --output-dir.",
    )
    parser.add_argument("--prompts", type=int, default=3, metavar="K", help="AlpacaFarm prompts (default 3)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="T", help="new tokens per answer (default 64)"
    )
    parser.add_argument(
        "--n", type=int, nargs="+", default=[2, 8, 16], help="Best-of-N sizes (default 2 8 16)"
    )
    parser.add_argument("--rejection-rate", type=float, default=0.5, metavar="α", help="SR's α (default 0.5)")
    parser.add_argument("--gamma", type=int, default=1, metavar="γ", help="SCD's draft length γ (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="out/demo", metavar="DIR", help="default out/demo")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handle=_demo_command)


def _demo_command(args: argparse.Namespace) -> None:
    from jaxsr.jobs.demo import run_demo

    run_demo(
        args.output_dir, prompts=args.prompts, max_new_tokens=args.max_new_tokens, ns=args.n,
        rejection_rate=args.rejection_rate, gamma=args.gamma, seed=args.seed,
        progress=not args.no_progress,
    )  # fmt: skip


def _add_train(commands: Any) -> None:
    parser = commands.add_parser("train", help="fine-tune a model on a job's results, or distil a draft")
    stages = parser.add_subparsers(dest="stage", required=True)
    for stage, (what, config_class, prints) in TRAINERS.items():
        stage_parser = stages.add_parser(
            stage,
            help=what,
            description=f"Keys: the fields of jaxsr.training.{config_class}. Prints {prints}.",
        )
        stage_parser.add_argument("config")
        stage_parser.add_argument("overrides", nargs="*", metavar="key=value")
        stage_parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handle=_train_command)


def _train_command(args: argparse.Namespace) -> None:
    from jaxsr import training

    load, train = {
        "sft": (training.load_sft_config, training.sft),
        "distill": (training.load_distill_config, training.distill),
    }[args.stage]
    print(train(load(args.config, args.overrides), progress=not args.no_progress))


def _add_plan(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="will a job fit a TPU slice or a GPU host? its programs compiled for it on this CPU machine",
        description="Compiles the job's programs for the target from its models' configs alone (no "
        "weights, no accelerator) at the batch jaxsr would pick there, and prints per device: "
        "parameters, KV per row, each program's peak against the chip's memory, the collectives of a "
        "decode step, and a roofline step time (a lower bound).",
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument(
        "--target",
        required=True,
        help="a Cloud TPU slice (v5e-8, v6e-16, v5p-8, v4-8, ...; several hosts: one host's job process "
        "is planned) or NVIDIA GPUs: h100x8, h200x8, a100-80x8 (x1, x2, x4 too; x16: two hosts of 8)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, metavar="T", help="prompt length planned for (default 128)"
    )
    parser.add_argument("--layers", type=int, metavar="L", help="cut every model to L layers (a quick look)")
    parser.add_argument(
        "--all-rungs",
        action="store_true",
        help="compile every Speculative Rejection rung's decode loop (by default a rung whose rows and "
        "cache slots a mix of two compiled rungs' covers is left out: it needs no more memory)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON too")
    parser.set_defaults(handle=_plan_command)


def _plan_command(args: argparse.Namespace) -> None:
    planning = {"prompt_tokens": args.prompt_tokens, "layers": args.layers, "all_rungs": args.all_rungs}
    print(plan(args.config, args.overrides, args.target, args.json, **planning))


def entry() -> None:
    """The `jaxsr` command: `main`, then the process ends at once. Everything was written and closed
    by then; tearing down XLA's compiled programs and threads took 1.5 s after an 805-prompt job."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
