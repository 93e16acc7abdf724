"""A classifier reward that reads the generator's token ids scores responses on device, exactly as
its text path does whenever the response ids round-trip through text."""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest
import transformers
from tolerance import assert_same_sample

import jaxsr
from jaxsr.rewards import Candidates, ClassifierReward
from jaxsr.search.candidates import score_ids

TEXTS = [
    "Hi.",
    "Paris is the capital of France.",
    "",
    "Bake at 220 °C for 30 minutes, then let it cool. " * 2,
]
PROMPT = "Tell me something."
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = H.byte_tokenizer()
    lm_dir, rm_dir = tmp_path_factory.mktemp("byte-lm"), tmp_path_factory.mktemp("byte-rm")
    options = dict(max_position_embeddings=256, rms_norm_eps=1e-6)
    H.build_llama_with_tokenizer("LlamaForCausalLM", tokenizer, lm_dir, 3, **options)
    H.build_llama_with_tokenizer(
        "LlamaForSequenceClassification", tokenizer, rm_dir, 4, num_labels=1, **options
    )
    return jaxsr.load_model(lm_dir, cache=False), jaxsr.load_reward_model(rm_dir, cache=False)


def test_on_device_scores_equal_the_text_path(models):
    lm, rm = models
    reward = ClassifierReward(rm)
    ids = [lm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    scorer = reward.token_scorer(lm, MESSAGES, max_new_tokens=128)
    assert scorer is not None
    on_device = score_ids(scorer, ids, max_new_tokens=128)
    candidates = Candidates(PROMPT, [], ids, TEXTS, np.zeros(len(ids)), np.ones(len(ids)))
    through_text = reward.score(candidates)
    assert np.ptp(through_text) > 1e-3  # distinct responses, distinct scores: the check means something
    np.testing.assert_allclose(on_device, through_text, atol=1e-5, rtol=0)


def test_no_device_path_for_another_vocabulary_or_a_too_long_response(models):
    lm, rm = models
    reward = ClassifierReward(rm)
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models

    words = Tokenizer(tokenizer_models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    other = jaxsr.Model.from_module(
        lm.module, tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=words)
    )
    assert reward.token_scorer(other, MESSAGES, max_new_tokens=16) is None
    assert reward.token_scorer(lm, MESSAGES, max_new_tokens=250) is None  # past the 256-token context


@pytest.mark.slow  # compiles SR and Best-of-N with a reward model scoring on device
def test_search_scores_its_decode_buffer_on_device(models, monkeypatch):
    lm, rm = models
    reward = ClassifierReward(rm)

    def text_path(_):
        raise AssertionError("scored through text")

    monkeypatch.setattr(reward, "score", text_path)
    kwargs = dict(max_new_tokens=24, seed=2, chat=True)
    sr = jaxsr.speculative_rejection(lm, reward, [PROMPT], n=8, memory_budget=64 + 8 * 16, **kwargs)[0]
    bon = jaxsr.best_of_n(lm, reward, [PROMPT], n=8, **kwargs)[0]
    for result in (sr, bon):
        assert result.best is max(result.samples, key=lambda s: s.score)
        assert result.stats["token_forwards"]["reward"] > 0
    assert sr.stats["rounds"] >= 2
    # a survivor's final score is the score of its (full) response, as Best-of-N computed it: the
    # same tokens, the score to f32 rounding (SR scores its survivors in a smaller batch)
    for sample in sr.samples:
        assert_same_sample(sample, bon.samples[sample.index])
