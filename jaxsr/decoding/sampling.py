"""How a token is drawn: the sampling configuration, the float32 logits processors (forbidden ids and
penalties → temperature → top-k → top-p → min-p), per-row random streams, and the draws.

A `SamplingConfig` reaches the compiled programs as a `Sampling`: its form (greedy or not, top-k, which
filters and penalties run, the forbidden ids) is static, its values (temperature, top-p, min-p, the
penalties) are traced, so a sweep over the values reuses one program.

Randomness: row b's token at generated index t uses the key fold_in(seed, prompt_id, sample_id, t), so
the same seed gives the same tokens however prompts and samples are batched or bucketed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsr.checks import check_int, check_number
from jaxsr.models.layers import MASKED
from jaxsr.sharding import per_row_shard

MIN_TEMPERATURE = 1e-4
"""The smallest positive temperature: logits of O(10) over it stay far from float32's overflow."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn. `temperature=0` is greedy; `top_k=0`, `top_p=1.0` and `min_p=0.0`
    disable those filters (Hugging Face's convention). Penalties, as vLLM and transformers define them:
    `repetition_penalty` divides a positive score (multiplies a negative one) of every token the row
    generated or, with `penalize_prompt`, its prompt holds; `frequency_penalty` subtracts per time a
    token was generated, `presence_penalty` once if it was. `forbidden_token_ids` are never drawn.
    Hashable; configs that differ only in the values of the filters and penalties they turn on share one
    compiled program (`compiled`: a value at its off setting turns its step off, another program)."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalize_prompt: bool = True
    forbidden_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # NumPy scalars become their Python twins: equal configs then hash alike
        for name in VALUES:
            object.__setattr__(self, name, _float32(name, getattr(self, name)))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k))
        if not isinstance(self.penalize_prompt, bool):
            raise TypeError(f"penalize_prompt: expected a bool, got {type(self.penalize_prompt).__name__}")
        object.__setattr__(
            self, "forbidden_token_ids", _token_ids("forbidden_token_ids", self.forbidden_token_ids)
        )
        if self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature: {self.temperature} is too small to divide float32 logits by (the floor is "
                f"{MIN_TEMPERATURE}); use temperature=0 for greedy decoding"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: expected a value in [0, 1] (0 disables it), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty: expected a value > 0 (1 disables it), got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def compiled(self) -> Sampling:
        """This config as programs take it: its form static, its values traced float32 scalars."""
        sampled, repetition = not self.greedy, self.repetition_penalty != 1.0
        form = Form(  # what a step does not run is left out, so that it splits no programs
            greedy=self.greedy,
            top_k=self.top_k if sampled else 0,
            top_p=sampled and self.top_p < 1.0,
            min_p=sampled and self.min_p > 0.0,
            repetition=repetition,
            additive=self.frequency_penalty != 0.0 or self.presence_penalty != 0.0,
            penalize_prompt=repetition and self.penalize_prompt,
            forbidden=self.forbidden_token_ids,
        )
        values = {name: np.float32(getattr(self, name)) for name in VALUES}  # uncommitted: any device
        return Sampling(form=form, **values)


def _float32(name: str, value: object) -> float:
    """A finite number that stays finite in float32, the precision steps apply it in (a penalty of 1e39
    is inf there, and inf × a count of 0 turns every score into NaN)."""
    number = check_number(name, value)
    if abs(number) > FLOAT32_MAX:
        raise ValueError(
            f"{name}: expected a value within float32's range (±{FLOAT32_MAX:.4g}), got {number:g}"
        )
    return number


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    """Token ids as a sorted tuple of ints >= 0 (static: part of the program)."""
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of token ids, got {type(ids).__name__}")
    out = tuple(sorted({check_int(name, i) for i in ids}))
    if out and out[0] < 0:
        raise ValueError(f"{name}: token ids are >= 0, got {out[0]}")
    return out


FLOAT32_MAX = float(np.finfo(np.float32).max)
VALUES = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
"""The `SamplingConfig` fields a program takes as traced values."""


@dataclasses.dataclass(frozen=True)
class Form:
    """What a sampling program computes (static: another form compiles another program)."""

    greedy: bool = False
    top_k: int = 50
    top_p: bool = False
    """Whether a nucleus filter runs (its mass is a traced value)."""
    min_p: bool = False
    repetition: bool = False
    additive: bool = False
    """Whether frequency or presence penalties run."""
    penalize_prompt: bool = True
    forbidden: tuple[int, ...] = ()

    @property
    def penalties(self) -> bool:
        return self.repetition or self.additive


@struct.dataclass
class Sampling:
    """A `SamplingConfig` as the compiled programs see it (`SamplingConfig.compiled`)."""

    form: Form = struct.field(pytree_node=False)
    temperature: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array

    @property
    def greedy(self) -> bool:
        return self.form.greedy

    def against(self, scores: jax.Array) -> Sampling:
        """These values broadcastable against scores [B, ..., V]: a per-row value [B] (`per_row`)
        gets the scores' other axes; a scalar stays."""

        def shaped(value):
            return value if np.ndim(value) == 0 else value.reshape(-1, *(1,) * (scores.ndim - 1))

        return self.replace(**{name: shaped(getattr(self, name)) for name in VALUES})


def per_row(configs: Sequence[SamplingConfig]) -> Sampling:
    """One `Sampling` under which row b samples as `configs[b]`: for batches of one's own
    (`jaxsr.decoding.loop`; a search moves rows about, so searches and jobs take one config). The
    configs agree on greediness, `top_k`, `forbidden_token_ids` and `penalize_prompt`; a filter or
    penalty that any of them turns on runs for every row, where its off value keeps every token."""
    forms = [config.compiled().form for config in configs]
    if not forms:
        raise ValueError("configs: expected at least one SamplingConfig")
    static = ("greedy", "top_k", "forbidden")
    for name in static:
        if len({getattr(form, name) for form in forms}) > 1:
            raise ValueError(f"configs: rows must agree on {name}, got {[getattr(f, name) for f in forms]}")
    if len({config.penalize_prompt for config in configs}) > 1:
        raise ValueError("configs: rows must agree on penalize_prompt")
    union = {
        name: any(getattr(form, name) for form in forms)
        for name in ("top_p", "min_p", "repetition", "additive")
    }
    form = dataclasses.replace(
        forms[0], **union, penalize_prompt=union["repetition"] and configs[0].penalize_prompt
    )
    values = {name: np.array([getattr(c, name) for c in configs], np.float32) for name in VALUES}
    return Sampling(form=form, **values)


@struct.dataclass
class Past:
    """What precedes the positions a step scores, per row: its generated tokens and its prompt's. A
    history-dependent control (a penalty, a method's own `scores`) reads it; one position per row has
    `length` [B], a look-ahead's T positions [B, T] (their drafts written after the generated tokens)."""

    tokens: jax.Array
    """[B, N] int32: the row's generated tokens, then a look-ahead's drafts (the rest is stale)."""
    length: jax.Array
    """[B] or [B, T] int32: how many of `tokens` precede each scored position."""
    prompt: jax.Array
    """[B, S] int32: the row's prompt tokens, -1 on padding."""

    def last(self) -> jax.Array:
        """The token right before each scored position: [B] or [B, T] (-1 where none was generated)."""
        at = jnp.maximum(self.length - 1, 0).reshape(self.tokens.shape[0], -1)
        last = jnp.take_along_axis(self.tokens, at, axis=1, mode="clip").reshape(self.length.shape)
        return jnp.where(self.length > 0, last, -1)

    def counts(self, vocab: int) -> jax.Array:
        """How many times each token was generated before each scored position: [B, V] or
        [B, T, V] int32."""
        N = self.tokens.shape[1]
        lead = self.length.shape
        before = (jnp.arange(N) < self.length[..., None]).astype(jnp.int32)  # [*lead, N]
        tokens = jnp.broadcast_to(self.tokens.reshape(lead[:1] + (1,) * (len(lead) - 1) + (N,)), before.shape)
        index = tuple(jnp.broadcast_to(i, before.shape) for i in jnp.indices(before.shape)[:-1])
        return jnp.zeros((*lead, vocab), jnp.int32).at[(*index, tokens)].add(before)

    def in_prompt(self, vocab: int) -> jax.Array:
        """Which tokens each row's prompt holds: [B, V] (or [B, 1, V] beside T positions) bool."""
        B, S = self.prompt.shape
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
        index = jnp.where(self.prompt >= 0, self.prompt, vocab)  # padding: dropped
        seen = jnp.zeros((B, vocab), bool).at[rows, index].set(True, mode="drop")
        return seen.reshape((B,) + (1,) * (self.length.ndim - 1) + (vocab,))

    def plus(self, tokens: jax.Array) -> Past:
        """This past after one more token per row (`tokens` [B]; `length` [B])."""
        rows = jnp.arange(tokens.shape[0])
        return self.replace(
            tokens=self.tokens.at[rows, self.length].set(tokens, mode="drop"), length=self.length + 1
        )

    def then(self, drafts: jax.Array) -> Past:
        """The past of a look-ahead over `drafts` [B, T]: draft j written at the row's length + j,
        position j preceded by the first j of them (positions past the buffer are never kept)."""
        B, T = drafts.shape
        at = self.length[:, None] + jnp.arange(T)
        tokens = self.tokens.at[jnp.arange(B)[:, None], at].set(drafts, mode="drop")
        return self.replace(tokens=tokens, length=at)


@struct.dataclass
class History:
    """What penalties read of each row, broadcastable against its scores [..., V]: how many times it
    generated each token, and (repetition over the prompt) which tokens its prompt holds."""

    counts: jax.Array
    """[..., V] int32."""
    prompt: jax.Array | None = None
    """[..., V] bool, or None when the repetition penalty leaves the prompt out."""


def history(sampling: Sampling, past: Past, vocab: int) -> History | None:
    """What `sampling`'s penalties read of `past` (None without penalties)."""
    form = sampling.form
    if not form.penalties:
        return None
    seen = past.in_prompt(vocab) if form.repetition and form.penalize_prompt else None
    return History(past.counts(vocab), seen)


def controlled(scores: jax.Array, sampling: Sampling, past: History | None) -> jax.Array:
    """float32 scores [..., V] with the forbidden ids masked and the penalties applied (vLLM's order:
    repetition, then frequency and presence), before temperature and filters."""
    scores = scores.astype(jnp.float32)
    form, sampling = sampling.form, sampling.against(scores)
    if form.forbidden:
        scores = scores.at[..., jnp.asarray(form.forbidden)].set(MASKED, mode="drop")
    if past is None:
        return scores
    generated = past.counts > 0
    if form.repetition:
        seen = generated if past.prompt is None else generated | past.prompt
        rate = sampling.repetition_penalty
        scores = jnp.where(seen, jnp.where(scores > 0, scores / rate, scores * rate), scores)
    if form.additive:
        scores = scores - sampling.frequency_penalty * past.counts - sampling.presence_penalty * generated
    return scores


def process_logits(logits: jax.Array, sampling: Sampling, past: History | None = None) -> jax.Array:
    """Filtered, tempered float32 logits [..., V] (after `controlled`); removed tokens get a large
    negative value. Greedy configs return the controlled logits (argmax is taken by `draw`)."""
    logits = controlled(logits, sampling, past)
    form, sampling = sampling.form, sampling.against(logits)
    if form.greedy:
        return logits
    logits = logits / sampling.temperature
    if 0 < form.top_k < logits.shape[-1]:
        # .min rather than [..., -1:]: XLA:CPU otherwise re-runs top_k for every element it masks
        kth = top_k(logits, form.top_k)[0].min(-1, keepdims=True)
        logits = jnp.where(logits < kth, MASKED, logits)
    if form.top_p:
        kept = _top_p_sorted(-jnp.sort(-logits, axis=-1), sampling.top_p)
        threshold = jnp.where(kept > MASKED, kept, jnp.inf).min(-1, keepdims=True)
        logits = jnp.where(logits < threshold, MASKED, logits)
    if form.min_p:
        logits = _min_p(logits, sampling.min_p)
    return logits


def _min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Mask tokens whose probability is under `min_p` times the most likely one's (ratio of softmaxes:
    a difference of logits, so it holds before or after other filters renormalise)."""
    floor = logits.max(-1, keepdims=True) + jnp.log(min_p)
    return jnp.where(logits < floor, MASKED, logits)


TOP_K_BLOCK = 64
"""Width of the blocks `top_k` ranks by their maxima before searching inside the best of them."""


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of row-led `x`, each `data` shard's rows on their own
    (`sharding.per_row_shard`: XLA GPU's top-k cannot split by rows and would gather them all). A TPU
    runs its own top-k: the blocked search's padded copy and [blocks, 64] tiles (a TPU pads the 64 to
    128) held 3 times the scores' bytes (4.2 against 1.4 GB for 4772 rows of a 75968-token shard)."""
    own = lambda x: tuple(jax.lax.top_k(x, k))
    search = partial(jax.lax.platform_dependent, tpu=own, default=partial(_blocked_top_k, k=k))
    return per_row_shard(search, x)


