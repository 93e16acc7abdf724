"""Train the SmolLM2 draft/amateur shipped in `jaxsr/assets/smollm2-draft` (knowledge distillation).

SD/SCD need a second model with SmolLM2-135M-Instruct's tokenizer; none exists offline, so this script
distils one. SmolLM2 samples responses (T=1, top_k=50) to AlpacaFarm/HH prompts (the 100 benchmark
prompts of alpaca_farm_100.json are held out), then scores every position of those sequences once more
to keep its top-32 next-token log-probabilities. A small Llama decoder is trained on KL(p ‖ q) over
those 32 tokens plus one bucket for the remaining mass (optionally plus 1 − Σ min(p, q), the SD
rejection rate). Its tied embedding starts as SmolLM2's embedding projected onto its top right singular
vectors, which keeps the geometry of the tied logits.

Reproduce (2 CPU cores, shared; measured numbers in benchmarks/results/draft_training.json):
    python scripts/train_draft.py data --max-chunks 12       # held-out set + 12×64 SmolLM2 samples
    python scripts/train_draft.py labels                     # SmolLM2's top-32 at every position
    python scripts/train_draft.py train --steps 180 --warmup 20 --save-every 20
    python scripts/train_draft.py train --steps 300 --warmup 20 --save-every 20 --tv-weight 1.0  # resumes
    python scripts/train_draft.py ship                       # jaxsr/assets/smollm2-draft (bf16) + fixture
    PYTHONPATH=. python scripts/train_draft.py eval --model jaxsr/assets/smollm2-draft --out draft_training
Data goes to /work/draft-data and checkpoints (HF format) to /work/draft-ckpt by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jaxsr
from jaxsr.data import read_prompts
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.loading.gguf import smollm2_path
from jaxsr.loading.safetensors import read_safetensors, write_safetensors
from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import Decoder

TOP_K = 32  # teacher log-probabilities kept per position (the rest is one lumped bucket)


def split_prompts() -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): alpaca_farm_eval + hh_rlhf minus every benchmark prompt."""
    held = read_prompts("alpaca_farm_100")
    held_set = set(held)
    train = read_prompts("alpaca_farm_eval") + read_prompts("hh_rlhf_100")
    train = list(dict.fromkeys(p for p in train if p not in held_set))
    return train, held


def sample_chunk(
    model: jaxsr.Model, prompts: list[str], *, num_samples: int, max_new_tokens: int, seed: int
) -> dict[str, np.ndarray]:
    """SmolLM2's responses to `prompts` as flat arrays: prompt+response ids (EOS kept when it stopped)."""
    prompt_ids = encode_prompts(model, prompts)
    sampling = jaxsr.SamplingConfig(temperature=1.0, top_k=50)
    results = jaxsr.generate(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        num_samples=num_samples,
        seed=seed,
    )
    eos = model.eos_token_ids[0]
    seqs, prompt_lengths = [], []
    for ids, result in zip(prompt_ids, results, strict=True):
        for sample in result.samples:
            seqs.append(ids + list(sample.token_ids) + ([eos] if sample.finished else []))
            prompt_lengths.append(len(ids))
    return {
        "tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "lengths": np.asarray([len(s) for s in seqs], np.int32),
        "prompt_lengths": np.asarray(prompt_lengths, np.int32),
    }


def record_wall(data: Path, stage: str, seconds: float) -> None:
    """Add `seconds` to the wall time of `stage` in data/wall_s.json (read by `eval`)."""
    path = data / "wall_s.json"
    walls = json.loads(path.read_text()) if path.exists() else {}
    walls[stage] = walls.get(stage, 0.0) + seconds
    path.write_text(json.dumps(walls, indent=2))


