"""Exactness of speculative (SD), contrastive (CD) and speculative-contrastive (SCD) decoding.

Tiny random models (vocabulary 8) generate up to 4 tokens; 10^5 rows decoded together by the jitted
core give an empirical joint over whole token sequences, compared with the exact autoregressive target
joint enumerated from the models' full forward passes (`Model.logits`): a chi-square test (p > 1e-3)
and a total variation no larger than what as many exact draws show. Each γ runs on another batch
composition (one prompt and 4 tokens, so a fully accepted draft is followed by more drafting; two
prompts of different lengths with mixed token budgets and padding rows; an EOS id that ends rows
early under temperature/top-k/top-p), so the distribution must not depend on γ or on the batch.
The measured acceptance count must be within 4σ of its exact expectation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from tiny import tiny_config

from jaxsr.decoding import loop
from jaxsr.decoding.contrast import contrastive_scores, make_contrast
from jaxsr.decoding.driver import Sampler
from jaxsr.decoding.sampling import History, SamplingConfig, probabilities
from jaxsr.decoding.speculative import SpeculativeContrastiveDecoding, SpeculativeDecoding, residual
from jaxsr.decoding.steps import ContrastiveDecoding
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model
from jaxsr.text import left_pad

V = 8
N = 100_000
SMALL = dict(
    vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32
)
PLAIN = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
PROCESSED = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)
PENALIZED = SamplingConfig(
    temperature=1.0, top_k=0, min_p=0.02, repetition_penalty=1.6, frequency_penalty=0.4, presence_penalty=0.3
)
"""Penalties over the prompt and the row's tokens (so the target distribution depends on the drafts
before each position), and min-p."""
CONTRAST = make_contrast(alpha=0.1, beta=0.5)
EOS = 5


def contextual_model(seed: int, **overrides) -> Model:
    """A tiny random decoder whose attention output is scaled up: random models are otherwise nearly
    bigram models, blind to the cache and positions whose handling these tests must check."""
    module = Decoder(tiny_config(**SMALL | overrides), rngs=nnx.Rngs(seed))
    module.lm_head[...] = module.lm_head[...] * 15.0
    for block in module.blocks:
        attn = block.attn
        attn.v[...], attn.o[...] = attn.v[...] * 5.0, attn.o[...] * 5.0
        attn.q[...], attn.k[...] = attn.q[...] * 3.0, attn.k[...] * 3.0
    return Model.from_module(module, name=f"contextual-{seed}")


@functools.cache
def models() -> tuple[Model, Model]:
    return contextual_model(3), contextual_model(4)


COMPOSITIONS = {
    # prompts, rows per prompt, each row's budget and alive flag (functions of its sample id), stops
    "one prompt": dict(
        prompts=[[1, 2, 3]], G=N, budget=lambda s: 4 + 0 * s, alive=lambda s: s >= 0, stop=(), sampling=PLAIN
    ),
    "two prompts, mixed budgets, padding rows": dict(
        prompts=[[7, 1, 4], [2, 0, 0, 6, 3]],
        G=N // 2,
        budget=lambda s: 3 - s % 2,
        alive=lambda s: s < N // 2 - 500,
        stop=(),
        sampling=PLAIN,
    ),
    "eos, processed sampling": dict(
        prompts=[[4, 6]],
        G=N,
        budget=lambda s: 3 + 0 * s,
        alive=lambda s: s >= 0,
        stop=(EOS,),
        sampling=PROCESSED,
    ),
    "penalties": dict(
        prompts=[[1, 2, 1]],
        G=N,
        budget=lambda s: 4 + 0 * s,
        alive=lambda s: s >= 0,
        stop=(),
        sampling=PENALIZED,
    ),
}


def decoder(kind: str, gamma: int, sampling: SamplingConfig) -> Sampler:
    """The target and draft as the `kind` decoder, sampling with `sampling`."""
    if kind == "CD":
        method, weights = ContrastiveDecoding(), CONTRAST
    elif kind == "SD":
        method, weights = SpeculativeDecoding(gamma=gamma), None
    else:
        method, weights = SpeculativeContrastiveDecoding(gamma=gamma), CONTRAST
    return Sampler(models(), method, weights, sampling)


@functools.cache
def decode(kind: str, gamma: int, comp: str, permuted: bool = False):
    """`run` of the `kind` decoder of `models()`."""
    return run(decoder(kind, gamma, COMPOSITIONS[comp]["sampling"]), comp, permuted)


def run(d: Sampler, comp: str, permuted: bool = False):
    """Run the jitted core on one batch of 10^5 rows: per row (prompt index, sample id, tokens,
    length, accepted). `permuted` reverses the prompts' order and the sample ids within each prompt."""
    c = COMPOSITIONS[comp]
    order = list(range(len(c["prompts"])))[:: -1 if permuted else 1]
    prompts, G = [c["prompts"][i] for i in order], c["G"]
    sample_ids = np.tile(np.arange(G)[:: -1 if permuted else 1], len(prompts))
    budget = c["budget"](sample_ids)
    L, P, B = int(budget.max()), len(prompts), len(sample_ids)
    tokens, mask = map(jnp.asarray, left_pad(prompts, P, max(map(len, prompts))))
    prefilled = d.prefill(tokens, mask)
    stop = np.full((B, 1), -1, np.int32)
    stop[:, : len(c["stop"])] = c["stop"]
    new = loop.NewRows(
        seed=np.uint32(0), prompt_ids=jnp.asarray(order, jnp.int32),
        sample_ids=jnp.asarray(sample_ids, jnp.int32), alive=jnp.asarray(c["alive"](sample_ids)),
        max_new_tokens=jnp.asarray(budget, jnp.int32), stop_ids=jnp.asarray(stop),
    )  # fmt: skip
    state = d.init_state(prefilled, new, capacity=L, cache_capacity=L + d.headroom)
    state = d.decode_loop(state, prefilled[1], None)
    tokens, lengths, accepted = jax.device_get((state.tokens, state.num_generated, state.accepted))
    return np.repeat(order, G), sample_ids, tokens, lengths, accepted