def _blocked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis (values descending, ties to the lower index), searching only
    the k blocks with the largest maxima: every top-k element lies in one of them, since a block that
    holds one has a maximum at least that large. Over a 49152-token vocabulary that is a top-k over
    3200 candidates, several times cheaper on CPU. Equal to `lax.top_k` but where block maxima tie."""
    V = x.shape[-1]
    blocks = -(-V // TOP_K_BLOCK)
    if blocks <= 2 * k:
        return tuple(jax.lax.top_k(x, k))
    lead = x.shape[:-1]
    fill = jnp.full((*lead, blocks * TOP_K_BLOCK - V), -jnp.inf, x.dtype)
    tiled = jnp.concatenate([x, fill], axis=-1).reshape(*lead, blocks, TOP_K_BLOCK)
    best = jnp.sort(jax.lax.top_k(tiled.max(-1), k)[1], axis=-1)  # index order keeps lax's tie rule
    candidates = jnp.take_along_axis(tiled, best[..., None], axis=-2).reshape(*lead, k * TOP_K_BLOCK)
    values, where = jax.lax.top_k(candidates, k)
    first = jnp.take_along_axis(best, where // TOP_K_BLOCK, axis=-1) * TOP_K_BLOCK
    return values, (first + where % TOP_K_BLOCK).astype(jnp.int32)


def _top_p_sorted(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask descending-sorted logits outside the nucleus (the top token always stays)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs
    return jnp.where(above < top_p, sorted_logits, MASKED)


def draw(keys: jax.Array, logits: jax.Array, sampling: Sampling, past: History | None = None) -> jax.Array:
    """One token per row [B] from raw logits [B, V] with per-row keys, distributed as
    softmax(process_logits(logits)). With top-k on, only the k candidates are sampled from, which
    avoids drawing V Gumbel variables per row (equal in law; exact ties at the k-th logit aside)."""
    form = sampling.form
    if form.greedy:
        return jnp.argmax(controlled(logits, sampling, past), axis=-1).astype(jnp.int32)
    V = logits.shape[-1]
    if 0 < form.top_k < V:
        values, index = top_k(controlled(logits, sampling, past), form.top_k)
        sampling = sampling.against(values)
        values = values / sampling.temperature
        if form.top_p:
            values = _top_p_sorted(values, sampling.top_p)
        if form.min_p:
            values = _min_p(values, sampling.min_p)
        choice = jax.vmap(jax.random.categorical)(keys, values)
        return jnp.take_along_axis(index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    probs = jax.nn.softmax(process_logits(logits, sampling, past), axis=-1)
    return jax.vmap(draw_from)(keys, probs)


CDF_BLOCK = 256
"""Width of the blocks `draw_from` searches: one cumulative sum over the block totals, one inside the
chosen block."""


def draw_from(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token from a distribution [V] (need not be normalised) by inverse CDF with a single uniform;
    zero-probability tokens are never drawn. Searching block totals first, then one block, costs O(V)
    additions: Gumbel-max would hash V random numbers per draw (~1.5 ms per row at V = 49152 on CPU)."""
    V = probs.shape[-1]
    nb = -(-V // CDF_BLOCK)
    blocks = jnp.pad(probs.astype(jnp.float32), (0, nb * CDF_BLOCK - V)).reshape(nb, CDF_BLOCK)
    totals = blocks.sum(-1)
    upto = jnp.cumsum(totals)
    target = jax.random.uniform(key, (), jnp.float32) * upto[-1]
    b = _last_positive_clamp((upto <= target).sum(), totals)
    within = jnp.cumsum(blocks[b])
    rest = target - jnp.where(b > 0, upto[jnp.maximum(b - 1, 0)], 0.0)
    j = _last_positive_clamp((within <= rest).sum(), blocks[b])
    return (b * CDF_BLOCK + j).astype(jnp.int32)


def _last_positive_clamp(index: jax.Array, weights: jax.Array) -> jax.Array:
    """`index`, or the last position of positive weight where rounding pushed it past that."""
    last = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[0]), 0))
    return jnp.minimum(index, last)


