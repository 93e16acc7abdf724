"""The sampler (models + method + sampling + contrast weights) and the one batch set-up every driver uses.

A batch is set up in two steps: `Sampler.prefill_prompts` (left-pad, prefill each prompt once per
model) and `Sampler.start` (the rows of a `Layout`, each with its first token) — or, for a batch of
prompt slots that prompts stream through, `Sampler.empty_slab` and `Sampler.insert`. `Sampler.decode_loop`
then runs the one token loop (until done or a pause), `state.to_host` brings the rows back in one
transfer, and `Sampler.compact` gathers survivors. `jaxsr.decoding.continuous.decode` drives plain
decoding calls; the searches (`jaxsr.search.scheduler`) and training's teacher sampling drive the
same steps."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsr import text
from jaxsr.decoding import loop, stops
from jaxsr.decoding.contrast import Contrast
from jaxsr.decoding.inputs import Request, check_language_model, check_sampling
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState, compact, response, stop_token
from jaxsr.decoding.steps import Controls, Method, PlainSampling
from jaxsr.ladder import bucket, round_up
from jaxsr.models.cache import slot_tile
from jaxsr.models.model import Model
from jaxsr.results import Sample
from jaxsr.sharding import data_shards, mesh_of, on_mesh, padded_rows

DEFAULT_MAX_ROWS = 64
"""Rows a call decodes per `data` shard unless told or sized by memory (`default_rows`); `decode`'s
default in all."""


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Models decoding as one: `models[0]` is the target (the model sampled from, or the expert; its
    tokenizer, EOS ids and log-probabilities are the samples'), the others are what `method` runs
    beside it (a draft or an amateur, sharing its vocabulary), drawing tokens as `sampling` says. Build
    one with `jaxsr.speculative_decoder`, `contrastive_decoder`, `speculative_contrastive_decoder`,
    `as_sampler(model)` for plain sampling, or `Sampler((model,), YourMethod())`."""

    models: tuple[Model, ...]
    method: Method
    contrast: Contrast | None = None
    """Traced contrast weights (contrastive methods), else None."""
    sampling: SamplingConfig = SamplingConfig()
    """How tokens are drawn; its values reach the programs traced (`controls`). An entry point's own
    `sampling` argument (`jaxsr.generate`, the searches), when given, replaces it."""

    @property
    def controls(self) -> Controls:
        """What the programs take beside the state: the sampling values and the contrast weights."""
        return Controls(self.sampling.compiled(), self.contrast)

    @property
    def target(self) -> Model:
        return self.models[0]

    @property
    def second(self) -> Model:
        """The draft or amateur."""
        return self.models[1]

    @property
    def roles(self) -> tuple[str, ...]:
        """`token_forwards` keys of the models, in order."""
        return self.method.roles

    @property
    def headroom(self) -> int:
        return self.method.headroom

    @property
    def slot_tile(self) -> int:
        """Slots its row caches are rounded up to a multiple of (`cache.slot_tile`: a TPU's tile where it
        stores keys as values, else 1)."""
        platform = jax.default_backend() if self.mesh is None else self.mesh.devices.flat[0].platform
        return max(slot_tile(m.config.head_dim, m.config.quantized_kv, platform) for m in self.models)

    def cache_slots(self, tokens: int) -> int:
        """Slots of a row cache for `tokens` generated tokens: those, the method's look-ahead headroom,
        rounded up to whole `slot_tile`s."""
        return round_up(tokens + self.headroom, self.slot_tile)

    @property
    def slot_bytes(self) -> int:
        """Bytes one token position takes in all of the sampler's caches."""
        return sum(m.kv_slot_bytes for m in self.models)

    @property
    def row_work_bytes(self) -> int:
        """Bytes a decode step holds per row on a device beside its caches: vocabulary-sized float32
        arrays (logits, their softmax, sampling noise and masks), WORK_VOCAB_COPIES of them per position
        the step scores (a speculative step scores its look-ahead's), PENALTY_VOCAB_COPIES more with
        penalties on (the rows' token counts and what they mask); the device's share of the vocabulary
        where the `model` axis splits it."""
        vocab = self.target.config.vocab_size
        split = 1 if self.mesh is None else self.mesh.shape.get("model", 1)
        share = vocab // split if vocab % split == 0 else vocab
        copies = WORK_VOCAB_COPIES + PENALTY_VOCAB_COPIES * self.sampling.compiled().form.penalties
        return copies * 4 * share * max(1, self.headroom)

    @property
    def mesh(self) -> Mesh | None:
        return mesh_of(*self.models)

    def with_sampling(self, sampling: SamplingConfig) -> Sampler:
        return dataclasses.replace(self, sampling=sampling)

    def on_mesh(self):
        return on_mesh(*self.models)

    def prefill(self, tokens: jax.Array, mask: jax.Array, slots: int | None = None) -> tuple[tuple, tuple]:
        """Prefill left-padded prompts once per model: (last-position logits, prompt caches; in `slots`
        slots when given)."""
        out = [loop.prefill(m.graph, m.params, tokens, mask, slots=slots) for m in self.models]
        return tuple(z for z, _ in out), tuple(c for _, c in out)

    def prefill_prompts(
        self, prompts: Sequence[list[int]], rows: int, length: int | None = None, slots: int | None = None
    ) -> Prefill:
        """The prompts left-padded to [rows, length] (default: the longest's bucket; rows past the
        prompts are padding) and prefilled once per model, their caches in `slots` slots when given."""
        length = bucket(max(map(len, prompts))) if length is None else length
        logits, caches = self.prefill(*padded(prompts, rows, length), slots)
        return Prefill(logits, caches, rows * length)

    def init_state(self, prefilled: tuple[tuple, tuple], new: loop.NewRows, **capacities: int) -> DecodeState:
        """New rows after a prefill (`capacity`, `cache_capacity` as `loop.init_state`'s)."""
        return loop.init_state(*prefilled, self.controls, new, method=self.method, **capacities)

    def start(
        self, prefill: Prefill, layout: Layout, request: Request, segment: int | None = None
    ) -> DecodeState:
        """The rows of `layout` after `prefill`, each with its first token: token buffers for the
        request's `max_new_tokens` (bucketed), row caches of `segment` slots plus the method's
        look-ahead headroom (default: as many, in whole tiles: `cache_slots`)."""
        new = layout.new_rows(self.target, request)
        return self.init_state(prefill[:2], new, **self.capacities(request, segment))

    def capacities(self, request: Request, segment: int | None = None) -> dict[str, int]:
        """`start`'s token-buffer and row-cache lengths (`loop.init_state`'s static arguments)."""
        capacity = bucket(request.max_new_tokens)
        cache_capacity = self.cache_slots(capacity) if segment is None else segment + self.headroom
        return {"capacity": capacity, "cache_capacity": cache_capacity}

    def compiled_loop(self, state: DecodeState, prompts: tuple, slots: bool = False) -> Any:
        """The decode loop compiled for this state's shapes (paused or not): (params, state, prompts,
        controls, pause) → state; with `slots`, one that also pauses when enough prompt slots are free
        (`loop.Pause.free`)."""
        return loop.decode_loop.lower(
            self.graphs,
            self.params,
            state,
            prompts,
            self.controls,
            method=self.method,
            pause=loop.Pause(free=loop.NO_PAUSE if slots else None),
        ).compile()

    def decode_loop(
        self, state: DecodeState, prompts: tuple, pause_at: jax.Array | None, observer: Any = None
    ) -> DecodeState:
        """Decode until every row is done or has `pause_at` tokens (the state is donated; None never
        pauses, a program of its own); an `observer` (`loop.Observer`) records beside the tokens."""
        pause = None if pause_at is None else loop.Pause(tokens=pause_at)
        return loop.decode_loop(
            self.graphs, self.params, state, prompts, self.controls,
            method=self.method, pause=pause, observer=observer,
        )  # fmt: skip

    def empty_slab(self, caches: tuple, new: loop.NewRows, request: Request) -> tuple[DecodeState, tuple]:
        """A batch of prompt slots with none taken (`loop.empty_slab`), its caches shaped as `caches`'
        and sized for the request's `max_new_tokens` (`capacities`)."""
        return loop.empty_slab(caches, new, **self.capacities(request))

    def insert(
        self, state: DecodeState, caches: tuple, prefill: Prefill, new: loop.NewRows, source: np.ndarray
    ) -> tuple[DecodeState, tuple]:
        """Start rows `new` of `prefill`'s prompts in the slots `source` gives them (`loop.insert`;
        the state and its caches are donated)."""
        return loop.insert(
            state, caches, prefill[:2], self.controls, new, jnp.asarray(source), method=self.method
        )

    def compact(
        self, state: DecodeState, index: jax.Array, alive: jax.Array, cache_capacity: int, sample_ids=None
    ) -> DecodeState:
        """Gather rows `index` (see `state.compact`; the state is not donated)."""
        return compact(state, index, alive, sample_ids, cache_capacity=cache_capacity)

    @property
    def graphs(self) -> tuple:
        return tuple(m.graph for m in self.models)

    @property
    def params(self) -> tuple:
        return tuple(m.params for m in self.models)


