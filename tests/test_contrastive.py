"""Contrastive decoding: the two score forms and the plausibility cutoff against float64 references,
greedy CD against the full forward passes, the β = 0 special case against plain sampling, statistics
and bad input. Distributional exactness of sampled CD is in test_exactness.py."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from tiny import tiny_config, tiny_model

import jaxsr
from jaxsr.decoding.api import contrastive_decode
from jaxsr.decoding.contrast import contrastive_scores, make_contrast
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.models.decoder import Decoder
from jaxsr.models.layers import MASKED

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def expert():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def amateur():
    return tiny_model(seed=1)


def log_softmax64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 1.0])
def test_obrien_lewis_scores_and_plausibility_cutoff(alpha):
    rng = np.random.default_rng(0)
    z_e, z_a = rng.normal(size=(2, 5, 40)).astype(np.float32) * 3
    beta = 0.7
    scores = np.asarray(contrastive_scores(z_e, z_a, make_contrast(alpha, beta)))
    p_e = np.exp(log_softmax64(z_e))
    plausible = p_e >= alpha * p_e.max(-1, keepdims=True)
    # the cutoff is a choice, compared exactly: on these logits no log-probability lies within 4e-4 of
    # log α + max (float32 rounding is ~1e-6), so f32 and float64 agree on every token
    np.testing.assert_array_equal(scores > MASKED / 2, plausible)
    if alpha == 0.0:
        assert plausible.all()
    if alpha == 1.0:
        assert (plausible.sum(-1) == 1).all() and (plausible.argmax(-1) == z_e.argmax(-1)).all()
    # on the plausible set the score is (1+β)·z_e − β·z_a up to one constant per row
    raw = (1 + beta) * z_e.astype(np.float64) - beta * z_a
    shift = np.where(plausible, scores - raw, np.nan)
    spread = np.nanmax(shift, -1) - np.nanmin(shift, -1)
    assert (spread < 1e-4).all()


def test_li_scores_use_the_amateur_temperature():
    rng = np.random.default_rng(1)
    z_e, z_a = rng.normal(size=(2, 3, 30)).astype(np.float32) * 2
    tau = 0.5
    scores = np.asarray(contrastive_scores(z_e, z_a, make_contrast(0.1, contrast="li", tau=tau)))
    lp_e, lp_a = log_softmax64(z_e), log_softmax64(z_a)
    plausible = lp_e >= np.log(0.1) + lp_e.max(-1, keepdims=True)
    # f32 log-softmax against float64: rounding only (measured 1.8e-6)
    np.testing.assert_allclose(scores[plausible], (lp_e - lp_a / tau)[plausible], rtol=1e-5, atol=1e-4)
    assert (scores[~plausible] == MASKED).all()
    # β is the O'Brien & Lewis weight: it does not enter Li et al.'s form (the same weights, the same
    # computation: bitwise equal)
    other = np.asarray(contrastive_scores(z_e, z_a, make_contrast(0.1, beta=3.0, contrast="li", tau=tau)))
    np.testing.assert_array_equal(scores, other)


@pytest.mark.parametrize("contrast", ["obrien", "li"])
def test_greedy_contrastive_decoding_is_the_argmax_of_the_full_forward_scores(expert, amateur, contrast):
    kwargs = dict(alpha=0.2, beta=0.8, tau=0.7, contrast=contrast)
    out = contrastive_decode(expert, amateur, PROMPTS, max_new_tokens=12, sampling=GREEDY, **kwargs)
    weights = make_contrast(kwargs["alpha"], kwargs["beta"], contrast=contrast, tau=kwargs["tau"])
    for prompt, result in zip(PROMPTS, out, strict=True):
        generated = result.samples[0].token_ids
        assert len(generated) == 12
        seq = [prompt + generated]
        scores = np.asarray(contrastive_scores(expert.logits(seq)[0], amateur.logits(seq)[0], weights))
        # tokens exactly (cached decode vs full forward could only differ at a float32 near-tie)
        assert scores[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
        # the expert's own log-likelihood of the tokens is recorded: f32 sum against float64
        lp = log_softmax64(expert.logits(seq)[0])
        expected = sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(generated))
        assert result.samples[0].logprob == pytest.approx(expected, rel=1e-4, abs=1e-3)
        # both models prefill their 16-token prompt bucket once, then take one token per step
        assert result.stats["token_forwards"] == {"expert": 16 + 11, "amateur": 16 + 11}


@pytest.mark.slow  # compiles plain sampling and contrastive decoding, CD run twice
def test_without_contrast_it_is_plain_sampling_with_the_same_random_streams(expert, amateur):
    """β = 0 and α = 0: the scores are the expert's log-softmax, so every draw equals `jaxsr.generate`'s."""
    cfg = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)
    kwargs = dict(max_new_tokens=12, num_samples=2, seed=3, sampling=cfg)
    plain = jaxsr.generate(expert, PROMPTS, **kwargs)
    cd = contrastive_decode(expert, amateur, PROMPTS, alpha=0.0, beta=0.0, **kwargs)
    assert [[s.token_ids for s in r.samples] for r in cd] == [[s.token_ids for s in r.samples] for r in plain]
    contrasted = contrastive_decode(expert, amateur, PROMPTS, alpha=0.1, beta=1.0, **kwargs)
    assert [[s.token_ids for s in r.samples] for r in contrasted] != [
        [s.token_ids for s in r.samples] for r in cd
    ]


def test_stop_ids_end_a_row(expert, amateur):
    free = contrastive_decode(expert, amateur, PROMPTS, max_new_tokens=12, sampling=GREEDY)[0].samples[0]
    stop = free.token_ids[4]
    out = contrastive_decode(
        expert, amateur, PROMPTS, max_new_tokens=12, sampling=GREEDY, stop_token_ids=[stop]
    )
    sample = out[0].samples[0]
    assert sample.finished and sample.token_ids == free.token_ids[: free.token_ids.index(stop)]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"alpha": -0.01}, ValueError, "alpha"),
        ({"alpha": 1.01}, ValueError, "alpha"),
        ({"alpha": None}, TypeError, "alpha"),
        ({"beta": -0.5}, ValueError, "beta"),
        ({"beta": float("nan")}, ValueError, "beta"),
        ({"beta": True}, TypeError, "beta"),
        ({"tau": -1.0}, ValueError, "tau"),
        ({"contrast": "dola"}, ValueError, "contrast"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"prompts": []}, ValueError, "prompts"),
        ({"prompts": [[1] * 250]}, ValueError, "context"),
        ({"sampling": None}, TypeError, "sampling"),
    ],
)
def test_bad_input_is_refused(expert, amateur, kwargs, error, name):
    args = {"prompts": [[1, 2]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(error, match=name):
        contrastive_decode(expert, amateur, **args)


def test_models_must_share_a_vocabulary(expert):
    with pytest.raises(ValueError, match="amateur"):
        contrastive_decode(expert, tiny_model(seed=2, vocab_size=32), [[1, 2]], max_new_tokens=4)
    with pytest.raises(TypeError, match="expert"):
        contrastive_decode(object(), expert, [[1, 2]], max_new_tokens=4)
    reward = jaxsr.RewardModel.from_module(Decoder(tiny_config(num_labels=1), rngs=nnx.Rngs(3)))
    with pytest.raises(TypeError, match="amateur"):
        contrastive_decode(expert, reward, [[1, 2]], max_new_tokens=4)
