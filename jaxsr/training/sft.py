"""Supervised fine-tuning on the responses a job chose: its config, its loss and `sft`, the run
(the optimiser, step and resumable loop are `jaxsr.training.loop`'s). The loss is the mean negative
log-likelihood over every response token of a step; parameters are placed on the mesh the way
inference places them, batch rows split over `data`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.checks import user_path
from jaxsr.configs import check_field_types, check_mesh_keys, load_config
from jaxsr.loading.api import save_model
from jaxsr.loading.resolve import mesh_from_keys, resolve_header, resolve_model
from jaxsr.locks import holding
from jaxsr.training.data import (
    SELECTIONS,
    Example,
    make_batch,
    read_results,
    select_responses,
    tokenize_examples,
)
from jaxsr.training.loop import Batch, Run, RunKeys, check_run_keys, train, write_report

PLACEMENT_KEYS = ("output_dir", "save_every", "mesh_data", "mesh_model")
"""Where a run writes, how often it checkpoints and on which devices: a run may resume with others."""
POSITIVE_INTS = ("k", "max_length", "batch_size", "grad_accum", "steps", "save_every")


@dataclasses.dataclass
class SFTConfig(RunKeys):
    """A fine-tuning run. Every key a YAML file or override may set is a field here."""

    placement_keys: ClassVar[tuple[str, ...]] = PLACEMENT_KEYS

    model: str = "smollm2"
    """The model to fine-tune, as a job names it (a checkpoint, a hub id, `smollm2`, `smollm2-draft`)."""
    data: str | None = None
    """A results JSONL written by `jaxsr run` (records with `prompt` and scored `samples`)."""
    output_dir: str = "out/sft"
    """Checkpoints go to `checkpoints/`, the fine-tuned model (HF safetensors) to `final/`."""
    select: str = "best"
    """Responses learnt per prompt: `best`, the `top_k` by score, or every one scored >= `threshold`."""
    k: int = 1
    threshold: float | None = None
    chat: bool | None = None
    """Prompts through the model's chat template (None: when its tokenizer has one), as inference does."""
    max_length: int = 512
    """Prompt + response tokens kept per example (longer ones are cut at the end; never past the model's
    context)."""
    batch_size: int = 8
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    steps: int = 100
    learning_rate: float = 1e-5
    """Peak learning rate, reached after a linear warm-up, then decayed along a cosine."""
    end_learning_rate: float = 0.0
    warmup_steps: int = 10
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, applied to matrices only (not to norms and biases)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    param_dtype: str = "float32"
    """`bfloat16`: forward/backward and the exported model in bfloat16, master weights in float32."""
    save_every: int = 50
    seed: int = 0
    """Fixes the order of the examples (each epoch a permutation drawn from the seed)."""
    mesh_data: int | None = None
    mesh_model: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        self.output_dir = str(user_path("output_dir", self.output_dir))
        check_mesh_keys(self)
        if self.data is None:
            raise ValueError("data: expected the path of a results JSONL (the output of `jaxsr run`)")
        self.data = str(user_path("data", self.data))
        if self.select not in SELECTIONS:
            raise ValueError(f"select: expected one of {SELECTIONS}, got {self.select!r}")
        if (self.threshold is None) == (self.select == "threshold"):
            raise ValueError(f"threshold: needed with select=threshold and only then (select={self.select})")
        if self.k != 1 and self.select != "top_k":
            raise ValueError(f"k: select={self.select} does not use it (select=top_k does)")
        for name in POSITIVE_INTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        check_run_keys(self)


def load_sft_config(path: str | Path | None, overrides: list[str] = ()) -> SFTConfig:
    """Read `path` (YAML mapping of `SFTConfig` keys) and apply `key=value` overrides."""
    return load_config(SFTConfig, path, overrides)