def as_sampler(sampler: Any, sampling: SamplingConfig | None) -> Sampler:
    """The sampler of a `Model` (plain sampling) or a `Sampler` (the entry points' `model` argument),
    sampling with `sampling`; None keeps a sampler's own (a model's: `SamplingConfig()`)."""
    if isinstance(sampler, Sampler):
        return sampler if sampling is None else sampler.with_sampling(check_sampling(sampling))
    if isinstance(sampler, Model):
        sampling = SamplingConfig() if sampling is None else check_sampling(sampling)
        return Sampler((check_language_model(sampler, "model"),), PlainSampling(), sampling=sampling)
    raise TypeError(
        "model: expected a jaxsr.Model (language model) or a sampler from jaxsr.speculative_decoder / "
        f"contrastive_decoder / speculative_contrastive_decoder, got {type(sampler).__name__}"
    )


def default_rows(sampler: Sampler) -> int:
    """Rows one call decodes when neither told (`max_rows=None`) nor sized by memory (no budget, and a
    device that reports no free memory: CPU; `decoding.memory.call_rows`): DEFAULT_MAX_ROWS a `data`
    shard, times the shards, rounded down to a power of two."""
    return 1 << ((DEFAULT_MAX_ROWS * data_shards(sampler.mesh)).bit_length() - 1)


