"""Distilling a draft (or amateur) from a teacher: `distill(DistillConfig(...))`, or
`jaxsr train distill CONFIG.yaml [key=value ...]`.

Speculative decoding needs a second model with the teacher's tokenizer, much cheaper per token and
close to it in distribution: the acceptance rate of one draft token is λ = Σ_x min(p(x), q(x)). The run
has three stages, each resumable:

1. **Data**: the teacher samples responses to the training prompts with jaxsr's batched sampler and,
   as it samples, keeps its `label_top_k` largest next-token log-probabilities at every response
   position (one teacher pass: the labels are read from the logits the sampler draws from). Chunks of
   one sampling batch go to `output_dir/data/` as .npz files, each written whole or not at all.
2. **Training**: a small Llama with the teacher's vocabulary, RoPE and context learns KL(p ‖ q) over
   the teacher's top-k tokens plus one bucket for the remaining mass, optionally plus `tv_weight` ×
   (1 − Σ min(p, q)), the rejection rate itself. Its embedding starts as the teacher's projected on
   its top singular directions. With `head_tokens` its output layer scores only the ids that hold the
   most of the teacher's probability over the training positions (end-of-sequence ids always): the
   draft proposes only those, which speculative sampling allows (it is exact for any proposal), and
   the full-vocabulary head, most of a small draft's cost, shrinks. The loop is `training.loop`'s:
   checkpoints every `save_every` steps, λ on held-out responses at each.
3. **Export**: the draft (`output_dir/final`, loadable by `jaxsr.load_model`), and `distill.json` with
   λ against training tokens, the measured decode-cost ratio c and the wall time of each stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxsr.checks import user_path
from jaxsr.configs import check_field_types, check_mesh_keys, load_config
from jaxsr.data import read_prompts
from jaxsr.decoding.api import generate
from jaxsr.decoding.driver import Layout, as_sampler, batches
from jaxsr.decoding.inputs import Options, Request, prepare
from jaxsr.decoding.loop import NO_PAUSE
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState, to_host
from jaxsr.ladder import bucket
from jaxsr.loading.api import DTYPES, Header, save_model
from jaxsr.loading.resolve import mesh_from_keys, resolve_header, resolve_model
from jaxsr.locks import holding
from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model
from jaxsr.sharding import shard_model
from jaxsr.training.data import Example, make_batch
from jaxsr.training.loop import Batch, Run, RunKeys, check_run_keys, train, write_report

PLACEMENT_KEYS = ("output_dir", "save_every", "mesh_data", "mesh_model", "measure_cost")
"""Where a run writes, how often it checkpoints, on which devices, whether it times the result."""
POSITIVE_INTS = (
    "heldout_prompts", "samples_per_prompt", "max_new_tokens", "rows_per_batch", "label_top_k",
    "hidden_size", "num_layers", "head_dim", "num_kv_heads", "intermediate_size", "batch_size",
    "grad_accum", "max_length", "steps", "save_every",
)  # fmt: skip
FILL_LOGPROB = -1e4
"""Log-probability of label slots past a sequence (exp() is 0, and products with it stay finite)."""


@dataclasses.dataclass
class DistillConfig(RunKeys):
    """A distillation run. Every key a YAML file or override may set is a field here."""

    placement_keys: ClassVar[tuple[str, ...]] = PLACEMENT_KEYS

    teacher: str = "smollm2"
    """The model distilled, as a job names it (a checkpoint, a .gguf, a hub id, `smollm2`)."""
    output_dir: str = "out/distill"
    """Data chunks go to `data/`, checkpoints to `checkpoints/`, the draft to `final/`."""
    prompts: str = "alpaca_farm_eval,hh_rlhf_100"
    """Training prompt sets (names or paths, comma-separated); prompts of `heldout` are left out."""
    heldout: str = "alpaca_farm_100"
    """The set whose first `heldout_prompts` prompts measure λ (none of its prompts is trained on)."""
    heldout_prompts: int = 20
    max_prompts: int | None = None
    """Training prompts used (the first ones; None: all)."""
    samples_per_prompt: int = 4
    max_new_tokens: int = 160
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    """The teacher's sampling; λ is reported raw and at this top_k (what speculative decoding runs)."""
    rows_per_batch: int = 64
    """Teacher rows decoded together while sampling the data."""
    label_top_k: int = 32
    """Teacher log-probabilities kept per position (the rest is one bucket)."""
    chat: bool | None = None
    """Prompts through the teacher's chat template (None: when its tokenizer has one)."""
    hidden_size: int = 256
    num_layers: int = 4
    head_dim: int = 64
    num_kv_heads: int = 2
    intermediate_size: int = 768
    head_tokens: int | None = None
    """Ids the draft's output layer scores (None: the whole vocabulary, tied to the embedding)."""
    batch_size: int = 16
    grad_accum: int = 1
    max_length: int = 256
    """Prompt + response tokens kept per training sequence (longer ones are cut at the end; never past
    the teacher's context)."""
    steps: int = 300
    learning_rate: float = 3e-3
    end_learning_rate: float = 1.5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    tv_weight: float = 0.0
    """Weight of 1 − Σ min(p, q) beside the KL term."""
    param_dtype: str = "float32"
    export_dtype: str | None = None
    """The dtype of the saved draft's weights (None: `param_dtype`); bfloat16 halves the file."""
    save_every: int = 20
    seed: int = 0
    """Seeds the teacher's samples, the draft's initialisation and the order of the examples."""
    measure_cost: bool = True
    """Time a decode step of teacher and draft at the end (the cost ratio c)."""
    mesh_data: int | None = None
    mesh_model: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        self.output_dir = str(user_path("output_dir", self.output_dir))
        check_mesh_keys(self)
        for name in POSITIVE_INTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        for name in ("max_prompts", "head_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected None or an int >= 1, got {getattr(self, name)}")
        if not self.prompts.strip(","):
            raise ValueError("prompts: expected one or more prompt sets, comma-separated")
        if self.hidden_size % self.head_dim:
            raise ValueError(f"head_dim: {self.head_dim} does not divide hidden_size={self.hidden_size}")
        if (self.hidden_size // self.head_dim) % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide the "
                f"{self.hidden_size // self.head_dim} attention heads"
            )
        check_run_keys(self)
        if self.export_dtype is not None and self.export_dtype not in DTYPES:
            raise ValueError(f"export_dtype: expected None or one of {DTYPES}, got {self.export_dtype!r}")
        if not self.tv_weight >= 0:
            raise ValueError(f"tv_weight: expected a number >= 0, got {self.tv_weight}")
        self.sampling()  # refuses a bad temperature / top_k / top_p now, naming it

    def sampling(self) -> SamplingConfig:
        try:
            return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e)) from None