def cmd_data(args: argparse.Namespace) -> None:
    """SmolLM2 samples: a held-out set (1 response to each of the first benchmark prompts) and training
    chunks of `--prompts-per-call` prompts × `--num-samples` responses, one .npz per chunk."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = jaxsr.load_model(smollm2_path())
    train, held = split_prompts()
    jobs = [("heldout", held[: args.heldout_prompts], 1, 0)]
    for r in range(args.rounds):
        jobs += [
            (f"train-r{r}", train[i : i + args.prompts_per_call], args.num_samples, i)
            for i in range(0, len(train), args.prompts_per_call)
        ]
    jobs = jobs[: 1 + args.max_chunks] if args.max_chunks else jobs
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    for n, (kind, prompts, num_samples, start) in enumerate(tqdm(jobs, desc="chunks")):
        path = out / f"{kind}-{start:04d}.npz"
        if path.exists():
            continue
        if time.monotonic() > deadline:
            print(f"time cap reached after {n} chunks")
            break
        chunk = sample_chunk(
            model, prompts, num_samples=num_samples, max_new_tokens=args.max_new_tokens, seed=1000 + n
        )
        np.savez(path.with_suffix(".tmp.npz"), **chunk)
        path.with_suffix(".tmp.npz").rename(path)
    record_wall(out, "data", time.monotonic() - t0)


def load_chunk(path: Path) -> list[np.ndarray]:
    """The sequences of one data chunk."""
    data = np.load(path)
    return np.split(data["tokens"], np.cumsum(data["lengths"])[:-1])


@jax.jit
def top_logprobs(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The TOP_K largest log-probabilities of each position and their token ids."""
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), TOP_K)
    return values.astype(jnp.float16), ids.astype(jnp.uint16)


