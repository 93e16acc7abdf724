"""Best-of-N and Speculative Rejection over two-model decoders (SD, CD, SCD) in place of a model."""

from __future__ import annotations

import itertools

import pytest
from test_speculative import PROMPTS, SAMPLING, perturbed
from tiny import tiny_model
from tolerance import assert_same_sample

import jaxsr
from jaxsr.rewards import SelfLikelihood


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, eos_token_ids=(5,))


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.3, seed=1)


def make(kind: str, target, draft) -> jaxsr.PairDecoder:
    if kind == "speculative":
        return jaxsr.speculative_decoder(target, draft, gamma=3)
    if kind == "contrastive":
        return jaxsr.contrastive_decoder(target, draft, alpha=0.1, beta=0.5)
    return jaxsr.speculative_contrastive_decoder(target, draft, gamma=2, alpha=0.1, beta=0.5)


KINDS = ["speculative", "contrastive", "speculative_contrastive"]


def tokens(result: jaxsr.Result) -> list[list[int]]:
    return [s.token_ids for s in result.samples]


@pytest.mark.slow  # compiles Best-of-N over SD, SD itself and Best-of-N of the target
def test_best_of_n_over_a_decoder_samples_what_the_decoder_samples(target, draft):
    decoder = make("speculative", target, draft)
    kwargs = dict(max_new_tokens=12, sampling=SAMPLING, seed=5)
    bon = jaxsr.best_of_n(decoder, SelfLikelihood(), PROMPTS, n=4, **kwargs)
    sd = jaxsr.speculative_decode(target, draft, PROMPTS, gamma=3, num_samples=4, **kwargs)
    plain = jaxsr.best_of_n(target, SelfLikelihood(), PROMPTS, n=4, **kwargs)
    for b, s in zip(bon, sd, strict=True):
        assert tokens(b) == tokens(s)
        assert b.best is max(b.samples, key=lambda x: x.score)
        assert set(b.stats["token_forwards"]) == {"generator", "draft", "reward"}
        assert b.stats["token_forwards"]["draft"] > 0
    assert any(tokens(b) != tokens(p) for b, p in zip(bon, plain, strict=True))  # the streams differ


@pytest.mark.slow  # per decoder (SD, CD, SCD): compiles Best-of-N and SR over it
@pytest.mark.parametrize("kind", KINDS)
def test_zero_rejection_over_a_decoder_is_best_of_n_over_it(target, draft, kind):
    decoder = make(kind, target, draft)
    kwargs = dict(max_new_tokens=16, sampling=SAMPLING, seed=3)
    bon = jaxsr.best_of_n(decoder, SelfLikelihood(), PROMPTS[:2], n=8, **kwargs)
    sr = jaxsr.speculative_rejection(
        decoder, SelfLikelihood(), PROMPTS[:2], n=8, rejection_rate=0.0, memory_budget=16 + 8 * 32, **kwargs
    )
    for a, b in zip(bon, sr, strict=True):
        assert tokens(a) == tokens(b)
        # same choice; log-probabilities agree to float32 rounding (cache shapes differ)
        assert a.best is not None and b.best is not None
        assert_same_sample(b.best, a.best)
        assert b.stats["rounds"] == 1


@pytest.fixture(scope="module")
def scd_search(target, draft):
    decoder = make("speculative_contrastive", target, draft)
    kwargs = dict(max_new_tokens=40, sampling=SAMPLING, seed=7)
    budget = 16 + 16 * (8 + 3)  # 16 rows of an 8-token first segment + γ+1 look-ahead slots
    sr = jaxsr.speculative_rejection(
        decoder,
        SelfLikelihood(),
        PROMPTS[:2],
        n=16,
        rejection_rate=0.5,
        memory_budget=budget,
        min_first_segment=8,
        **kwargs,
    )
    bon = jaxsr.best_of_n(decoder, SelfLikelihood(), PROMPTS[:2], n=16, **kwargs)
    return decoder, budget, sr, bon


def test_survivors_over_scd_continue_exactly_as_they_would_unrejected(scd_search):
    _, _, results, bon = scd_search
    for sr, full in zip(results, bon, strict=True):
        assert sr.stats["rounds"] >= 2
        for sample in sr.samples:  # tokens exactly; scores to f32 rounding (other batch shapes)
            assert_same_sample(sample, full.samples[sample.index])


def test_memory_over_scd_counts_both_caches_and_stays_within_budget(scd_search):
    decoder, budget, results, _ = scd_search
    both = decoder.target.kv_slot_bytes + decoder.second.kv_slot_bytes
    for r in results:
        sizes = r.stats["batch_sizes"]
        assert sizes[0] == 16 and all(b < a for a, b in itertools.pairwise(sizes))
        assert max(r.stats["kv_bytes"]) <= budget * both
        forwards = r.stats["token_forwards"]
        assert set(forwards) == {"expert", "amateur", "reward"}
        # the prompt is prefilled once per model; each expert call verifies γ+1 positions per row
        expert = sum(x["steps"] * x["batch_size"] for x in r.stats["round_log"]) * 3
        assert forwards["expert"] == 16 + expert and forwards["amateur"] > 16


def test_bad_decoders_are_refused(target, draft):
    with pytest.raises(TypeError, match="model"):
        jaxsr.best_of_n("smollm2", SelfLikelihood(), PROMPTS, n=2, max_new_tokens=4)
    with pytest.raises(TypeError, match="model"):
        jaxsr.speculative_rejection(object(), SelfLikelihood(), PROMPTS, n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="gamma"):
        jaxsr.speculative_decoder(target, draft, gamma=0)
    with pytest.raises(ValueError, match="alpha"):
        jaxsr.contrastive_decoder(target, draft, alpha=1.5)
    with pytest.raises(ValueError, match="beta"):
        jaxsr.speculative_contrastive_decoder(target, draft, beta=-1.0)
    with pytest.raises(ValueError, match="amateur"):
        jaxsr.contrastive_decoder(target, tiny_model(seed=2, vocab_size=32))
    with pytest.raises(ValueError, match="memory_budget"):  # the look-ahead slots count against it
        jaxsr.speculative_rejection(
            make("speculative", target, draft),
            SelfLikelihood(),
            PROMPTS[:1],
            n=4,
            memory_budget=16 + 4 * 8,
            min_first_segment=8,
            max_new_tokens=8,
        )