def distributions(kind: str, prompt: list[int], prefixes: list[tuple[int, ...]], sampling: SamplingConfig):
    """(target p, draft q) [len(prefixes), V] after each prefix, from full forward passes: the
    processed expert (SD) or processed contrastive scores (CD, SCD), and the processed amateur."""
    target, draft = models()
    rows, width = V**3, 8  # one padded shape for every call: compiled once
    seqs = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), np.int32)
    mask[len(prefixes) :, -1] = 1
    for i, prefix in enumerate(prefixes):
        ids = prompt + list(prefix)
        seqs[i, width - len(ids) :], mask[i, width - len(ids) :] = ids, 1
    z_e = np.asarray(target.logits(seqs, mask))[: len(prefixes), -1]
    z_a = np.asarray(draft.logits(seqs, mask))[: len(prefixes), -1]
    scores = z_e if kind == "SD" else contrastive_scores(jnp.asarray(z_e), jnp.asarray(z_a), CONTRAST)
    compiled = sampling.compiled()
    past = None
    if compiled.form.penalties:  # each prefix's counts, and the prompt's tokens (NumPy, not the library's)
        counts = np.zeros((len(prefixes), V), np.int32)
        for i, prefix in enumerate(prefixes):
            np.add.at(counts[i], list(prefix), 1)
        seen = np.zeros((len(prefixes), V), bool)
        seen[:, prompt] = True
        form = compiled.form
        past = History(
            jnp.asarray(counts), jnp.asarray(seen) if form.repetition and form.penalize_prompt else None
        )
    p = probabilities(jnp.asarray(scores), compiled, past)
    q = probabilities(jnp.asarray(z_a), compiled, past)
    return np.asarray(p, np.float64), np.asarray(q, np.float64)


@functools.cache
def exact_joint(
    kind: str, prompt: tuple[int, ...], length: int, stop: tuple[int, ...], sampling: SamplingConfig
):
    """{token sequence (stop token included): probability}, and (p, q) after every open prefix."""
    open_ = {(): 1.0}
    joint, dists = {}, {}
    for n in range(length):
        prefixes = list(open_)
        p, q = distributions(kind, list(prompt), prefixes, sampling)
        nxt = {}
        for prefix, pp, qq in zip(prefixes, p, q, strict=True):
            dists[prefix] = (pp, qq)
            for x in np.flatnonzero(pp):
                seq, mass = (*prefix, int(x)), open_[prefix] * pp[x]
                (joint if x in stop or n + 1 == length else nxt)[seq] = mass
        open_ = nxt
    return joint, dists