def cmd_labels(args: argparse.Namespace) -> None:
    """SmolLM2's top-k next-token distribution at every position of every sampled sequence."""
    t0 = time.monotonic()
    model = jaxsr.load_model(smollm2_path())
    for path in tqdm(sorted(Path(args.data).glob("train-*[0-9].npz")), desc="label chunks"):
        out = path.with_name(path.stem + ".labels.npz")
        if out.exists():
            continue
        seqs = load_chunk(path)
        values = np.zeros((sum(map(len, seqs)), TOP_K), np.float16)
        ids = np.zeros((len(values), TOP_K), np.uint16)
        starts = np.concatenate([[0], np.cumsum([len(s) for s in seqs])[:-1]])
        order = np.argsort([len(s) for s in seqs])
        for b in range(0, len(order), args.rows):
            rows = order[b : b + args.rows]
            width = -(-max(len(seqs[r]) for r in rows) // 64) * 64
            tokens = np.zeros((args.rows, width), np.int32)
            mask = np.zeros_like(tokens)
            for i, r in enumerate(rows):
                tokens[i, : len(seqs[r])] = seqs[r]
                mask[i, : len(seqs[r])] = 1
            v, k = jax.device_get(top_logprobs(model.logits(tokens, mask)))
            for i, r in enumerate(rows):
                values[starts[r] : starts[r] + len(seqs[r])] = v[i, : len(seqs[r])]
                ids[starts[r] : starts[r] + len(seqs[r])] = k[i, : len(seqs[r])]
        np.savez(out.with_suffix(".tmp.npz"), values=values, ids=ids)
        out.with_suffix(".tmp.npz").rename(out)
    record_wall(Path(args.data), "labels", time.monotonic() - t0)


# -- student ------------------------------------------------------------------------------------------
def student_config(teacher: DecoderConfig, args: argparse.Namespace) -> DecoderConfig:
    """A narrow, shallow Llama with SmolLM2's vocabulary, RoPE, norm and context."""
    return dataclasses.replace(
        teacher,
        hidden_size=args.width,
        num_layers=args.layers,
        num_heads=args.width // args.head_dim,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.mlp,
        tie_word_embeddings=True,
    )


def svd_embedding(teacher: jaxsr.Model, width: int) -> np.ndarray:
    """SmolLM2's embedding E projected on its top right singular vectors: E·V_k (so logits h·(E·V_k)ᵀ
    are SmolLM2's logits of the hidden state h·V_kᵀ)."""
    embed = np.asarray(teacher.module.embed[...], np.float32)
    _, _, vt = np.linalg.svd(embed, full_matrices=False)
    return embed @ vt[:width].T


def split_params(module: Decoder) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graph, trainable parameters, every other variable) — whatever the layer layout."""
    return nnx.split(module, nnx.Param, ...)


# -- data ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Example:
    tokens: np.ndarray
    prompt_length: int
    values: np.ndarray
    """[len, TOP_K] SmolLM2 log-probabilities of the next token at each position."""
    ids: np.ndarray


def load_examples(data: Path) -> list[Example]:
    examples = []
    for path in sorted(data.glob("train-*.labels.npz")):
        chunk = np.load(path.with_name(path.name.replace(".labels", "")))
        labels = np.load(path)
        offsets = np.concatenate([[0], np.cumsum(chunk["lengths"])])
        for i, prompt_length in enumerate(chunk["prompt_lengths"]):
            a, b = offsets[i], offsets[i + 1]
            examples.append(
                Example(chunk["tokens"][a:b], int(prompt_length), labels["values"][a:b], labels["ids"][a:b])
            )
    return examples


def make_batch(examples: list[Example], prompt_weight: float) -> dict[str, np.ndarray]:
    """Right-padded [B, W] tokens, mask, per-position loss weights and teacher top-k targets."""
    rows, width = len(examples), -(-max(len(e.tokens) for e in examples) // 64) * 64
    batch = {
        "tokens": np.zeros((rows, width), np.int32),
        "mask": np.zeros((rows, width), np.int32),
        "weight": np.zeros((rows, width), np.float32),
        "values": np.full((rows, width, TOP_K), -30.0, np.float32),
        "ids": np.zeros((rows, width, TOP_K), np.int32),
    }
    for r, e in enumerate(examples):
        n = len(e.tokens)
        batch["tokens"][r, :n] = e.tokens
        batch["mask"][r, :n] = 1
        batch["weight"][r, : e.prompt_length - 1] = prompt_weight
        batch["weight"][r, e.prompt_length - 1 : n - 1] = 1.0
        batch["values"][r, :n] = e.values
        batch["ids"][r, :n] = e.ids
    return batch


def batches(examples: list[Example], tokens_per_batch: int, seed: int) -> Iterator[list[Example]]:
    """Endless epochs of length-sorted, shuffled batches of about `tokens_per_batch` padded tokens."""
    rng = np.random.default_rng(seed)
    while True:
        order = sorted(rng.permutation(len(examples)), key=lambda i: len(examples[i].tokens) // 64)
        groups, group = [], []
        for i in order:
            width = -(-max(len(examples[j].tokens) for j in [*group, i]) // 64) * 64
            if group and width * (len(group) + 1) > tokens_per_batch:
                groups.append(group)
                group = []
            group.append(i)
        groups.append(group)
        for g in rng.permutation(len(groups)):
            yield [examples[i] for i in groups[g]]


# -- loss ---------------------------------------------------------------------------------------------
def distill_loss(
    graph: nnx.GraphDef, params: nnx.State, rest: nnx.State, batch: dict, tv_weight: float
) -> jax.Array:
    """Mean weighted KL(p ‖ q) + tv_weight·(1 − Σ min(p, q)) over SmolLM2's top-k tokens plus one bucket
    for the remaining mass (the second term is 1 − acceptance rate, the quantity SD cares about)."""
    module = nnx.merge(graph, params, rest)
    hidden, _ = module.prefill(batch["tokens"], batch["mask"])
    logq = jax.nn.log_softmax(module.logits(hidden), axis=-1)
    logq_top = jnp.take_along_axis(logq, batch["ids"], axis=-1)
    p_top = jnp.exp(batch["values"])
    p_rest = jnp.clip(1.0 - p_top.sum(-1), 1e-6, 1.0)
    q_rest = jnp.clip(1.0 - jnp.exp(logq_top).sum(-1), 1e-6, 1.0)
    kl = (p_top * (batch["values"] - logq_top)).sum(-1) + p_rest * (jnp.log(p_rest) - jnp.log(q_rest))
    overlap = jnp.minimum(p_top, jnp.exp(logq_top)).sum(-1) + jnp.minimum(p_rest, q_rest)
    return ((kl + tv_weight * (1.0 - overlap)) * batch["weight"]).sum() / batch["weight"].sum()


@partial(jax.jit, static_argnums=(0, 1, 6), donate_argnums=(2, 4))
def train_step(graph, optimizer, params, rest, opt_state, batch, tv_weight):
    loss, grads = jax.value_and_grad(distill_loss, argnums=1)(graph, params, rest, batch, tv_weight)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# -- evaluation ---------------------------------------------------------------------------------------
def response_logits(model: jaxsr.Model, seqs: list[np.ndarray], prompt_lengths: np.ndarray) -> np.ndarray:
    """[positions, V] logits predicting every response token (EOS included) of every sequence."""
    rows, width = 4, -(-max(map(len, seqs)) // 64) * 64
    out = []
    for a in range(0, len(seqs), rows):
        tokens = np.zeros((rows, width), np.int32)
        mask = np.zeros_like(tokens)
        for r, seq in enumerate(seqs[a : a + rows]):
            tokens[r, : len(seq)], mask[r, : len(seq)] = seq, 1
        logits = np.asarray(model.logits(tokens, mask))
        for r, (seq, n) in enumerate(zip(seqs[a : a + rows], prompt_lengths[a : a + rows], strict=True)):
            out.append(logits[r, n - 1 : len(seq) - 1])
    return np.concatenate(out)


def top_k_probs(logits: np.ndarray, k: int) -> np.ndarray:
    """softmax of the logits after keeping the k largest per row (k = 0: no filter)."""
    if k:
        kth = np.partition(logits, -k, axis=-1)[:, -k][:, None]
        logits = np.where(logits >= kth, logits, -np.inf)
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def acceptance(p_logits: np.ndarray, q_logits: np.ndarray, k: int = 0) -> float:
    """λ = mean over positions of Σ_x min(p(x), q(x))."""
    total = 0.0
    for a in range(0, len(p_logits), 256):
        p, q = top_k_probs(p_logits[a : a + 256], k), top_k_probs(q_logits[a : a + 256], k)
        total += np.minimum(p, q).sum()
    return float(total / len(p_logits))


def heldout(data: Path) -> tuple[list[np.ndarray], np.ndarray]:
    chunk = np.load(data / "heldout-0000.npz")
    return load_chunk(data / "heldout-0000.npz"), chunk["prompt_lengths"]


def checkpoint_model(module: Decoder, teacher: jaxsr.Model) -> jaxsr.Model:
    return jaxsr.Model.from_module(module, tokenizer=teacher.tokenizer, eos_token_ids=teacher.eos_token_ids)


def cmd_train(args: argparse.Namespace) -> None:
    """AdamW (warm-up + cosine) on the distillation loss; an HF checkpoint every `--save-every` steps."""
    ckpt = Path(args.ckpt)
    teacher = jaxsr.load_model(smollm2_path())
    seqs, prompt_lengths = heldout(Path(args.data))
    teacher_logits = response_logits(teacher, seqs, prompt_lengths)
    state_file = ckpt / "train_state.json"
    state = (
        json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "phases": [], "log": []}
    )
    start = state["step"]
    if start:
        module = jaxsr.load_model(ckpt, cache=False).module
    else:
        module = Decoder(student_config(teacher.config, args), rngs=nnx.Rngs(args.seed))
        module.embed[...] = jnp.asarray(svd_embedding(teacher, args.width))
    graph, params, rest = split_params(module)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * 0.05
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=args.weight_decay)
    )
    opt_state = optimizer.init(params)
    if start:  # resume: Adam moments restart, the schedule continues
        opt_state = optax.tree_utils.tree_set(opt_state, count=jnp.asarray(start, jnp.int32))
        opt_state = jax.tree.map(jnp.copy, opt_state)  # one buffer per leaf, so each can be donated
    examples = load_examples(Path(args.data))
    print(f"{len(examples)} sequences, {sum(len(e.tokens) for e in examples)} tokens")
    stream = batches(examples, args.batch_tokens, args.seed + start)
    state["phases"].append(vars(args))
    t0 = time.monotonic()
    bar = tqdm(range(start, args.steps), desc="train", initial=start, total=args.steps)
    for step in bar:
        batch = make_batch(next(stream), args.prompt_weight)
        params, opt_state, loss = train_step(graph, optimizer, params, rest, opt_state, batch, args.tv_weight)
        bar.set_postfix(loss=f"{float(loss):.3f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            model = checkpoint_model(nnx.merge(graph, params, rest), teacher)
            lam = acceptance(teacher_logits, response_logits(model, seqs, prompt_lengths))
            entry = {"step": step + 1, "loss": float(loss), "lambda": lam, "phase_s": time.monotonic() - t0}
            state["log"].append(entry)
            state["step"] = step + 1
            state["phases"][-1]["wall_s"] = entry["phase_s"]
            print(json.dumps(entry))
            jaxsr.save_model(model, ckpt)
            state_file.write_text(json.dumps(state, indent=2))


def cmd_eval(args: argparse.Namespace) -> None:
    """λ (raw and top-k 50) on the held-out responses and the batch-1 decode cost ratio c, written with
    the data and training record to benchmarks/results/draft_training.json."""
    teacher = jaxsr.load_model(smollm2_path())
    source = Path(args.model or args.ckpt)
    draft = jaxsr.load_model(source)
    seqs, prompt_lengths = heldout(Path(args.data))
    p, q = response_logits(teacher, seqs, prompt_lengths), response_logits(draft, seqs, prompt_lengths)
    result = {
        "heldout": {"prompts": len(seqs), "positions": len(p)},
        "lambda_raw": acceptance(p, q),
        "lambda_top50": acceptance(p, q, 50),
    }
    times = {}
    sampling = jaxsr.SamplingConfig(temperature=1.0, top_k=50)
    for name, model in (("smollm2", teacher), ("draft", draft)):
        prompt = [seqs[0][: prompt_lengths[0]].tolist()]
        best = np.inf
        for _ in range(4):  # the first call compiles
            t0 = time.perf_counter()
            out = jaxsr.generate(model, prompt, max_new_tokens=args.cost_tokens, sampling=sampling)
            best = min(best, (time.perf_counter() - t0) / max(1, len(out[0].samples[0].token_ids)))
        times[name] = best
    result["decode_s_per_token_batch1"] = times
    result["cost_ratio"] = times["draft"] / times["smollm2"]
    cfg = draft.config
    result["flops_ratio"] = decode_flops(cfg) / decode_flops(teacher.config)
    result["architecture"] = dataclasses.asdict(cfg)
    result["parameters"] = int(sum(np.size(x) for x in jax.tree.leaves(draft.params)))
    chunks = [np.load(f) for f in sorted(Path(args.data).glob("train-*[0-9].npz"))]
    result["data"] = {
        "sequences": int(sum(len(c["lengths"]) for c in chunks)),
        "tokens": int(sum(c["lengths"].sum() for c in chunks)),
        "response_tokens": int(sum((c["lengths"] - c["prompt_lengths"]).sum() for c in chunks)),
        "wall_s": json.loads((Path(args.data) / "wall_s.json").read_text()),
    }
    result["model"] = {
        "path": str(source),
        "size_on_disk_bytes": sum(f.stat().st_size for f in source.iterdir()),
        "weights_bytes": (source / "model.safetensors").stat().st_size,
    }
    state = json.loads((Path(args.ckpt) / "train_state.json").read_text())
    result["training"] = {"wall_s": sum(phase["wall_s"] for phase in state["phases"]), **state}
    print(json.dumps({k: v for k, v in result.items() if k != "training"}, indent=2))
    if args.out:
        from benchmarks.common import write_result

        print(write_result(args.out, result))


def decode_flops(cfg: DecoderConfig) -> int:
    """Multiply-adds of one decode step's weight matmuls (attention over the cache not counted)."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = (3 if cfg.mlp == "gated" else 2) * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size