WORK_VOCAB_COPIES = 6
"""Float32 vocabulary-sized arrays a decode step holds per row and scored position, rounded up from the
compiled programs' temporaries (`jaxsr plan`, Llama-3.1-8B widths): 5.4 on a TPU v5e for plain and
contrastive sampling, 29 over the 5 positions of speculative decoding with γ=4; 1.1 on an H100."""
PENALTY_VOCAB_COPIES = 3
"""Vocabulary-sized 4-byte arrays penalties add per row and scored position: the generated tokens'
counts, the prompt's tokens (1 byte), and the penalized scores (not measured on an accelerator yet)."""


def padded(prompts: Sequence[list[int]], rows: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Prefill's inputs: the prompts left-padded to [rows, length] tokens and their mask, on device."""
    tokens, mask = text.left_pad(list(prompts), rows, length)
    return jnp.asarray(tokens), jnp.asarray(mask)


class Prefill(NamedTuple):
    """Prompts prefilled once per model."""

    logits: tuple[jax.Array, ...]
    """Each model's last-position logits [P, V]: what every row's first token is drawn from."""
    caches: tuple
    """Each model's `PromptCache`, shared by the prompts' rows."""
    positions: int
    """Prompt positions run through each model (padding included)."""


def stop_id_matrix(model: Model, rows: int, extra: Sequence[int]) -> np.ndarray:
    ids = list(dict.fromkeys([*model.eos_token_ids, *extra]))
    width = bucket(len(ids), 1) if ids else 1
    matrix = np.full((rows, width), -1, np.int32)
    matrix[:, : len(ids)] = ids
    return matrix


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which rows a batch holds: `prompts` groups of `rows` rows, each group the rows of one prompt
    (they attend to its prompt cache). The first groups are the request's prompts `indices`, the rest
    padding; in a real group the first `live` rows are samples first_sample … (alive while below
    `num_samples`), the rest padding that lets the batch split over a mesh's `data` shards (see
    `batches`)."""

    indices: tuple[int, ...]
    """The request indices of the real groups' prompts."""
    prompts: int
    rows: int
    live: int
    first_sample: int = 0
    num_samples: int | None = None
    """Samples the call draws per prompt (None: `live`)."""

    def new_rows(self, model: Model, request: Request) -> loop.NewRows:
        """`init_state`'s per-row inputs (random streams from the request's seed and prompt indices)."""
        G, P, real_prompts = self.rows, self.prompts, len(self.indices)
        num_samples = self.live if self.num_samples is None else self.num_samples
        sample_ids = np.tile(self.first_sample + np.arange(G), P)
        real = np.repeat(np.arange(P) < real_prompts, G) & np.tile(np.arange(G) < self.live, P)
        ids = [request.prompt_ids[i] for i in self.indices]
        ids += (ids[-1:] or [0]) * (P - real_prompts)  # padding groups: dead rows, any stream
        return loop.NewRows(
            seed=np.uint32(request.seed),
            prompt_ids=jnp.asarray(np.array(ids, np.int32)),
            sample_ids=jnp.asarray(sample_ids, jnp.int32),
            alive=jnp.asarray(real & (sample_ids < num_samples)),
            max_new_tokens=jnp.full((P * G,), request.max_new_tokens, jnp.int32),
            stop_ids=jnp.asarray(stop_id_matrix(model, P * G, request.stop_token_ids)),
            stops=request.stops,
        )


