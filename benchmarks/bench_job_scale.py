"""A dataset job at scale, an older revision and the working tree side by side in one run.

1. Jobs over every AlpacaFarm evaluation prompt (805) with the shipped SmolLM2 draft: `generate`, 4
   new tokens, one sample (prefill is most of the work); `best_of_8`, 8 samples of up to 128 tokens
   (EOS on, so lengths vary) scored by the MiniLM relevance reward; and `generate_eos`, SmolLM2-135M
   itself answering the first 256 prompts once in up to 256 tokens (it ends most answers itself, at
   lengths from a few tokens to the budget: where continuous batching shows). Each revision runs each
   job `--passes` (`--best-of-8-passes`, `--eos-passes`) times as a fresh `jaxsr run`, alternating
   (A B, then B A); per revision the fastest pass counts. Reported: wall time, seconds per prompt, peak
   RSS of the process, the prefill padding ratio (prompt positions run ÷ real prompt tokens; the older
   revision's from its batching rule: file order, 64 rows a batch, each padded to the longest's
   power-of-two bucket), the share of decode row-steps that advanced no row (`idle`: rows done or
   padding, run because shapes are fixed), the responses' mean length and the share that ran to the
   token budget, the share of prompts for which both wrote the same token ids (floats differ with the
   batch's shape, so a sampled token can flip where two are near-tied), whether both chose the same
   best sample, and the mean best reward.
2. Resuming a finished output: `--resume-records` synthetic records of ~6 KB (a Best-of-16 record at a
   few hundred tokens), each revision's `JsonlOutput` reading it in a fresh process: seconds and the
   peak RSS it adds over the process after its imports (VmHWM).

A plot beside the JSON compares the two revisions' wall time, peak RSS and padding per job and the
resume's added RSS; `--replot` draws it again from the saved JSON without running anything.

    python -m benchmarks.bench_job_scale --old 2c94c50 [--jobs generate best_of_8 generate_eos]
        [--passes 2] [--best-of-8-passes 1] [--eos-passes 1] [--resume-records 100000]
    python -m benchmarks.bench_job_scale --replot [--name job_scale]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, table, write_result

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "generate": {
        "method": "generate",
        "model": "smollm2-draft",
        "data": "alpaca_farm_eval",
        "max_new_tokens": 4,
        "num_samples": 1,
        "seed": 0,
    },
    "best_of_8": {
        "method": "best_of_n",
        "model": "smollm2-draft",
        "reward": "minilm",
        "data": "alpaca_farm_eval",
        "n": 8,
        "max_new_tokens": 128,
        "temperature": 1.0,
        "top_k": 50,
        "seed": 0,
    },
    "generate_eos": {
        "method": "generate",
        "model": "smollm2",
        "data": "alpaca_farm_eval",
        "limit": 256,
        "max_new_tokens": 256,
        "num_samples": 1,
        "temperature": 1.0,
        "top_k": 50,
        "seed": 0,
    },
}
RESUME = """
import sys, time
from jaxsr.jobs.config import JobConfig
from jaxsr.jobs.runner import JsonlOutput
def peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
before = peak_kib()
start = time.perf_counter()
done = JsonlOutput(sys.argv[1], JobConfig(output=sys.argv[1])).done
print(len(done), time.perf_counter() - start, peak_kib() - before)
"""
LENGTHS = """
import json, sys
from jaxsr.data import read_prompts
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.loading.resolve import resolve_model
job = json.loads(sys.argv[1])
prompts = read_prompts(job["data"])[: job.get("limit")]
print(json.dumps([len(ids) for ids in encode_prompts(resolve_model(job["model"], "float32"), prompts)]))
"""


def run_child(command: list[str], tree: Path) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in bytes, stdout) of a command run with `tree` first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(tree), "JAXSR_CACHE_DIR": "off"}
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"{command} failed in {tree}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024, out


def tokens_by_index(output: Path) -> dict[int, list[list[int]]]:
    records = (json.loads(line) for line in output.read_text().splitlines())
    return {r["index"]: [s["token_ids"] for s in r["samples"]] for r in records}


def padding(output: Path) -> float | None:
    """Prompt positions run ÷ real prompt tokens, from the records' stats (None where they lack them)."""
    stats = [json.loads(line)["stats"] for line in output.read_text().splitlines()]
    if "prefill_positions" not in stats[0]:
        return None
    return sum(s["prefill_positions"] for s in stats) / sum(s["prompt_tokens"] for s in stats)


def prompt_lengths(job: dict) -> list[int]:
    """The job's prompts' token counts, as its generator encodes them (in a child process, so this one
    stays small: a child's peak RSS as the kernel reports it starts at its parent's)."""
    _, _, out = run_child([sys.executable, "-c", LENGTHS, json.dumps(job)], ROOT)
    return json.loads(out)


