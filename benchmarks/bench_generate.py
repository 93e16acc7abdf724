"""jaxsr.generate vs Hugging Face generate (PyTorch) on SmolLM2-135M-Instruct, side by side.

One prompt × N samples × 128 new tokens (EOS ignored so both do the same work), float32, top_k=50,
T=1. Reports tokens/s and the ratio, jaxsr's compile time separately, and jaxsr's decode step against
a lower bound from this machine's measured matmul throughput and memory bandwidth. The two sides
alternate, `--repeats` calls each per N, and each keeps its fastest: the shared CPU drifts over minutes.

    python -m benchmarks.bench_generate [--samples 1 8 32 64] [--new-tokens 128] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp

import jaxsr
from benchmarks.common import table, write_result
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.loading.gguf import smollm2_path

PROMPT = "What are three tips for staying healthy?"


def measure_machine(threads: int) -> dict[str, float]:
    """Peak f32 GEMM FLOP/s (2048³ jitted matmul) and read bandwidth (sum over 512 MiB)."""
    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(5):
        mm(a).block_until_ready()
    flops = 5 * 2 * 2048**3 / (time.perf_counter() - t)
    big = jnp.ones((128 * 2**20,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(big).block_until_ready()
    t = time.perf_counter()
    for _ in range(5):
        total(big).block_until_ready()
    bandwidth = 5 * big.nbytes / (time.perf_counter() - t)
    return {"gemm_flops": flops, "read_bytes_per_s": bandwidth}


def step_lower_bound(lm: jaxsr.Model, rows: int, context: int, machine: dict[str, float]) -> float:
    """Seconds one decode step needs at least: max(matmul FLOPs / peak, bytes read / bandwidth)."""
    cfg = lm.config
    params = sum(x.size for x in jax.tree.leaves(lm.params))
    matmul_params = params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    kv = cfg.kv_bytes_per_token(4) * context * rows
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * rows
    flops = 2 * matmul_params * rows + attention_flops
    bytes_read = params * 4 + kv
    return max(flops / machine["gemm_flops"], bytes_read / machine["read_bytes_per_s"])


def time_jaxsr(lm: jaxsr.Model, n: int, new_tokens: int, sampling: jaxsr.SamplingConfig, seed: int) -> float:
    t = time.perf_counter()
    out = jaxsr.generate(lm, [PROMPT], max_new_tokens=new_tokens, num_samples=n, sampling=sampling, seed=seed)
    assert all(len(s.token_ids) == new_tokens for s in out[0].samples)
    return time.perf_counter() - t


def time_hf(model, input_ids, n: int, new_tokens: int) -> float:
    import torch

    batch = input_ids.repeat(n, 1)
    options = dict(do_sample=True, top_k=50, top_p=1.0, temperature=1.0)
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        seconds = time.perf_counter() - t
    assert out.shape[1] == batch.shape[1] + new_tokens
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side and N (fastest kept)")
    parser.add_argument("--name", default="generate_vs_hf")
    args = parser.parse_args()

    gguf = smollm2_path()
    lm = jaxsr.load_model(gguf)
    lm = dataclasses.replace(lm, eos_token_ids=())  # equal work: every row generates all tokens
    sampling = jaxsr.SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)
    machine = measure_machine(args.threads)
    hf = ids = None
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        ids = torch.tensor([encode_prompts(lm, [PROMPT])[0]])

    rows = []
    prompt_len = len(encode_prompts(lm, [PROMPT])[0])
    for n in args.samples:
        first = time_jaxsr(lm, n, args.new_tokens, sampling, seed=0)  # compiles
        if hf is not None:
            time_hf(hf, ids, n, 4)  # warm-up
        ours, theirs = [], []
        for repeat in range(args.repeats):
            ours.append(time_jaxsr(lm, n, args.new_tokens, sampling, seed=1 + repeat))
            if hf is not None:
                theirs.append(time_hf(hf, ids, n, args.new_tokens))
        seconds = min(ours)
        row = {
            "N": n,
            "jaxsr_tok_s": n * args.new_tokens / seconds,
            "jaxsr_step_ms": 1e3 * seconds / args.new_tokens,
            "jaxsr_compile_s": first - seconds,
            "lower_bound_step_ms": 1e3 * step_lower_bound(lm, n, prompt_len + args.new_tokens // 2, machine),
        }
        row["step_vs_bound"] = row["jaxsr_step_ms"] / row["lower_bound_step_ms"]
        if theirs:
            row["hf_tok_s"] = n * args.new_tokens / min(theirs)
            row["hf_step_ms"] = 1e3 * min(theirs) / args.new_tokens
            row["speedup"] = row["jaxsr_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(row, flush=True)
    columns = [
        "N",
        "jaxsr_tok_s",
        "hf_tok_s",
        "speedup",
        "jaxsr_step_ms",
        "hf_step_ms",
        "lower_bound_step_ms",
        "step_vs_bound",
        "jaxsr_compile_s",
    ]
    print(table(rows, columns))
    path = write_result(
        args.name,
        {
            "machine_measured": machine,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "repeats": args.repeats,
            "rows": rows,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
