"""Speculative and speculative-contrastive decoding through the public API: the acceptance rule as
distributions, greedy equivalences, determinism across batch layouts, stops, statistics, compilation,
the Speculative Rejection hooks (pause and compaction) and bad input. Distributional exactness is in
test_exactness.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import compilations
from tiny import tiny_model

import jaxsr
from jaxsr.decoding import cost, loop
from jaxsr.decoding.api import contrastive_decode, speculative_contrastive_decode, speculative_decode
from jaxsr.decoding.contrast import contrastive_scores, make_contrast
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.speculative import (
    accept,
    accepted_count,
    next_distribution,
    residual,
)
from jaxsr.text import left_pad

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
GREEDY = SamplingConfig(temperature=0)
SAMPLING = SamplingConfig(temperature=1.0, top_k=20)


def perturbed(model: jaxsr.Model, noise: float, seed: int) -> jaxsr.Model:
    """The model with relative Gaussian noise on every weight: a draft that mostly agrees with it."""
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        x + noise * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)
    ]
    return dataclasses.replace(model, params=jax.tree.unflatten(tree, noisy), name=f"{model.name}-noisy")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.3, seed=1)


# -- the acceptance rule -----------------------------------------------------------------------------


def random_pairs():
    rng = np.random.default_rng(0)
    V = 10
    pairs = [
        (rng.dirichlet(np.ones(V) * a), rng.dirichlet(np.ones(V) * b))
        for a, b in [(1, 1), (0.2, 3), (5, 0.3)]
    ]
    disjoint = (np.r_[np.ones(5), np.zeros(5)] / 5, np.r_[np.zeros(5), np.ones(5)] / 5)
    one_hot = (np.eye(V)[3], np.eye(V)[7])
    same = (pairs[0][0], pairs[0][0])
    return [*pairs, disjoint, one_hot, same]


@pytest.mark.parametrize("case", range(6))
def test_accept_then_residual_reproduces_the_target_distribution(case):
    """P(out = x) = q(x)·P(accept | x) + P(reject)·residual(x) must equal p(x), with the implementation's
    own `accept` (integrated over u on a fine grid) and `residual`."""
    p, q = (jnp.asarray(a, jnp.float32) for a in random_pairs()[case])
    u = (jnp.arange(20_000, dtype=jnp.float32) + 0.5) / 20_000
    accept_prob = accept(u[:, None], p[None, :], q[None, :]).mean(0)  # P(u·q(x) < p(x)) per x
    np.testing.assert_allclose(
        accept_prob, np.minimum(1, np.asarray(p) / np.maximum(np.asarray(q), 1e-30)), atol=1e-4
    )
    kept = q * accept_prob
    out = kept + (1 - kept.sum()) * residual(p, q)
    np.testing.assert_allclose(out, p, atol=2e-4)


def test_accepted_count_and_next_distribution_follow_the_first_rejection():
    p = jnp.asarray([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]] * 3)  # [B=3, γ=3, V=3]
    q = jnp.asarray([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]] * 3)
    drafts = jnp.asarray([[0, 1, 2], [0, 0, 2], [2, 1, 2]])
    u = jnp.asarray([[0.4, 0.9, 0.9], [0.6, 0.1, 0.1], [0.0, 0.0, 0.0]])
    # row 0: 0.4·1 < 0.5 ok; 0.9·0.5 < 1 ok; 0.9·1 < 0.5 no → 2. row 1: 0.6 ≥ 0.5 → 0. row 2: p(2)=0 → 0
    a = accepted_count(p, q, drafts, u)
    assert a.tolist() == [2, 0, 0]
    bonus = jnp.asarray([[0.0, 0.0, 1.0]] * 3)
    nxt = next_distribution(p, q, bonus, a)
    np.testing.assert_allclose(nxt[0], [0.4, 0.6, 0.0], atol=1e-6)  # norm(max(0, p_2 − q_2))
    np.testing.assert_allclose(nxt[1], [0.0, 1.0, 0.0], atol=1e-6)
    full = next_distribution(p, q, bonus, jnp.asarray([3, 3, 3]))
    np.testing.assert_allclose(full, bonus)


# -- greedy equivalences -----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculative_decoding_is_greedy_target_decoding(target, draft, gamma):
    out = speculative_decode(target, draft, PROMPTS[:2], gamma=gamma, max_new_tokens=12, sampling=GREEDY)
    for prompt, result in zip(PROMPTS, out, strict=False):
        generated = result.samples[0].token_ids
        assert len(generated) == 12 and not result.samples[0].finished
        logits = np.asarray(target.logits([prompt + generated]))[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
    rate = out[0].stats["acceptance_rate"]
    assert 0 < rate < 1, "the draft must agree only partly for this test to exercise both paths"


@pytest.mark.slow  # compiles greedy CD and SCD, and full forwards of both models
def test_greedy_speculative_contrastive_decoding_is_greedy_contrastive_decoding(target, draft):
    kwargs = dict(max_new_tokens=12, sampling=GREEDY, alpha=0.1, beta=0.5)
    cd = contrastive_decode(target, draft, PROMPTS[:2], **kwargs)
    scd = speculative_contrastive_decode(target, draft, PROMPTS[:2], gamma=3, **kwargs)
    assert [r.samples[0].token_ids for r in scd] == [r.samples[0].token_ids for r in cd]
    # and both are the argmax of the contrastive scores of the full forward passes
    prompt, generated = PROMPTS[0], cd[0].samples[0].token_ids
    seq = [prompt + generated]
    scores = contrastive_scores(target.logits(seq)[0], draft.logits(seq)[0], make_contrast(0.1, 0.5))
    assert np.asarray(scores)[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
    assert scd[0].stats["token_forwards"].keys() == {"expert", "amateur"}


# -- sampling --------------------------------------------------------------------------------------------


def test_a_draft_equal_to_the_target_is_always_accepted(target):
    out = speculative_decode(
        target, target, PROMPTS, gamma=3, max_new_tokens=16, num_samples=2, sampling=SAMPLING
    )
    stats = out[0].stats
    assert stats["acceptance_rate"] > 0.99
    assert stats["tokens_per_target_call"] > 3.5  # γ+1 = 4 per call, less the budget's cut


def test_same_seed_same_tokens_whatever_the_batch_layout(target, draft):
    kwargs = dict(gamma=3, max_new_tokens=16, num_samples=2, sampling=SAMPLING, seed=5)
    whole = speculative_decode(target, draft, PROMPTS, **kwargs)
    tokens = [[s.token_ids for s in r.samples] for r in whole]
    one_row = speculative_decode(target, draft, PROMPTS, max_rows=2, **kwargs)
    assert [[s.token_ids for s in r.samples] for r in one_row] == tokens
    tail = speculative_decode(target, draft, PROMPTS[2:], prompt_offset=2, max_rows=2, **kwargs)
    assert [s.token_ids for s in tail[0].samples] == tokens[2]
    other = speculative_decode(target, draft, PROMPTS[:1], **{**kwargs, "seed": 6}, max_rows=2)
    assert [s.token_ids for s in other[0].samples] != tokens[0]
    assert tokens[0][0] != tokens[0][1]
    assert [s.index for s in whole[0].samples] == [0, 1]


def test_stop_ids_end_a_row_inside_an_accepted_draft(target, draft):
    free = speculative_decode(target, draft, PROMPTS[:2], gamma=3, max_new_tokens=12, sampling=GREEDY)
    tokens = free[0].samples[0].token_ids
    stop = tokens[5]
    stopped = speculative_decode(
        target, draft, PROMPTS[:2], gamma=3, max_new_tokens=12, sampling=GREEDY, stop_token_ids=[stop]
    )
    sample = stopped[0].samples[0]
    assert sample.finished and sample.token_ids == tokens[: tokens.index(stop)]
    other = free[1].samples[0].token_ids
    expected = other[: other.index(stop)] if stop in other else other
    assert stopped[1].samples[0].token_ids == expected


# -- statistics ----------------------------------------------------------------------------------------


def test_statistics_count_the_work_and_predict_the_speedup(target, draft):
    plain = speculative_decode(target, draft, PROMPTS[:2], gamma=3, max_new_tokens=12, sampling=GREEDY)
    for key in ("cost_ratio", "verify_cost_ratio", "expected_speedup", "speedup"):  # probes are opt-in
        assert plain[0].stats.get(key) is None, key
    out = speculative_decode(
        target, draft, PROMPTS[:2], gamma=3, max_new_tokens=12, sampling=GREEDY, baseline=True,
        measure_cost=True,
    )  # fmt: skip
    st = out[0].stats
    for key in ("wall_s", "decode_s", "acceptance_rate", "tokens_per_target_call", "cost_ratio",
                "verify_cost_ratio", "expected_speedup", "speedup", "baseline_decode_s"):  # fmt: skip
        assert st[key] is not None and st[key] >= 0, key
    # each prompt: its row of the 16-token prefill bucket, then its share of the 2-row batch's calls
    # ((γ+1) positions per row per target call); the loop ran as long as the slower row
    steps = max(r.stats["target_calls"] for r in out)
    assert st["token_forwards"]["generator"] == 16 + steps * 4
    assert st["token_forwards"]["draft"] >= 16 + steps * 3
    produced = len(out[0].samples[0].token_ids) - 1
    assert st["tokens_per_target_call"] == pytest.approx(produced / st["target_calls"])
    assert st["accepted_tokens"] + st["target_calls"] >= produced  # budget cuts the last call short
    lam, c, v = st["acceptance_rate"], st["cost_ratio"], st["verify_cost_ratio"]
    assert st["expected_speedup"] == pytest.approx((1 - lam**4) / ((1 - lam) * (v + 3 * c + c * lam**3)))
    assert cost.expected_speedup(1.0, 3, 0.0) == 4.0
    # Leviathan et al.: λ = 0.8, γ = 4, c = 0.1 → (1 − 0.8⁵) / (0.2 · (1 + 0.4 + 0.1·0.8⁴)) ≈ 2.30 (v = 1);
    # against contrastive decoding (1 + c per token) the same step gains 10% more
    assert cost.expected_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * (1.4 + 0.1 * 0.8**4)))
    assert cost.expected_speedup(0.8, 4, 0.1, 1.0, 1.1) == pytest.approx(
        1.1 * cost.expected_speedup(0.8, 4, 0.1)
    )
    assert cost.expected_speedup(0.5, 2, 0.2, 2.0) < cost.expected_speedup(0.5, 2, 0.2)


def simulated_steps(lams: list[float], gamma: int, tokens: int, trials: int, rng) -> np.ndarray:
    """Steps until the slowest of the rows has `tokens` tokens, simulated accept by accept."""
    worst = np.zeros(trials)
    for lam in lams:
        have, steps = np.zeros(trials), np.zeros(trials)
        while (have < tokens).any():
            running = have < tokens
            accepted = np.cumprod(rng.random((trials, gamma)) < lam, axis=1).sum(1)
            have += running * (accepted + 1)
            steps += running
        worst = np.maximum(worst, steps)
    return worst


@pytest.mark.parametrize(
    "lams,gamma,tokens", [([0.5], 4, 40), ([0.3, 0.5, 0.7, 0.5], 3, 30), ([0.8] * 8, 5, 64)]
)
def test_batch_prediction_matches_simulated_steps_of_the_slowest_row(lams, gamma, tokens):
    steps = simulated_steps(lams, gamma, tokens, 20_000, np.random.default_rng(0))
    c, v = 0.1, 1.2
    any_full = 1 - np.prod([1 - lam**gamma for lam in lams])
    predicted_steps = tokens / (
        cost.expected_batch_speedup(lams, gamma, tokens, c, v) * (c * gamma + v + c * any_full)
    )
    assert predicted_steps == pytest.approx(steps.mean(), abs=4 * steps.std() / np.sqrt(steps.size))


def test_batch_prediction_limits():
    # one row, long output: the per-row formula; all accepted: exactly γ+1 tokens per step
    assert cost.expected_batch_speedup([0.6], 4, 5000, 0.1, 1.3) == pytest.approx(
        cost.expected_speedup(0.6, 4, 0.1, 1.3), rel=2e-3
    )
    assert cost.expected_batch_speedup([1.0] * 3, 3, 100, 0.0) == 4.0
    assert cost.expected_batch_speedup([0.0], 3, 100, 0.1, 1.0, 1.1) == pytest.approx(1.1 / 1.3)
    # waiting for the slowest row costs: more rows, lower expected speed-up
    one, eight = (cost.expected_batch_speedup([0.5] * n, 4, 127, 0.1) for n in (1, 8))
    assert eight < 0.95 * one


@pytest.mark.slow  # compiles SD's decode loop at γ = 3 and at γ = 2
def test_a_second_call_in_the_same_buckets_compiles_nothing(target, draft):
    kwargs = dict(gamma=3, sampling=GREEDY)
    ours = {"prefill", "empty_slab", "insert", "decode_loop"}
    speculative_decode(target, draft, PROMPTS[:2], max_new_tokens=12, **kwargs)
    with compilations() as compiled:
        speculative_decode(target, draft, [[7, 7], [3, 1, 4, 1, 5]], max_new_tokens=9, seed=4, **kwargs)
    assert not ours & set(compiled)
    with compilations() as compiled:  # another γ is another program
        speculative_decode(
            target, draft, [[7, 7], [3, 1, 4, 1, 5]], max_new_tokens=9, **{**kwargs, "gamma": 2}
        )
    assert "decode_loop" in compiled


# -- Speculative Rejection hooks ----------------------------------------------------------------------


@pytest.mark.slow  # compiles SCD's decode loop, paused, compacted and resumed
def test_pausing_and_compacting_do_not_change_the_tokens(target, draft):
    """Decode to a pause point, gather rows into another order with one masked, finish: the survivors'
    tokens equal those of an uninterrupted run (what Speculative Rejection over SCD relies on). The
    shapes are those `speculative_decode` uses for 3 prompts × 2 samples, so nothing new compiles."""
    sampler = jaxsr.speculative_contrastive_decoder(target, draft, gamma=3).with_sampling(SAMPLING)
    tokens, mask = map(jnp.asarray, left_pad(PROMPTS, 4, 16))
    prefilled = sampler.prefill(tokens, mask)

    def run(pause_at, state=None):
        if state is None:
            new = loop.NewRows(
                seed=np.uint32(0), prompt_ids=jnp.arange(4, dtype=jnp.int32),
                sample_ids=jnp.tile(jnp.arange(2), 4), alive=jnp.ones(8, bool),
                max_new_tokens=jnp.full(8, 16, jnp.int32), stop_ids=jnp.full((8, 1), -1, jnp.int32),
            )  # fmt: skip
            state = sampler.init_state(prefilled, new, capacity=16, cache_capacity=20)
        return sampler.decode_loop(state, prefilled[1], jnp.int32(pause_at))

    full = jax.device_get(run(loop.NO_PAUSE))
    paused = run(6)
    n = np.asarray(paused.num_generated)
    assert (n >= 6).all() and (n <= 6 + 3).all() and (n < 16).any()
    keep = np.array([1, 0, 3, 2, 5, 4, 7, 6])  # rows stay in their prompt's group of 2
    alive = keep != 0
    small = jax.device_get(run(loop.NO_PAUSE, sampler.compact(paused, keep, jnp.asarray(alive), 20)))
    np.testing.assert_array_equal(small.tokens[alive], full.tokens[keep[alive]])
    assert small.num_generated[~alive] == n[0]  # the masked row froze


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"gamma": 0}, ValueError, "gamma"),
        ({"gamma": 2.5}, TypeError, "gamma"),
        ({"gamma": True}, TypeError, "gamma"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"prompts": []}, ValueError, "prompts"),
        ({"prompts": [[1] * 250]}, ValueError, "context"),
        ({"sampling": {"temperature": 0}}, TypeError, "sampling"),
        ({"seed": -1}, TypeError, "seed"),
    ],
)
def test_bad_input_is_refused(target, draft, kwargs, error, name):
    args = {"prompts": [[1, 2]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(error, match=name):
        speculative_decode(target, draft, **args)
    with pytest.raises(error, match=name):
        speculative_contrastive_decode(target, draft, **args)


def test_models_must_share_a_vocabulary(target):
    other = tiny_model(seed=2, vocab_size=32)
    with pytest.raises(ValueError, match="draft"):
        speculative_decode(target, other, [[1, 2]], max_new_tokens=4)
    with pytest.raises(ValueError, match="amateur"):
        speculative_contrastive_decode(target, other, [[1, 2]], max_new_tokens=4)
    with pytest.raises(TypeError, match="target"):
        speculative_decode("gpt2", target, [[1, 2]], max_new_tokens=4)
    with pytest.raises(TypeError, match="draft"):
        speculative_decode(target, None, [[1, 2]], max_new_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"alpha": -0.1}, ValueError, "alpha"),
        ({"alpha": 1.5}, ValueError, "alpha"),
        ({"alpha": float("nan")}, ValueError, "alpha"),
        ({"alpha": "0.1"}, TypeError, "alpha"),
        ({"beta": -1.0}, ValueError, "beta"),
        ({"beta": float("inf")}, ValueError, "beta"),
        ({"tau": 0.0}, ValueError, "tau"),
        ({"contrast": "dola"}, ValueError, "contrast"),
    ],
)
def test_bad_contrast_settings_are_refused(target, draft, kwargs, error, name):
    with pytest.raises(error, match=name):
        speculative_contrastive_decode(target, draft, [[1, 2]], max_new_tokens=4, **kwargs)