def file_order_padding(job: dict, lengths: list[int]) -> float:
    """The older revision's prefill padding: 64 rows a batch in file order, each batch padded to a
    power of two of prompts and to the longest prompt's power-of-two bucket."""
    from jaxsr.ladder import bucket

    per_batch, positions = 64 // job.get("n", job.get("num_samples", 1)), 0
    for start in range(0, len(lengths), per_batch):
        batch = lengths[start : start + per_batch]
        positions += min(bucket(len(batch), 1), per_batch) * bucket(max(batch))
    return positions / sum(lengths)


def idle(output: Path, prefill_positions: float) -> float:
    """The share of decode row-steps that advanced no row: every row's steps (the generator's token
    positions less the prompts' `prefill_positions`) against the steps that committed a token (each
    row's tokens but the first, which the prefill's logits give; a finished row also committed its
    stop token)."""
    records = [json.loads(line) for line in output.read_text().splitlines()]
    steps = sum(r["stats"]["token_forwards"]["generator"] for r in records) - prefill_positions
    useful = sum(len(s["token_ids"]) + s["finished"] - 1 for r in records for s in r["samples"])
    return 1 - useful / steps


def lengths_at_budget(output: Path, budget: int) -> tuple[float, float]:
    """The responses' mean token count and the share of them that ran to the budget unfinished."""
    samples = [s for line in output.read_text().splitlines() for s in json.loads(line)["samples"]]
    at_budget = sum(not s["finished"] and len(s["token_ids"]) >= budget for s in samples)
    return sum(len(s["token_ids"]) for s in samples) / len(samples), at_budget / len(samples)


def best_of(output: Path) -> tuple[dict[int, int | None], float | None]:
    """Each prompt's chosen sample index, and the mean best reward (None without rewards)."""
    records = [json.loads(line) for line in output.read_text().splitlines()]
    chosen = {r["index"]: (r["best"] or {}).get("index") for r in records}
    scores = [r["best"]["score"] for r in records if r.get("best") and r["best"].get("score") is not None]
    return chosen, (sum(scores) / len(scores) if scores else None)


def job_side_by_side(trees: dict[str, Path], scratch: Path, passes: int, name: str) -> list[dict]:
    job = JOBS[name]
    walls = {side: [] for side in trees}
    rss, outputs = {}, {}
    for p in range(passes):
        for side in list(trees) if p % 2 == 0 else list(trees)[::-1]:
            output = scratch / f"{name}-{side}-{p}.jsonl"
            config = scratch / f"{name}-{side}-{p}.yaml"
            config.write_text(yaml.safe_dump({**job, "output": str(output)}))
            command = [sys.executable, "-m", "jaxsr.cli", "run", str(config), "--no-progress"]
            seconds, peak, _ = run_child(command, trees[side])
            walls[side].append(seconds)
            rss[side] = max(rss.get(side, 0), peak)
            outputs[side] = output
            print(f"{name} pass {p + 1} {side}: {seconds:.1f} s, peak RSS {peak / 2**30:.2f} GiB", flush=True)
    tokens = {side: tokens_by_index(outputs[side]) for side in trees}
    same = sum(tokens["new"].get(i) == ids for i, ids in tokens["old"].items()) / len(tokens["old"])
    chosen = {side: best_of(outputs[side]) for side in trees}
    lengths = prompt_lengths(job)
    paddings = {side: padding(outputs[side]) or file_order_padding(job, lengths) for side in trees}
    responses = {side: lengths_at_budget(outputs[side], job["max_new_tokens"]) for side in trees}
    rows = []
    for side in trees:
        wall = min(walls[side])
        rows.append(
            {
                "job": f"{name} × {len(lengths)}, {side}",
                "wall_s": wall,
                "s_per_prompt": wall / len(lengths),
                "wall_vs_old": wall / min(walls["old"]),
                "padding": paddings[side],
                "idle": idle(outputs[side], paddings[side] * sum(lengths)),
                "peak_rss_gib": rss[side] / 2**30,
                "mean_tokens": responses[side][0],
                "at_budget": responses[side][1],
                "same_tokens": same,
                "same_choices": chosen[side][0] == chosen["old"][0],
                "mean_best_reward": chosen[side][1],
                "walls": walls[side],
            }
        )
    return rows