# -- loss and batches ------------------------------------------------------------------------------
def response_nll(logits: jax.Array, tokens: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed negative log-likelihood, count) of the tokens marked in `targets` ([..., T] 0/1): the
    logits at position t predict token t + 1, so prompt and padding tokens add nothing."""
    logprobs = jax.nn.log_softmax(logits[..., :-1, :], axis=-1)
    picked = jnp.take_along_axis(logprobs, tokens[..., 1:, None], axis=-1)[..., 0]
    weight = targets[..., 1:].astype(jnp.float32)
    return -(picked * weight).sum(), weight.sum()


def sft_loss(module: nnx.Module, micro: Batch) -> tuple[jax.Array, jax.Array]:
    """The response tokens' summed negative log-likelihood under `module`, and their count; the output
    layer runs on the batch's response window only (`make_batch`)."""
    window = micro["targets"].shape[-1]
    hidden, _ = module.prefill(micro["tokens"], micro["mask"])
    return response_nll(
        module.logits(hidden[..., -window:, :]), micro["tokens"][..., -window:], micro["targets"]
    )


def step_batch(
    examples: list[Example], config: SFTConfig, step: int, max_length: int
) -> dict[str, np.ndarray]:
    """The batch of step `step` (0-based): the next `examples_per_step` of the seed's example stream."""
    return make_batch(examples, config.step_indices(len(examples), step), config.grad_accum, max_length)


# -- the run --------------------------------------------------------------------------------------
def sft(config: SFTConfig, *, progress: bool = True) -> Path:
    """Fine-tune `config.model` on the selected responses of `config.data`; returns the directory of the
    fine-tuned model (`output_dir/final`, a Hugging Face checkpoint; `output_dir/sft.json` records the
    data sizes and the loss at every checkpoint). Resumes from the newest checkpoint
    in `output_dir/checkpoints`; a config or data that refuses (ValueError naming the key) does so
    before any model is loaded or any step taken."""
    if not isinstance(config, SFTConfig):
        raise TypeError(f"config: expected an SFTConfig, got {type(config).__name__}")
    output = Path(config.output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"output_dir: {output} exists and is not a directory")
    pairs = select_responses(read_results(config.data), config.select, k=config.k, threshold=config.threshold)
    if not pairs:
        raise ValueError(f"data: {config.data}: no response selected ({_selection(config)})")
    examples, max_length = _examples(config, pairs)  # from the model's config and tokenizer: no weights yet
    with holding(output / "sft"):
        model = resolve_model(config.model, "float32", mesh_from_keys(config))
        run = Run(
            config=config,
            model=model,
            loss=sft_loss,
            batch=lambda step: step_batch(examples, config, step, max_length),
            examples=len(examples),
            checkpoints=output / "checkpoints",
            name="sft",
            progress=progress,
        )
        start = time.perf_counter()
        params, history = train(run)
        wall = time.perf_counter() - start
        params = jax.tree.map(lambda p: p.astype(config.param_dtype), params)
        final = save_model(dataclasses.replace(model, params=params), output / "final")
        report = {
            "config": dataclasses.asdict(config),
            "data": {
                "examples": len(examples),
                "response_tokens": int(sum(len(e.tokens) - e.prompt_length for e in examples)),
            },
            "history": history,
            "train_s_this_call": wall,
        }
        write_report(output / "sft.json", report)
        return final


def _examples(config: SFTConfig, pairs: list) -> tuple[list[Example], int]:
    """The selected responses encoded as the model's tokenizer and template encode them, cut to the
    model's context, and that length; refused (naming the key) where the model or the data cannot
    be trained on — all read from the model's header, before its weights load."""
    header = resolve_header(config.model)
    if header.config.head_token_ids is not None:  # its loss would be infinite at any other id
        raise ValueError(
            f"model: {config.model} scores only {header.config.head_size} of its "
            f"{header.config.vocab_size} ids (a distilled draft); fine-tuning needs a full output layer"
        )
    max_length = min(config.max_length, header.config.context)  # no example is longer than its context
    examples = tokenize_examples(header, pairs, chat=config.chat, max_length=max_length)
    if not examples:
        raise ValueError(f"data: {config.data}: no selected response fits max_length={config.max_length}")
    return examples, max_length


def _selection(config: SFTConfig) -> str:
    extra = {"top_k": f" k={config.k}", "threshold": f" threshold={config.threshold}"}.get(config.select, "")
    return f"select={config.select}{extra}"
