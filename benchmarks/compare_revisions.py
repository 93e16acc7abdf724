"""Two revisions of jaxsr side by side: the same workloads, alternating between the two in one run.

Each revision runs in a worker process of its own (the revision's tree first on PYTHONPATH, the older
one checked out with `git worktree`; the worker is this file, using only the public API). A worker
loads the models once and compiles each workload once (a warm-up call) before any timing. The parent
then alternates the workers workload by workload, A B in one pass and B A in the next, so that a
drifting shared CPU hits both alike; only one worker computes at a time. Per workload and revision
the fastest pass counts; the two must produce the same tokens and choices.

Workloads (those of `bench_generate` and `bench_sr_job`, smaller): `jaxsr.generate` of one prompt × N
samples × 128 tokens with EOS ignored; batched Best-of-8 and Speculative Rejection (α=0.5, first
segment 16, 4 prompts in flight, Best-of-8's KV memory) on AlpacaFarm prompts of the 64-token bucket,
64 new tokens, MiniLM relevance as the reward.

    python -m benchmarks.compare_revisions --old 2c94c50 [--passes 3] [--prompts 8] [--samples 8 64]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import table, write_result

ROOT = Path(__file__).resolve().parents[1]
BUCKET = 64


def workloads(args) -> list[str]:
    return [f"generate-{n}" for n in args.samples] + ["best_of_8", "speculative_rejection"]


# -- the worker: runs in each revision's process, using only the public API both revisions have --------
def serve(prompts_count: int) -> None:
    """Read workload names from stdin; answer each with one JSON line (seconds, digest of the tokens)."""
    import dataclasses

    import jaxsr
    from jaxsr.data import read_prompts
    from jaxsr.decoding.inputs import encode_prompts
    from jaxsr.ladder import bucket
    from jaxsr.loading.encoder import minilm_path
    from jaxsr.loading.gguf import smollm2_path

    lm = jaxsr.load_model(smollm2_path())
    endless = dataclasses.replace(lm, eos_token_ids=())  # equal work: every row generates all tokens
    reward = jaxsr.load_encoder(minilm_path())
    sampling = jaxsr.SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)
    in_bucket = (
        p for p in read_prompts("alpaca_farm_eval") if bucket(len(encode_prompts(lm, [p])[0])) == BUCKET
    )
    prompts = list(itertools.islice(in_bucket, prompts_count))
    common = dict(max_new_tokens=64, sampling=sampling, seed=0)

    def run(name: str) -> list:
        if name.startswith("generate-"):
            n = int(name.removeprefix("generate-"))
            return jaxsr.generate(
                endless, ["What are three tips for staying healthy?"], max_new_tokens=128, num_samples=n,
                sampling=sampling, seed=1,
            )  # fmt: skip
        if name == "best_of_8":
            return jaxsr.best_of_n(lm, reward, prompts, n=8, **common)
        budget = BUCKET + 8 * bucket(64)  # Best-of-8's KV slots
        return jaxsr.speculative_rejection(
            lm, reward, prompts, rejection_rate=0.5, memory_budget=budget, concurrent_prompts=4,
            min_first_segment=16, **common,
        )  # fmt: skip

    print(json.dumps({"ready": jaxsr.__file__}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        start = time.perf_counter()
        results = run(name)
        seconds = time.perf_counter() - start
        tokens = [[s.token_ids for s in r.samples] for r in results]
        chosen = [None if r.best is None else r.best.index for r in results]
        digest = hashlib.sha256(json.dumps([tokens, chosen]).encode()).hexdigest()[:16]
        print(json.dumps({"seconds": seconds, "digest": digest}), flush=True)


# -- the parent -----------------------------------------------------------------------------------------
class Worker:
    def __init__(self, tree: Path, prompts: int):
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(prompts)]
        self.process = subprocess.Popen(
            command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.loaded_from = self.read()["ready"]

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a worker ended early (see its error above)")
        return json.loads(line)

    def ask(self, name: str) -> dict:
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--old", help="the revision to compare the working tree against", required="--serve" not in sys.argv
    )
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="compare_revisions")
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve)
    old_commit = subprocess.run(
        ["git", "rev-parse", args.old], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    new_commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = Path(scratch) / "old"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old_tree), old_commit],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            compare(
                args,
                {"old": Worker(old_tree, args.prompts), "new": Worker(ROOT, args.prompts)},
                old_commit,
                new_commit,
            )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False)


def compare(args, workers: dict[str, Worker], old_commit: str, new_commit: str) -> None:
    names = workloads(args)
    for worker in workers.values():  # compile every workload once in each revision before timing
        for name in names:
            worker.ask(name)
    seconds = {(name, side): [] for name in names for side in workers}
    digests = {}
    for p in range(args.passes):
        for name in names:
            order = list(workers) if p % 2 == 0 else list(workers)[::-1]
            for side in order:
                answer = workers[side].ask(name)
                seconds[name, side].append(answer["seconds"])
                digests.setdefault(name, {})[side] = answer["digest"]
                print(f"pass {p + 1} {name} {side}: {answer['seconds']:.2f} s", flush=True)
    for worker in workers.values():
        worker.close()
    rows = []
    for name in names:
        old, new = min(seconds[name, "old"]), min(seconds[name, "new"])
        rows.append(
            {
                "workload": name,
                "old_s": old,
                "new_s": new,
                "new_vs_old": new / old,
                "old_each_pass": seconds[name, "old"],
                "new_each_pass": seconds[name, "new"],
                "same_tokens": digests[name]["old"] == digests[name]["new"],
            }
        )
    print(table(rows, ["workload", "old_s", "new_s", "new_vs_old", "same_tokens"]))
    path = write_result(args.name, {"old": old_commit, "new": new_commit, "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