def resume_side_by_side(trees: dict[str, Path], scratch: Path, records: int) -> list[dict]:
    from jaxsr.jobs.config import JobConfig
    from jaxsr.jobs.runner import job_file

    output = scratch / "synthetic.jsonl"
    config = JobConfig(output=str(output))
    job_file(output).write_text(json.dumps({"jaxsr_job": config.fingerprint(), "config": {}}))
    text = "x" * 6000
    with output.open("w") as f:
        for i in range(records):
            f.write(json.dumps({"index": i, "prompt": f"prompt {i}", "samples": [{"text": text}]}) + "\n")
    rows = []
    for side, tree in trees.items():
        _, _, out = run_child([sys.executable, "-c", RESUME, str(output)], tree)
        count, seconds, added = out.split()
        assert int(count) == records
        rows.append(
            {
                "job": f"resume {records} records ({output.stat().st_size / 2**30:.2f} GiB), {side}",
                "wall_s": float(seconds),
                "added_rss_mib": int(added) / 1024,
            }
        )
        print(rows[-1], flush=True)
    output.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", help="the revision to compare the working tree against")
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    parser.add_argument("--passes", type=int, default=2, help="of the generate job")
    parser.add_argument(
        "--best-of-8-passes", type=int, default=1, help="of the Best-of-8 job (~10 min a run)"
    )
    parser.add_argument("--eos-passes", type=int, default=1, help="of the generate_eos job")
    parser.add_argument("--resume-records", type=int, default=100_000)
    parser.add_argument("--name", default="job_scale")
    parser.add_argument("--replot", action="store_true", help="only draw the plot from the saved JSON")
    args = parser.parse_args()
    if args.replot:
        print(f"wrote {plot(json.loads((RESULTS / f'{args.name}.json').read_text()), args.name)}")
        return
    if args.old is None:
        parser.error("--old is required (or --replot)")
    git = ["git", "-C", str(ROOT)]
    old = subprocess.run(
        [*git, "rev-parse", args.old], capture_output=True, text=True, check=True
    ).stdout.strip()
    new = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = Path(scratch) / "old"
        subprocess.run(
            [*git, "worktree", "add", "--detach", str(old_tree), old], check=True, capture_output=True
        )
        try:
            trees = {"old": old_tree, "new": ROOT}
            passes = {
                "generate": args.passes,
                "best_of_8": args.best_of_8_passes,
                "generate_eos": args.eos_passes,
            }
            jobs = [
                row
                for name in args.jobs
                for row in job_side_by_side(trees, Path(scratch), passes[name], name)
            ]
            resumes = resume_side_by_side(trees, Path(scratch), args.resume_records)
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(old_tree)], check=False)
    print(
        table(
            jobs,
            [
                "job",
                "wall_s",
                "s_per_prompt",
                "wall_vs_old",
                "padding",
                "idle",
                "peak_rss_gib",
                "mean_tokens",
                "at_budget",
                "same_tokens",
                "same_choices",
                "mean_best_reward",
            ],
        )
    )
    print(table(resumes, ["job", "wall_s", "added_rss_mib"]))
    result = {"old": old, "new": new, "args": vars(args), "jobs": jobs, "resumes": resumes}
    print(f"wrote {write_result(args.name, result)} and {plot(result, args.name)}")


def plot(result: dict, name: str) -> Path:
    """Old revision against the working tree: each job's wall time, peak RSS and prefill padding, and
    the RSS a resume adds, as paired bars (the old revision's short hash against "this tree")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = {"old": f"{result['old'][:7]}", "new": "this tree"}
    jobs = list(dict.fromkeys(row["job"].rsplit(", ", 1)[0] for row in result["jobs"]))
    by = {(row["job"].rsplit(", ", 1)[0], row["job"].rsplit(", ", 1)[1]): row for row in result["jobs"]}
    panels = [("wall_s", "wall seconds"), ("peak_rss_gib", "peak RSS, GiB"), ("padding", "prefill padding")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(15, 4))
    width = 0.38
    for ax, (key, label) in zip(axes, panels, strict=False):
        for k, (side, tag) in enumerate(sides.items()):
            values = [by[(job, side)][key] or 0.0 for job in jobs]
            bars = ax.bar([i + (k - 0.5) * width for i in range(len(jobs))], values, width, label=tag)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(jobs)), [job.replace(" × ", "\n× ") for job in jobs], fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    resumes = result["resumes"]
    bars = axes[-1].bar(
        [sides[row["job"].rsplit(", ", 1)[1]] for row in resumes], [row["added_rss_mib"] for row in resumes]
    )
    axes[-1].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[-1].set_ylabel("RSS a resume adds, MiB")
    axes[-1].set_title(resumes[0]["job"].rsplit(", ", 1)[0], fontsize=8)
    fig.suptitle(f"dataset jobs: {sides['old']} against this tree (one run, this machine)")
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