def batches(
    prompts: list[list[int]], num_samples: int, max_rows: int, mesh: Mesh | None = None
) -> Iterator[list[Layout]]:
    """The layouts of each batch of at most `max_rows` rows (plus mesh padding), one per chunk of
    samples sharing the batch's prefill: G = min(num_samples, max_rows) samples of P prompts, P a
    power of two (one compiled shape for every full batch); a prompt with more than G samples gets them
    in several chunks. Prompts are batched shortest first, each batch within one length bucket (the
    length its prefill pads to), so that prefill pads little. Each prompt's rows are padded with dead
    ones to R ≥ G so that the batch splits over the mesh's `data` shards (R = G without a mesh)."""
    G = min(num_samples, max_rows)
    for indices in batch_indices([len(p) for p in prompts], num_samples, max_rows):
        yield layouts_of(indices, num_samples, G, mesh)


def batch_indices(lengths: Sequence[int], num_samples: int, max_rows: int) -> Iterator[tuple[int, ...]]:
    """The prompts (by index) of each of `batches`' batches, for prompts of these token `lengths`."""
    per_batch = 1 << (max(1, max_rows // min(num_samples, max_rows)).bit_length() - 1)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for _, group in itertools.groupby(order, key=lambda i: bucket(lengths[i])):
        same_length = list(group)
        for start in range(0, len(same_length), per_batch):
            yield tuple(same_length[start : start + per_batch])


def layouts_of(indices: tuple[int, ...], num_samples: int, G: int, mesh: Mesh | None) -> list[Layout]:
    """One batch of `indices`' prompts (padded to a power of two), one layout per chunk of G samples."""
    P = bucket(len(indices), 1)
    R = padded_rows(G, mesh, groups=P)
    return [Layout(indices, P, R, G, first, num_samples) for first in range(0, num_samples, G)]


INPUTS_LOCK = threading.Lock()
"""Held while a thread compiling ahead (`continuous.compile_slab`) places a batch's small inputs on
device: a new shape's first placement compiles a little program (jax's `stage`), which threads placing
the same shape at once would each compile."""


def outputs(info: Any, sampler: Sampler, inputs: Any) -> Any:
    """A compiled program's outputs (`out_info`) as its call returns them: committed to their shardings
    (abstract values with a sharding) when the sampler has a mesh or an input was committed, else free
    to move (without one), as jax places a program's outputs."""
    committed = sampler.mesh is not None or any(
        x.committed if isinstance(x, jax.Array) else getattr(x, "sharding", None) is not None
        for x in jax.tree.leaves(inputs)
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct)
    )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None), info
    )


def samples_of(model: Model, host: DecodeState, stop: Sequence[str] = ()) -> list[Sample]:
    """`Sample`s of every row of `host` (a decoded batch's rows on the host, `state.to_host`), texts
    decoded with `model`'s tokenizer in one batch and cut before the first of the `stop` strings;
    unscored (`search.candidates.score_samples`)."""
    responses = [response(host, r) for r in range(len(host.alive))]
    texts = [stops.cut(t, stop) for t in text.decode_batch(model.tokenizer, responses)]
    return [
        Sample(
            token_ids=ids,
            text=t,
            finished=bool(host.finished[r]),
            logprob=float(host.logprob_sum[r]),
            index=int(host.sample_id[r]),
            stop_token=stop_token(host, r),
            certainty=float(host.certainty_sum[r]),
            stop_string=found,
        )
        for r, (ids, (t, found)) in enumerate(zip(responses, texts, strict=True))
    ]


@dataclasses.dataclass
class Run:
    """What a plain decoding call (`continuous.decode`) gives back."""

    rows: list[DecodeState]
    """Per prompt, its decoded rows on the host (`state.to_host`; alive rows only) by sample index."""
    stats: list[dict[str, Any]]
    decode_s: float
    """Total decode time of the call (rows' set-up and token loops; compilation excluded)."""
    num_samples: int
    max_rows: int
    least_slots: int
    """The call's samples per prompt, most rows decoded together and its slabs' fewest prompt slots."""
    shapes: Any = None
    """Shapes of the last batch's row caches and prompt caches (for `cost.measure_call_costs`: shapes
    only, so that no finished batch's cache stays alive while the next one decodes)."""