def probabilities(scores: jax.Array, sampling: Sampling, past: History | None = None) -> jax.Array:
    """The sampling distribution [..., V] (float32) of raw scores: softmax of the processed scores,
    or the one-hot argmax when greedy. Speculative steps sample and test with exactly these."""
    if sampling.greedy:
        best = jnp.argmax(controlled(scores, sampling, past), axis=-1)
        return jax.nn.one_hot(best, scores.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(scores, sampling, past), axis=-1)


def row_keys(seed: jax.Array, prompt_id: jax.Array, sample_id: jax.Array, index: jax.Array) -> jax.Array:
    """Per-row PRNG keys that depend only on (seed, prompt, sample, token index)."""

    def one(p, s, t):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), p)
        return jax.random.fold_in(jax.random.fold_in(key, s), t)

    return jax.vmap(one)(prompt_id, sample_id, index)


def token_statistics(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Raw log-probability of `tokens` [...] under `logits` [..., V], and the distribution's
    self-certainty KL(U ‖ p) = −log V − mean_v log p_v (Kang et al. 2025), both float32; U is uniform
    over the ids the head scores (a subset head leaves the others at −inf)."""
    logits = logits.astype(jnp.float32)
    norm = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    scored = logits > -jnp.inf
    count = scored.sum(-1)
    mean = jnp.where(scored, logits, 0.0).sum(-1) / count
    return chosen - norm, norm - mean - jnp.log(count.astype(jnp.float32))