def cmd_ship(args: argparse.Namespace) -> None:
    """Write the checkpoint in bfloat16 to the package's assets, and the test fixture (a few held-out
    SmolLM2 responses, cut to `--fixture-tokens` response tokens)."""
    out = Path(jaxsr.__file__).parent / "assets" / "smollm2-draft"
    shutil.rmtree(out, ignore_errors=True)
    jaxsr.save_model(jaxsr.load_model(args.ckpt, cache=False), out)
    # cast the written float32 file: save_model cannot yet export bfloat16 nnx Variables (they reach numpy
    # as void |V2 arrays under flax 0.12.8)
    weights = out / "model.safetensors"
    write_safetensors(
        weights, {k: v.astype(ml_dtypes.bfloat16) for k, v in read_safetensors(weights).items()}
    )
    seqs, prompt_lengths = heldout(Path(args.data))
    rows = [
        {"prompt_length": int(n), "tokens": seq[: n + args.fixture_tokens].tolist()}
        for seq, n in list(zip(seqs, prompt_lengths, strict=True))[: args.fixture_rows]
    ]
    fixture = Path(jaxsr.__file__).parent.parent / "tests" / "data" / "draft_heldout.json"
    fixture.parent.mkdir(exist_ok=True)
    fixture.write_text(json.dumps(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="sample SmolLM2 responses (training chunks and a held-out set)")
    data.add_argument("--out", default="/work/draft-data")
    data.add_argument("--prompts-per-call", type=int, default=16)
    data.add_argument("--num-samples", type=int, default=4)
    data.add_argument("--max-new-tokens", type=int, default=160)
    data.add_argument("--rounds", type=int, default=4, help="passes over the training prompts")
    data.add_argument("--heldout-prompts", type=int, default=20)
    data.add_argument("--minutes", type=float, default=30.0, help="stop starting new chunks after this")
    data.add_argument("--max-chunks", type=int, default=0, help="training chunks to sample (0: no limit)")
    labels = sub.add_parser("labels", help="SmolLM2's top-k log-probabilities on the sampled sequences")
    labels.add_argument("--data", default="/work/draft-data")
    labels.add_argument("--rows", type=int, default=16)
    train = sub.add_parser("train", help="distil the student from the labelled chunks")
    train.add_argument("--data", default="/work/draft-data")
    train.add_argument("--ckpt", default="/work/draft-ckpt")
    train.add_argument("--width", type=int, default=256)
    train.add_argument("--layers", type=int, default=4)
    train.add_argument("--head-dim", type=int, default=64)
    train.add_argument("--kv-heads", type=int, default=2)
    train.add_argument("--mlp", type=int, default=768)
    train.add_argument("--steps", type=int, default=250)
    train.add_argument("--warmup", type=int, default=25)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--batch-tokens", type=int, default=4096)
    train.add_argument("--prompt-weight", type=float, default=0.25)
    train.add_argument("--tv-weight", type=float, default=0.0, help="weight of the 1 − overlap term")
    train.add_argument("--save-every", type=int, default=25)
    train.add_argument("--seed", type=int, default=0)
    evaluate = sub.add_parser("eval", help="held-out acceptance rate and decode cost ratio")
    evaluate.add_argument("--data", default="/work/draft-data")
    evaluate.add_argument("--ckpt", default="/work/draft-ckpt")
    evaluate.add_argument("--model", default="", help="checkpoint to evaluate (default: --ckpt)")
    evaluate.add_argument("--cost-tokens", type=int, default=64)
    evaluate.add_argument(
        "--out", default="", help="result name under benchmarks/results (needs PYTHONPATH=.)"
    )
    ship = sub.add_parser("ship", help="write jaxsr/assets/smollm2-draft (bf16) and the test fixture")
    ship.add_argument("--data", default="/work/draft-data")
    ship.add_argument("--ckpt", default="/work/draft-ckpt")
    ship.add_argument("--fixture-rows", type=int, default=4)
    ship.add_argument("--fixture-tokens", type=int, default=48)
    args = parser.parse_args()
    commands = {
        "data": cmd_data,
        "labels": cmd_labels,
        "train": cmd_train,
        "eval": cmd_eval,
        "ship": cmd_ship,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