def load_distill_config(path: str | Path | None, overrides: list[str] = ()) -> DistillConfig:
    """Read `path` (YAML mapping of `DistillConfig` keys) and apply `key=value` overrides."""
    return load_config(DistillConfig, path, overrides)


# -- stage 1: the teacher's samples, labelled as they are drawn -------------------------------------
@dataclasses.dataclass(frozen=True)
class LabelledExample(Example):
    """A prompt + response sequence and the teacher's top-k next-token log-probabilities at each
    response token ([response tokens, k]: row j is the distribution token j was drawn from)."""

    values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.float32))
    ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))


@dataclasses.dataclass(frozen=True)
class TeacherLabels:
    """An observer of the token loop (`loop.Observer`): at every generated index, the k largest raw
    log-probabilities of the distribution the token was drawn from, and their ids — the observation
    is (values [B, N, k] float32, ids [B, N, k] int32)."""

    k: int

    def top(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), self.k)

    def start(self, state: DecodeState, first_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The observation before the loop: index 0 holds the prefill's last-position distribution
        (`first_logits` [P, V]), which drew every row's first token."""
        B, N = state.tokens.shape
        first_values, first_ids = self.top(jnp.repeat(first_logits, B // first_logits.shape[0], axis=0))
        values = jnp.full((B, N, self.k), FILL_LOGPROB, jnp.float32).at[:, 0].set(first_values)
        return values, jnp.zeros((B, N, self.k), jnp.int32).at[:, 0].set(first_ids)

    def update(self, observation, before: DecodeState, active: jax.Array, logits: tuple):
        values, ids = observation
        B, N = before.tokens.shape
        at = jnp.where(active, before.num_generated, N)  # the index this step drew; else dropped
        v, i = self.top(logits[0])
        rows = jnp.arange(B)
        return values.at[rows, at].set(v, mode="drop"), ids.at[rows, at].set(i, mode="drop")


@partial(jax.jit, static_argnums=0)
def start_labels(labels: TeacherLabels, state: DecodeState, first_logits: jax.Array) -> DecodeState:
    return state.replace(observation=labels.start(state, first_logits))


def teacher_request(
    teacher: Model | Header, prompts: list[str], config: DistillConfig, first_prompt_id: int
) -> Request:
    """The prompts encoded and the sampling checked, as every decoding call does it (the teacher's
    `Header` is enough)."""
    options = Options(config.max_new_tokens, config.sampling(), config.seed, config.chat, (), first_prompt_id)
    return prepare((teacher,), prompts, options)


def write_chunks(
    teacher: Model,
    request: Request,
    directory: Path,
    *,
    name: str,
    samples_per_prompt: int,
    config: DistillConfig,
    progress: bool,
) -> list[Path]:
    """Sample `samples_per_prompt` labelled responses to each prompt of `request`, one .npz per
    sampling batch (`name-<first prompt>.npz`); batches already on disk are skipped, so a killed run
    resumes."""
    sampler = as_sampler(teacher, request.sampling)
    labels = TeacherLabels(config.label_top_k)
    directory.mkdir(parents=True, exist_ok=True)
    plan = list(batches(request.encoded, samples_per_prompt, config.rows_per_batch, sampler.mesh))
    paths = []
    with sampler.on_mesh():
        for layouts in tqdm(plan, desc=f"teacher samples ({name})", disable=not progress):
            todo = [(layout, _chunk_path(directory, name, layout)) for layout in layouts]
            paths += [path for _, path in todo]
            todo = [(layout, path) for layout, path in todo if not path.exists()]
            if not todo:
                continue
            chunk = [request.encoded[i] for i in layouts[0].indices]
            prefill = sampler.prefill_prompts(chunk, layouts[0].prompts)
            for layout, path in todo:
                state = start_labels(labels, sampler.start(prefill, layout, request), prefill.logits[0])
                state = sampler.decode_loop(state, prefill.caches, NO_PAUSE, observer=labels)
                host, observed = to_host(state), jax.device_get(state.observation)
                _write_chunk(path, chunk, layout.rows, host, *observed)
    return paths


def _chunk_path(directory: Path, name: str, layout: Layout) -> Path:
    """`name-<digest of the batch's prompts and samples>.npz`: a batch's file, whatever order the
    batches are made in."""
    key = (layout.indices, layout.first_sample, layout.live)
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return directory / f"{name}-{digest}.npz"


def _write_chunk(
    path: Path, prompts: list[list[int]], rows_per_prompt: int, host: DecodeState, values, ids
) -> None:
    """One batch's alive rows (`rows_per_prompt` rows of each of `prompts`, in order) as flat arrays,
    written to a temporary name and renamed into place."""
    seqs, prompt_lengths, label_rows = [], [], []
    for r in np.flatnonzero(host.alive):
        n = int(host.num_generated[r])  # the stop token included: the draft learns to stop
        prompt = prompts[r // rows_per_prompt]
        seqs.append(np.asarray(prompt + host.tokens[r, :n].tolist(), np.int32))
        prompt_lengths.append(len(prompt))
        label_rows.append(r)
    count = [len(s) - p for s, p in zip(seqs, prompt_lengths, strict=True)]
    arrays = {
        "tokens": np.concatenate(seqs),
        "lengths": np.asarray([len(s) for s in seqs], np.int32),
        "prompt_lengths": np.asarray(prompt_lengths, np.int32),
        "values": np.concatenate([values[r, :n] for r, n in zip(label_rows, count, strict=True)]).astype(
            np.float16
        ),
        "ids": np.concatenate([ids[r, :n] for r, n in zip(label_rows, count, strict=True)]),
    }
    temporary = path.with_name(path.name + ".partial.npz")
    np.savez(temporary, **arrays)
    os.replace(temporary, path)


def read_chunks(paths: list[Path], max_length: int) -> list[LabelledExample]:
    """The labelled sequences of the chunks, each cut to `max_length` tokens."""
    examples = []
    for path in paths:
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
        ends = np.cumsum(arrays["lengths"])
        label_ends = np.cumsum(arrays["lengths"] - arrays["prompt_lengths"])
        for i, (end, length, prompt_length) in enumerate(
            zip(ends, arrays["lengths"], arrays["prompt_lengths"], strict=True)
        ):
            labels = slice(label_ends[i] - (length - prompt_length), label_ends[i])
            kept = min(int(length), max_length) - int(prompt_length)
            if kept < 1:
                continue
            examples.append(
                LabelledExample(
                    tokens=arrays["tokens"][end - length : end][: prompt_length + kept],
                    prompt_length=int(prompt_length),
                    values=arrays["values"][labels][:kept].astype(np.float32),
                    ids=arrays["ids"][labels][:kept],
                )
            )
    return examples


def most_probable_ids(
    examples: list[LabelledExample], count: int, vocab_size: int, always: tuple[int, ...]
) -> tuple[int, ...]:
    """The `count` ids holding the most teacher probability summed over every labelled position,
    `always` among them (e.g. EOS), ascending."""
    mass = np.zeros(vocab_size, np.float64)
    for e in examples:
        np.add.at(mass, e.ids.ravel(), np.exp(e.values.ravel().astype(np.float64)))
    mass[list(always)] = np.inf
    order = np.argsort(-mass, kind="stable")[:count]
    return tuple(sorted(int(i) for i in order))


# -- stage 2: the student and its loss -----------------------------------------------------------
def student_config(
    teacher: DecoderConfig, config: DistillConfig, head_ids: tuple[int, ...] | None
) -> DecoderConfig:
    """A small Llama with the teacher's vocabulary, RoPE, norm epsilon and context."""
    return DecoderConfig(
        vocab_size=teacher.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.hidden_size // config.head_dim,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=teacher.max_position_embeddings,
        norm_eps=teacher.norm_eps,
        rope_theta=teacher.rope_theta if teacher.position == "rope" else 10000.0,
        rope_scaling=teacher.rope_scaling if teacher.position == "rope" else None,
        tie_word_embeddings=head_ids is None,
        head_token_ids=head_ids,
    )


def init_student(teacher: Model, cfg: DecoderConfig, seed: int) -> Model:
    """A fresh student whose embedding is the teacher's E projected on its top right singular vectors
    V_k (E·V_k: logits h·(E·V_k)ᵀ are the teacher's logits of h·V_kᵀ); a subset head starts as those
    ids' rows. A teacher narrower than the student leaves the random initialisation."""
    module = Decoder(cfg, rngs=nnx.Rngs(seed))
    embed = np.asarray(teacher.module.embed[...], np.float32)
    if embed.shape[1] >= cfg.hidden_size:
        _, _, vt = np.linalg.svd(embed, full_matrices=False)
        projected = embed @ vt[: cfg.hidden_size].T
        module.embed[...] = jnp.asarray(projected)
        if cfg.head_token_ids is not None:
            module.lm_head[...] = jnp.asarray(projected[list(cfg.head_token_ids)].T)
    return Model.from_module(module, tokenizer=teacher.tokenizer, eos_token_ids=teacher.eos_token_ids)


def head_index(cfg: DecoderConfig) -> np.ndarray | None:
    """[V] position of each id in the subset head (-1: not scored), None for a full head."""
    if cfg.head_token_ids is None:
        return None
    index = np.full(cfg.vocab_size, -1, np.int32)
    index[list(cfg.head_token_ids)] = np.arange(len(cfg.head_token_ids), dtype=np.int32)
    return index


def distill_terms(
    logq: jax.Array, values: jax.Array, ids: jax.Array, index: np.ndarray | None
) -> tuple[jax.Array, jax.Array]:
    """(KL(p ‖ q), Σ min(p, q)) per position over the teacher's top-k ids plus one bucket for the rest:
    `logq` [..., H] the student's log-probabilities over its head, `values`/`ids` [..., k] the teacher's.
    Teacher ids the head cannot score add nothing the student could change, so they drop out."""
    if index is None:
        inside, slot = jnp.ones(ids.shape, bool), ids
    else:
        slot = jnp.asarray(index)[ids]
        inside, slot = slot >= 0, jnp.maximum(slot, 0)
    logq_top = jnp.where(inside, jnp.take_along_axis(logq, slot, axis=-1), 0.0)
    p_top = jnp.where(inside, jnp.exp(values), 0.0)
    q_top = jnp.where(inside, jnp.exp(logq_top), 0.0)
    p_rest = jnp.clip(1.0 - jnp.exp(values).sum(-1), 1e-6, 1.0)
    q_rest = jnp.clip(1.0 - q_top.sum(-1), 1e-6, 1.0)
    kl = (p_top * (values - logq_top)).sum(-1) + p_rest * (jnp.log(p_rest) - jnp.log(q_rest))
    overlap = jnp.minimum(p_top, q_top).sum(-1) + jnp.minimum(p_rest, q_rest)
    return kl, overlap


def make_distill_loss(cfg: DecoderConfig, tv_weight: float):
    """The train loss: Σ over response positions of KL + tv_weight·(1 − overlap), and their count."""
    index = head_index(cfg)

    def loss(module: nnx.Module, micro: Batch) -> tuple[jax.Array, jax.Array]:
        window = micro["targets"].shape[-1]  # the output layer runs on the response window only
        hidden, _ = module.prefill(micro["tokens"], micro["mask"])
        logq = jax.nn.log_softmax(module.head_logits(hidden[..., -window:-1, :]), axis=-1)
        kl, overlap = distill_terms(logq, micro["values"][..., 1:, :], micro["ids"][..., 1:, :], index)
        weight = micro["targets"][..., 1:].astype(jnp.float32)
        return ((kl + tv_weight * (1.0 - overlap)) * weight).sum(), weight.sum()

    return loss


def labelled_batch(
    examples: list[LabelledExample], indices: np.ndarray, micro_batches: int, max_length: int
) -> dict[str, np.ndarray]:
    """`make_batch`'s tokens, mask and targets plus `values`/`ids` [micro_batches, rows, W, k] over the
    targets' window of the last W positions: at a response token's column, the teacher's distribution
    it was drawn from."""
    batch = make_batch(examples, indices, micro_batches, max_length)
    M, rows, W = batch["targets"].shape
    k = examples[0].values.shape[1]
    values = np.full((M * rows, W, k), FILL_LOGPROB, np.float32)
    ids = np.zeros((M * rows, W, k), np.int32)
    for r, i in enumerate(indices):
        e = examples[i]
        first = W - (len(e.tokens) - e.prompt_length)
        values[r, first:] = e.values
        ids[r, first:] = e.ids
    return {**batch, "values": values.reshape(M, rows, W, k), "ids": ids.reshape(M, rows, W, k)}


# -- λ on held-out responses ---------------------------------------------------------------------
@partial(jax.jit, static_argnames=("graph", "top_k"))
def _overlap_sums(graph, params, tokens, mask, weight, p, *, top_k: int):
    """Σ over weighted positions of Σ_x min(p, q), raw and with both filtered to their top_k."""
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(tokens, mask)
    q = jax.nn.softmax(module.logits(hidden).astype(jnp.float32), axis=-1)
    p = p.astype(jnp.float32)

    def filtered(x: jax.Array) -> jax.Array:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, 0.0)
        return x / x.sum(-1, keepdims=True)

    raw = (jnp.minimum(p, q).sum(-1) * weight).sum()
    at_top_k = (jnp.minimum(filtered(p), filtered(q)).sum(-1) * weight).sum()
    return raw, at_top_k


class Acceptance:
    """λ of a draft on held-out teacher responses: the mean over response positions of Σ_x min(p, q),
    raw and at the sampling's top_k (both distributions filtered, as speculative decoding filters
    them). The teacher's probabilities are computed once, kept in float16."""

    ROWS = 4

    def __init__(self, teacher: Model, examples: list[LabelledExample], top_k: int):
        self.top_k = min(top_k, teacher.config.vocab_size) if top_k else teacher.config.vocab_size
        self.batches = []
        for a in range(0, len(examples), self.ROWS):
            indices = np.arange(a, min(a + self.ROWS, len(examples)))
            batch = make_batch(
                examples, np.resize(indices, self.ROWS), 1, bucket(max(len(e.tokens) for e in examples))
            )
            tokens, mask, targets = (batch[name][0] for name in ("tokens", "mask", "targets"))
            weight = np.zeros(tokens.shape, np.float32)  # targets cover the last W positions
            T, W = tokens.shape[1], targets.shape[1]
            weight[: len(indices), T - W : T - 1] = targets[: len(indices), 1:]  # t predicts token t + 1
            p = jax.nn.softmax(teacher.logits(tokens, mask), axis=-1).astype(jnp.float16)
            self.batches.append((jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(weight), p))
        self.positions = float(sum(w.sum() for _, _, w, _ in self.batches))

    def __call__(self, graph: nnx.GraphDef, params: nnx.State) -> dict[str, float]:
        sums = [_overlap_sums(graph, params, *b, top_k=self.top_k) for b in self.batches]
        raw, at_top_k = (float(sum(s[i] for s in sums)) / self.positions for i in (0, 1))
        return {"lambda": raw, f"lambda_top{self.top_k}": at_top_k}


def decode_seconds_per_token(model: Model, prompt: list[int], tokens: int = 64) -> float:
    """Batch-1 decode seconds per token, the fastest of 3 timed calls after one that compiles."""
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    best = np.inf
    for attempt in range(4):
        t0 = time.perf_counter()
        out = generate(model, [prompt], max_new_tokens=tokens, sampling=sampling, seed=attempt)
        if attempt:
            best = min(best, (time.perf_counter() - t0) / max(1, len(out[0].samples[0].token_ids)))
    return float(best)


# -- the run ---------------------------------------------------------------------------------------
def split_prompts(config: DistillConfig) -> tuple[list[Any], list[Any]]:
    """(training prompts, held-out prompts): the training sets minus every prompt of the held-out set
    (texts or conversations), each prompt once."""
    held_all = read_prompts(config.heldout)
    held_set = {_key(p) for p in held_all}
    train_prompts = [
        p for name in config.prompts.split(",") if name.strip() for p in read_prompts(name.strip())
    ]
    seen, kept = held_set, []
    for prompt in train_prompts:  # in order, each once, none held out
        if _key(prompt) not in seen:
            seen.add(_key(prompt))
            kept.append(prompt)
    train_prompts = kept[: config.max_prompts]
    if not train_prompts:
        raise ValueError(f"prompts: no prompt of {config.prompts} is left outside heldout={config.heldout}")
    return train_prompts, held_all[: config.heldout_prompts]


def _key(prompt: Any) -> str:
    """A prompt as a comparable key: a text itself, a conversation as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def distill(config: DistillConfig, *, progress: bool = True) -> Path:
    """Distil a draft of `config.teacher` (see the module docstring); returns its directory
    (`output_dir/final`). Every stage resumes from what a killed run left; a bad config refuses
    (ValueError naming the key) before any model is loaded."""
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config: expected a DistillConfig, got {type(config).__name__}")
    output = Path(config.output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"output_dir: {output} exists and is not a directory")
    train_prompts, held_prompts = split_prompts(config)
    # the prompts encoded from the teacher's config and tokenizer, checked before its weights load
    header = resolve_header(config.teacher, key="teacher")
    max_length = min(config.max_length, header.config.context)  # no sequence is longer than its context
    train_request = teacher_request(header, train_prompts, config, 0)
    held_request = teacher_request(header, held_prompts, config, len(train_prompts))
    if min(map(len, train_request.encoded)) >= max_length:
        raise ValueError(
            f"max_length: every training prompt has at least {max_length} tokens, so no response "
            "token would be trained on"
        )
    with holding(output / "distill"):
        mesh = mesh_from_keys(config)
        teacher = resolve_model(config.teacher, "float32", mesh, key="teacher")
        walls: dict[str, float] = {}
        t0 = time.perf_counter()
        data = output / "data"
        common = dict(config=config, progress=progress)
        held_paths = write_chunks(teacher, held_request, data, name="heldout", samples_per_prompt=1, **common)
        train_paths = write_chunks(
            teacher, train_request, data, name="train", samples_per_prompt=config.samples_per_prompt, **common
        )
        walls["data_s"] = time.perf_counter() - t0
        examples = read_chunks(train_paths, max_length)
        held = read_chunks(held_paths, teacher.config.context)
        head_ids = None
        if config.head_tokens is not None and config.head_tokens < teacher.config.vocab_size:
            head_ids = most_probable_ids(
                examples, config.head_tokens, teacher.config.vocab_size, teacher.eos_token_ids
            )
        student = init_student(teacher, student_config(teacher.config, config, head_ids), config.seed)
        if mesh is not None:
            student = shard_model(student, mesh)
        acceptance = Acceptance(teacher, held, config.top_k)
        t1 = time.perf_counter()
        run = Run(
            config=config,
            model=student,
            loss=make_distill_loss(student.config, config.tv_weight),
            batch=lambda step: labelled_batch(
                examples, config.step_indices(len(examples), step), config.grad_accum, max_length
            ),
            examples=len(examples),
            checkpoints=output / "checkpoints",
            name="distill",
            evaluate=lambda params: acceptance(student.graph, params),
            progress=progress,
        )
        params, history = train(run)
        walls["train_s"] = time.perf_counter() - t1
        export_dtype = config.export_dtype or config.param_dtype
        draft = dataclasses.replace(student, params=jax.tree.map(lambda p: p.astype(export_dtype), params))
        final = save_model(draft, output / "final")
        report = {
            "config": dataclasses.asdict(config),
            "architecture": dataclasses.asdict(draft.config)
            | {"head_token_ids": len(head_ids or ()) or None},
            "parameters": int(sum(np.size(x) for x in jax.tree.leaves(draft.params))),
            "data": {
                "sequences": len(examples),
                "response_tokens": int(sum(len(e.values) for e in examples)),
                "heldout_positions": int(acceptance.positions),
            },
            "history": history,
            "wall_s_this_call": walls,
        }
        if config.measure_cost:
            prompt = held[0].tokens[: held[0].prompt_length].tolist()
            times = {
                name: decode_seconds_per_token(m, prompt)
                for name, m in (("teacher", teacher), ("draft", draft))
            }
            report["decode_s_per_token_batch1"] = times
            report["cost_ratio"] = times["draft"] / times["teacher"]
        write_report(output / "distill.json", report)
        return final