def encode(seqs: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """Each sequence as one integer (positions past its length hold the pad symbol V)."""
    padded = np.where(np.arange(width)[None, :] < lengths[:, None], seqs[:, :width], V)
    return padded @ ((V + 1) ** np.arange(width))


def check_joint(codes: np.ndarray, joint: dict, width: int, seed: int = 0) -> tuple[float, float, float]:
    """(chi-square p-value, TV, TV bound = mean + 4 sd of the TV of N exact draws, over 200 sets).
    Sequences the target cannot produce must never appear."""
    seqs = list(joint)
    padded = np.array([s + (0,) * (width - len(s)) for s in seqs])
    keys = encode(padded, np.array([len(s) for s in seqs]), width)
    probs = np.array([joint[s] for s in seqs])
    probs = probs / probs.sum()
    order = np.argsort(keys)
    found = np.searchsorted(keys[order], codes)
    found = np.minimum(found, len(keys) - 1)
    assert (keys[order][found] == codes).all(), "sampled a sequence the target cannot produce"
    counts = np.bincount(order[found], minlength=len(keys))
    n = len(codes)
    expected = probs * n
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    predicted = np.append(expected[big], expected[~big].sum())
    keep = predicted > 0
    predicted = predicted[keep] * observed.sum() / predicted[keep].sum()
    p_value = scipy.stats.chisquare(observed[keep], predicted).pvalue
    tv = 0.5 * np.abs(counts / n - probs).sum()
    rng = np.random.default_rng(seed)
    noise = 0.5 * np.abs(rng.multinomial(n, probs, size=200) / n - probs).sum(axis=1)
    return p_value, tv, noise.mean() + 4 * noise.std()


def groups(comp: str, prompt_index: np.ndarray, sample_ids: np.ndarray, lengths: np.ndarray):
    """(prompt, budget, rows) of each homogeneous group of a composition's rows."""
    c = COMPOSITIONS[comp]
    budget, alive = c["budget"](sample_ids), c["alive"](sample_ids)
    assert (lengths[~alive] == 0).all(), "padding rows generated tokens"
    for p, prompt in enumerate(c["prompts"]):
        for b in sorted(set(budget.tolist())):
            yield tuple(prompt), b, np.flatnonzero((prompt_index == p) & alive & (budget == b))


CASES = [
    ("SD", 1, "one prompt"),
    ("SD", 3, "two prompts, mixed budgets, padding rows"),
    ("SD", 5, "eos, processed sampling"),
    ("SCD", 1, "one prompt"),
    ("SCD", 3, "two prompts, mixed budgets, padding rows"),
    ("SCD", 5, "eos, processed sampling"),
    ("CD", 0, "eos, processed sampling"),
    ("SD", 2, "penalties"),
    ("SCD", 2, "penalties"),
    ("CD", 0, "penalties"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "gamma", "comp"), CASES, ids=[f"{k}-g{g}-{c.split(',')[0]}" for k, g, c in CASES]
)
def test_empirical_joint_matches_the_exact_target_joint(kind, gamma, comp):
    prompt_index, sample_ids, tokens, lengths, _ = decode(kind, gamma, comp)
    c = COMPOSITIONS[comp]
    for prompt, budget, rows in groups(comp, prompt_index, sample_ids, lengths):
        joint, _ = exact_joint(kind, prompt, budget, c["stop"], c["sampling"])
        last = tokens[rows, np.maximum(lengths[rows] - 1, 0)]
        assert ((lengths[rows] == budget) | np.isin(last, c["stop"])).all()
        p_value, tv, bound = check_joint(encode(tokens[rows], lengths[rows], budget), joint, budget)
        assert p_value > 1e-3, (prompt, budget, p_value)
        assert tv <= bound, (prompt, budget, tv, bound)


def acceptance_distribution(dists: dict, length: int) -> np.ndarray:
    """Exact distribution of a row's accepted-draft count for γ = 1 and a `length`-token budget.

    From a prefix s (|s| < length) a draft d ~ q is tested: accepted with probability β = Σ min(p, q),
    d then distributed as min(p, q)/β, and the bonus b ~ p(·|s d) follows; rejected, the next token
    is drawn from the residual. The first token comes from the prefill, ~ p(·|prompt)."""

    @functools.cache
    def from_prefix(s: tuple[int, ...]) -> np.ndarray:
        out = np.zeros(length + 1)
        if len(s) >= length:
            out[0] = 1.0
            return out
        p, q = dists[s]
        overlap = np.minimum(p, q)
        for d in np.flatnonzero(overlap):  # accepted: one more accepted token, then d and the bonus
            sd = (*s, int(d))
            if len(sd) >= length:
                out[1:] += overlap[d] * from_prefix(sd)[:-1]
                continue
            bonus = dists[sd][0]
            for b in np.flatnonzero(bonus):
                out[1:] += overlap[d] * bonus[b] * from_prefix((*sd, int(b)))[:-1]
        r = np.asarray(residual(jnp.asarray(p), jnp.asarray(q)), np.float64)
        for t in np.flatnonzero(r):  # rejected
            out += (1 - overlap.sum()) * r[t] * from_prefix((*s, int(t)))
        return out

    p0 = dists[()][0]
    return sum(p0[x] * from_prefix((int(x),)) for x in np.flatnonzero(p0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["SD", "SCD"])
def test_measured_acceptance_matches_the_sum_of_min_p_q(kind):
    """The number of accepted draft tokens over 10^5 rows (γ = 1, 4 tokens) is within 4σ of its exact
    expectation, built from β = Σ_x min(p(x), q(x)) at every prefix."""
    *_, accepted = decode(kind, 1, "one prompt")
    c = COMPOSITIONS["one prompt"]
    _, dists = exact_joint(kind, tuple(c["prompts"][0]), 4, (), PLAIN)
    dist = acceptance_distribution(dists, 4)
    # a tree of float32 distributions, each summing to 1 only to ~1e-7: measured within 8e-8 of 1
    assert dist.sum() == pytest.approx(1.0, abs=1e-6)
    counts = np.arange(len(dist))
    mean, var = (dist * counts).sum(), (dist * counts**2).sum() - (dist * counts).sum() ** 2
    assert 0.3 < mean < 1.7, "the models must disagree for this test to mean anything"
    assert abs(accepted.sum() - N * mean) < 4 * np.sqrt(N * var), (accepted.sum(), N * mean, np.sqrt(N * var))
    empirical = np.bincount(accepted, minlength=len(dist))
    support = dist > 1e-12
    assert empirical[~support].sum() == 0
    expected = dist[support] / dist[support].sum() * empirical.sum()
    assert scipy.stats.chisquare(empirical[support], expected).pvalue > 1e-3


@pytest.mark.slow
def test_the_checker_rejects_nearly_right_distributions():
    """Power of `check_joint`: samples from a 5% mixture with the draft's joint, or from the draft
    alone (what accepting every draft token would give), fail it; exact draws pass."""
    prompt = tuple(COMPOSITIONS["one prompt"]["prompts"][0])
    target, dists = exact_joint("SD", prompt, 4, (), PLAIN)
    seqs = list(target)
    p = np.array([target[s] for s in seqs])
    q = np.array([np.prod([dists[s[:i]][1][s[i]] for i in range(4)]) for s in seqs])
    rng = np.random.default_rng(1)
    for probs, ok in ((0.95 * p + 0.05 * q, False), (q, False), (p, True)):
        draws = np.array(seqs)[rng.choice(len(seqs), size=N, p=probs / probs.sum())]
        p_value, tv, bound = check_joint(encode(draws, np.full(N, 4), 4), target, 4)
        assert (p_value > 1e-3 and tv <= bound) == ok, (p_value, tv, bound)


@pytest.mark.slow
def test_batch_composition_does_not_change_a_rows_tokens():
    """A row's tokens depend only on (seed, prompt, sample): the same rows in another order (other
    neighbours, the other prompt first) get the same tokens."""
    comp = "two prompts, mixed budgets, padding rows"
    a_prompt, a_sample, a_tokens, a_lengths, _ = decode("SCD", 3, comp)
    b_prompt, b_sample, b_tokens, b_lengths, _ = decode("SCD", 3, comp, permuted=True)
    a, b = np.lexsort((a_sample, a_prompt)), np.lexsort((b_sample, b_prompt))
    assert (a_sample[a] == b_sample[b]).all() and not (a_sample == b_sample).all()
    np.testing.assert_array_equal(a_lengths[a], b_lengths[b])
    filled = np.arange(a_tokens.shape[1])[None, :] < a_lengths[a][:, None]
    np.testing.assert_array_equal(np.where(filled, a_tokens[a], -1), np.where(filled, b_tokens[b], -1))
