"""Rewards: a `*ForSequenceClassification` reward model behind the SmolLM2 chat template (parity with
torch), embedding similarity with the real all-MiniLM-L6-v2, self-likelihood formulas, rewards of the
user's own (checked on stand-ins before any decoding, unable to alter the results they score), and
Best-of-N / Speculative Rejection driven by the classifier reward end to end."""

from __future__ import annotations

import dataclasses

import hf_fixtures as H
import numpy as np
import pytest
import refusals
import torch
import transformers
from refusals import Returns
from tiny import tiny_model
from tolerance import assert_same_sample

import jaxsr
from jaxsr.decoding.driver import Sampler
from jaxsr.loading.embedded import smollm2_draft_path
from jaxsr.loading.encoder import load_encoder, minilm_path
from jaxsr.loading.gguf import smollm2_path
from jaxsr.rewards import (
    Candidates,
    ClassifierReward,
    EmbeddingSimilarity,
    FunctionReward,
    SelfLikelihood,
    as_reward,
)

TOL = 1e-4
"""Rewards (O(1–10)) of jaxsr against torch, or of the on-device path against a direct call: two
implementations in float32, measured within 1e-6 of each other on AVX2, AVX and SSE4.2."""
BATCH_TOL = 1e-5
"""The same reward model over another batch (other chunks, row order, padded width): f32 rounding only,
measured within 6e-7 on AVX2, AVX and SSE4.2."""
RM_CONTEXT = 256
PAD_ID = 0
"""`<|endoftext|>` in SmolLM2's vocabulary: never part of a rendered conversation."""

PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Say something.", ""),
    ("Translate 'bonjour' to English.", "Hello — « bonjour » means hello. 🙂"),
]
RESPONSES = [  # rendered lengths cross the 64- and 128-token length buckets
    "Yes.",
    "Bread needs flour, water, salt and yeast. " * 6,
    "",
    "Knead the dough for ten minutes, then let it rise. " * 2,
    "No idea, sorry.",
    "First mix, then knead, then wait, then bake until golden brown. " * 5,
    "Preheat the oven.",
    "It depends on the recipe you follow and on your oven. " * 3,
    "Bake at 220 °C.",
]
PROMPT = "How do I bake bread?"


# -- fixtures --------------------------------------------------------------------------------------

lm, no_decoding = refusals.lm, refusals.no_decoding  # a tiny model, no prefill allowed


@pytest.fixture(scope="module")
def smol_tokenizer():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tiny_llama(cls: str, vocab_size: int, seed: int, **overrides) -> torch.nn.Module:
    """A tiny random transformers Llama (weights re-drawn so that logits and scores are O(1–10))."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=RM_CONTEXT,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(transformers.LlamaConfig(**kwargs))
    H._randomize(model, seed=seed)
    model.config._attn_implementation = "eager"
    return model.float().eval()


@pytest.fixture(scope="module")
def rm_checkpoint(smol_tokenizer, tmp_path_factory):
    """(directory, torch model): a tiny random Llama reward model with SmolLM2's tokenizer and template."""
    model = tiny_llama(
        "LlamaForSequenceClassification", len(smol_tokenizer), 11, num_labels=1, pad_token_id=PAD_ID
    )
    directory = tmp_path_factory.mktemp("smol-rm")
    model.save_pretrained(str(directory))
    smol_tokenizer.save_pretrained(str(directory))
    return directory, model


@pytest.fixture(scope="module")
def rm(rm_checkpoint):
    return jaxsr.load_reward_model(rm_checkpoint[0])


@pytest.fixture(scope="module")
def encoder():
    return load_encoder(minilm_path())


def candidates(prompt: str, texts: list[str]) -> Candidates:
    n = len(texts)
    return Candidates(
        prompt_text=prompt,
        prompt_ids=[],
        token_ids=[[] for _ in texts],
        texts=list(texts),
        logprob_sum=np.zeros(n),
        num_tokens=np.ones(n, np.int64),
    )


def rendered_ids(tokenizer, prompt: str, response: str) -> list[int]:
    """[user: prompt, assistant: response] as a closed assistant turn, tokenized without extra specials."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    tokens = np.full((len(rows), width), PAD_ID, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for r, ids in enumerate(rows):
        tokens[r, width - len(ids) :], mask[r, width - len(ids) :] = ids, 1
    return tokens, mask


def next_pow2(n: int, minimum: int) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


RUNGS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]  # two per octave


def rung(n: int, minimum: int) -> int:
    return next(r for r in RUNGS if r >= max(n, minimum))


# -- ClassifierReward ------------------------------------------------------------------------------


@pytest.mark.slow
def test_rm_loads_with_its_chat_template(rm):
    assert isinstance(rm, jaxsr.RewardModel)
    assert rm.tokenizer is not None and rm.tokenizer.chat_template


@pytest.mark.slow
def test_classifier_scores_the_rendered_conversation(rm, rm_checkpoint, smol_tokenizer):
    _, torch_model = rm_checkpoint
    rendered = [rendered_ids(smol_tokenizer, prompt, response) for prompt, response in PAIRS]
    direct = np.asarray(rm.scores(*left_padded(rendered)))  # one call, width = the longest row
    for (prompt, response), ids, expected in zip(PAIRS, rendered, direct, strict=True):
        assert ids[-2:] == smol_tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
        got = ClassifierReward(rm).score(candidates(prompt, [response]))
        assert got.shape == (1,)
        with torch.no_grad():
            oracle = float(torch_model(input_ids=torch.tensor([ids])).logits[0, 0])
        assert got[0] == pytest.approx(float(expected), abs=TOL)
        assert got[0] == pytest.approx(oracle, abs=TOL)
    # not vacuous: the reward depends on the response and on the prompt
    a, b = ClassifierReward(rm).score(candidates(PROMPT, ["Yes.", "No."]))
    (c,) = ClassifierReward(rm).score(candidates("Something else entirely?", ["Yes."]))
    assert abs(a - b) > 1e-3 and abs(a - c) > 1e-3


@pytest.mark.slow  # scores 9 responses with a SmolLM2-vocabulary reward model, batched and one by one
def test_classifier_batch_equals_one_at_a_time(rm, smol_tokenizer):
    lengths = [len(rendered_ids(smol_tokenizer, PROMPT, r)) for r in RESPONSES]
    assert min(lengths) < 64 < max(lengths) <= 128
    reward = ClassifierReward(rm, batch_size=4)  # 9 responses: three chunks of mixed lengths
    together = reward.score(candidates(PROMPT, RESPONSES))
    alone = np.array([reward.score(candidates(PROMPT, [r]))[0] for r in RESPONSES])
    assert together.shape == (len(RESPONSES),)
    np.testing.assert_allclose(together, alone, atol=BATCH_TOL, rtol=0)
    assert np.ptp(together) > 1e-3
    backwards = reward.score(candidates(PROMPT, RESPONSES[::-1]))
    np.testing.assert_allclose(backwards[::-1], together, atol=BATCH_TOL, rtol=0)


@pytest.mark.slow  # per reward: compiles a SmolLM2-vocabulary reward model or MiniLM at several batches
@pytest.mark.parametrize("kind", ["classifier", "similarity"])
def test_several_prompts_are_scored_in_shared_batches(rm, encoder, kind, monkeypatch):
    """`score_many`: three prompts' responses in one model batch (one call where one a prompt took
    three), each prompt's scores those it gets alone; a reward without it is scored prompt by prompt."""
    from jaxsr.rewards.base import score_each

    reward = ClassifierReward(rm, batch_size=64) if kind == "classifier" else EmbeddingSimilarity(encoder)
    model, method = (rm, "scores") if kind == "classifier" else (encoder, "embed")
    prompts = [PROMPT, "Name a fruit.", "What is the capital of France?"]
    batches = [candidates(p, RESPONSES[i : i + 3]) for i, p in enumerate(prompts)]
    alone = [reward.score(c) for c in batches]
    calls = []
    original = getattr(type(model), method)
    monkeypatch.setattr(
        type(model), method, lambda self, *a, **k: (calls.append(1), original(self, *a, **k))[1]
    )
    together = score_each(reward, batches)
    assert len(calls) == 1  # (the similarity keeps the prompts' embeddings from the calls above)
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_allclose(got, want, atol=BATCH_TOL, rtol=0)
    assert score_each(reward, []) == []
    one_at_a_time = SelfLikelihood()
    assert [len(x) for x in score_each(one_at_a_time, batches)] == [3, 3, 3]


def test_classifier_counts_padded_work(rm, smol_tokenizer):
    reward = ClassifierReward(rm, batch_size=4)
    assert reward.token_forwards == 0
    texts = RESPONSES[:6]
    lengths = [len(rendered_ids(smol_tokenizer, PROMPT, r)) for r in texts]
    expected, by_length = 0, sorted(lengths)  # shortest first, chunks of 4: rows and length on the rungs
    for start in range(0, len(texts), 4):
        chunk = by_length[start : start + 4]
        expected += rung(len(chunk), 1) * rung(max(chunk), 16)
    reward.score(candidates(PROMPT, texts))
    assert reward.token_forwards == expected
    assert expected > sum(lengths)
    reward.score(candidates(PROMPT, texts[:1]))
    assert reward.token_forwards == expected + rung(lengths[0], 16)


def test_classifier_respects_a_context_that_is_not_a_power_of_two(rm, smol_tokenizer):
    short_rm = dataclasses.replace(rm, config=dataclasses.replace(rm.config, max_position_embeddings=48))
    response = "Paris."
    ids = rendered_ids(smol_tokenizer, PROMPT, response)
    assert 32 < len(ids) <= 48  # fits the context, yet its length bucket (64) does not
    long_response = "Paris is the capital of France. " * 10
    reward = ClassifierReward(short_rm)
    scores = reward.score(candidates(PROMPT, [response, long_response]))
    assert scores[0] == pytest.approx(float(np.asarray(rm.scores([ids]))[0]), abs=TOL)
    assert np.isfinite(scores).all()


def test_classifier_refuses_a_template_that_cannot_render(rm, rm_checkpoint):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(rm_checkpoint[0]))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ raise_exception('this template has no assistant turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    reward = ClassifierReward(dataclasses.replace(rm, tokenizer=tokenizer))
    with pytest.raises(ValueError, match="reward") as err:
        reward.score(candidates(PROMPT, ["Yes."]))
    assert "no assistant turns" in str(err.value)


def test_classifier_needs_a_reward_model_with_a_tokenizer(rm, generator):
    with pytest.raises(TypeError, match="reward"):
        ClassifierReward(generator)
    with pytest.raises(ValueError, match="reward"):
        ClassifierReward(dataclasses.replace(rm, tokenizer=None))


def test_as_reward(rm, encoder, generator):
    classifier = as_reward(rm)
    assert isinstance(classifier, ClassifierReward) and classifier.model is rm
    similarity = as_reward(encoder)
    assert isinstance(similarity, EmbeddingSimilarity) and similarity.encoder is encoder
    self_likelihood = SelfLikelihood()
    assert as_reward(self_likelihood) is self_likelihood
    for bad in (object(), "self_likelihood", None, generator, SelfLikelihood):
        with pytest.raises(TypeError, match="reward"):
            as_reward(bad)


@pytest.mark.slow  # compiles Best-of-N of a tiny model over SmolLM2's 49k-token vocabulary
def test_a_plain_function_is_a_reward_and_a_reward_class_missing_an_attribute_is_named(generator):
    """`fn(prompt, response) -> float` scores each response; a class with `score` but without `name`
    or `token_forwards` (or with one of the wrong kind) is refused naming that attribute."""

    def shortest(prompt: str, response: str) -> float:
        return -len(response)

    reward = as_reward(shortest)
    assert isinstance(reward, FunctionReward) and reward.name.endswith("shortest")
    scores = reward.score(candidates("Say hi.", ["hello there", "hi", ""]))
    np.testing.assert_array_equal(scores, [-11.0, -2.0, 0.0])
    result = jaxsr.best_of_n(generator, shortest, [[1, 2, 3]], n=4, max_new_tokens=6, seed=1)[0]
    assert result.best.text == min((s.text for s in result.samples), key=len)

    class Unnamed:
        token_forwards = 0

        def score(self, candidates):
            return np.zeros(len(candidates))

    with pytest.raises(TypeError, match=r"reward: Unnamed has `score` but no `name` \(of type str\)"):
        as_reward(Unnamed())
    counted = Unnamed()
    counted.name, counted.token_forwards = "mine", 0.5
    with pytest.raises(TypeError, match=r"reward: Unnamed's `token_forwards` must be of type int, got 0.5"):
        as_reward(counted)


# -- rewards of the user's own ---------------------------------------------------------------------


RETURNED = {
    "strings": lambda n: ["1.0"] * n,
    "complex": lambda n: [1j] * n,
    "dict": lambda n: {"a": 1},
    "generator": lambda n: (x for x in range(n)),
    "huge-int": lambda n: [10**400] * n,
    "masked": lambda n: np.ma.masked_all(n),
    "nan": lambda n: [float("nan")] * n,
    "inf": lambda n: [float("inf")] * n,
    "bools": lambda n: [True] * n,
    "too-few": lambda n: [1.0] * (n - 1),
    "2-d": lambda n: [[1.0]] * n,
    "scalar": lambda n: 1.0,
    "none": lambda n: None,  # once recursed to RecursionError (None stood for "not scored yet")
}


def _raise_key_error(n):
    raise KeyError("x")


@pytest.mark.parametrize("search", ["best_of_n", "speculative_rejection"])
@pytest.mark.parametrize("value", [*RETURNED.values(), _raise_key_error], ids=[*RETURNED, "raises"])
def test_a_reward_that_returns_no_real_numbers_is_refused_before_decoding(lm, no_decoding, value, search):
    """A reward of the user's own scores two stand-in responses first: one that could not rank the
    searched responses is refused before any decoding, naming it."""
    with pytest.raises(ValueError, match=r"^reward: fixed (returned|raised KeyError).*stand-in"):
        getattr(jaxsr, search)(lm, Returns(value), [[1, 2]], n=2, max_new_tokens=2)


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda prompt: 1.0, "raised TypeError"),  # wrong arity
        (lambda prompt, response: float("nan"), "returned a non-finite score"),
        (lambda prompt, response: "high", "raised ValueError"),
    ],
    ids=["arity", "nan", "string"],
)
def test_a_plain_function_reward_is_checked_before_decoding_too(lm, no_decoding, fn, why):
    """A function jaxsr wraps (`FunctionReward`) is the user's code as much as a class: it scores the
    stand-ins first (it was trusted as one of jaxsr's own, and failed after prefill and decoding)."""
    with pytest.raises(ValueError, match=rf"^reward: function:.*{why}.*stand-in"):
        jaxsr.best_of_n(lm, fn, [[1, 2]], n=2, max_new_tokens=2)


def test_a_reward_without_a_callable_score_is_refused(lm):
    broken = Returns(None)
    broken.score = 5
    with pytest.raises(TypeError, match="reward: Returns's `score` must be a method"):
        jaxsr.best_of_n(lm, broken, [[1, 2]], n=2, max_new_tokens=2)


class Meddling:
    """A reward that edits what it is given: its token-id lists, texts and the prompt's messages."""

    name, token_forwards = "meddling", 0

    def score(self, candidates):
        for ids in candidates.token_ids:
            ids.extend([1, 2, 3])
        candidates.texts[:] = ["changed"] * len(candidates.texts)
        candidates.messages[0]["content"] = "changed"
        return np.arange(len(candidates), dtype=np.float64)


@pytest.mark.parametrize("search", [jaxsr.best_of_n, jaxsr.speculative_rejection])
def test_a_reward_cannot_alter_the_results_it_scores(search):
    lm = tiny_model(seed=2, eos_token_ids=(63,))
    kwargs = dict(n=4, max_new_tokens=8, seed=1)
    if search is jaxsr.speculative_rejection:
        kwargs["memory_budget"] = 256
    meddled = search(lm, Meddling(), [[3, 4, 5]], **kwargs)[0]
    plain = search(lm, SelfLikelihood(), [[3, 4, 5]], **kwargs)[0]
    assert [s.token_ids for s in meddled.samples] == [s.token_ids for s in plain.samples]
    assert all(len(s.token_ids) <= 8 for s in meddled.samples)


# -- EmbeddingSimilarity ---------------------------------------------------------------------------


def test_similarity_prefers_the_relevant_response(encoder):
    reward = EmbeddingSimilarity(encoder)
    relevant = "Mix flour, water, yeast and salt, knead the dough, let it rise, then bake it in a hot oven."
    irrelevant = "The stock market closed higher today after strong quarterly earnings reports."
    scores = reward.score(candidates(PROMPT, [irrelevant, relevant]))
    assert scores[1] > scores[0] + 0.2
    assert reward.token_forwards > 0


def test_similarity_is_the_cosine_of_the_encoder_embeddings(encoder):
    texts = ["Use a hot oven.", "Bread is made from dough.", "Cats sleep a lot."]
    scores = EmbeddingSimilarity(encoder).score(candidates(PROMPT, texts))
    prompt = np.asarray(encoder.embed([PROMPT]))[0].astype(np.float64)
    responses = np.asarray(encoder.embed(texts)).astype(np.float64)
    cosine = responses @ prompt / (np.linalg.norm(responses, axis=1) * np.linalg.norm(prompt))
    np.testing.assert_allclose(scores, cosine, atol=1e-5, rtol=0)  # f32 pipeline against a float64 cosine


def test_similarity_of_empty_partial_responses(encoder):
    reward = EmbeddingSimilarity(encoder)
    scores = reward.score(candidates(PROMPT, ["", "   ", "\n", "Knead the dough."]))
    assert scores.shape == (4,) and np.isfinite(scores).all()
    assert np.all(np.abs(scores) <= 1 + 1e-5)


def test_similarity_refuses_other_models(rm):
    with pytest.raises(TypeError, match="reward"):
        EmbeddingSimilarity(rm)


# -- SelfLikelihood --------------------------------------------------------------------------------


def test_self_likelihood_formulas():
    c = candidates("p", ["a", "b", "c"])
    c.logprob_sum = np.array([-2.0, -6.0, -0.3])
    c.num_tokens = np.array([2, 3, 1])
    mean = np.array([-1.0, -2.0, -0.3])
    reward = SelfLikelihood()
    np.testing.assert_allclose(reward.score(c), mean)
    np.testing.assert_allclose(SelfLikelihood("neg_perplexity").score(c), -np.exp(-mean))
    # both rank responses the same way
    assert list(np.argsort(reward.score(c))) == list(np.argsort(SelfLikelihood("neg_perplexity").score(c)))
    assert reward.token_forwards == 0
    assert reward.name != SelfLikelihood("neg_perplexity").name


@pytest.mark.parametrize("kind", ["perplexity", "", None, "MEAN_LOGPROB"])
def test_self_likelihood_refuses_unknown_kinds(kind):
    with pytest.raises(ValueError, match="kind"):
        SelfLikelihood(kind)


# -- Best-of-N / Speculative Rejection with the classifier reward ----------------------------------

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
N, MAX_NEW = 6, 12


@pytest.fixture(scope="module")
def generator(smol_tokenizer, tmp_path_factory):
    """A tiny random causal Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    model = tiny_llama("LlamaForCausalLM", len(smol_tokenizer), 5)
    directory = tmp_path_factory.mktemp("smol-lm")
    model.save_pretrained(str(directory))
    smol_tokenizer.save_pretrained(str(directory))
    lm = jaxsr.load_model(directory)
    assert type(lm) is jaxsr.Model and smol_tokenizer.eos_token_id in lm.eos_token_ids
    return lm


@pytest.fixture(scope="module")
def bon(generator, rm):
    return jaxsr.best_of_n(generator, rm, PROMPTS, n=N, max_new_tokens=MAX_NEW, seed=7)


def check_best(result: jaxsr.Result) -> None:
    scores = [s.score for s in result.samples]
    assert result.best is not None and result.best.score == max(scores)
    assert result.best is result.samples[int(np.argmax(scores))]


def template_ids(tokenizer, prompt: str) -> tuple[list[int], list[int]]:
    """(the template's ids before the assistant's content, the ids after it)."""
    marker = "\ue000"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": marker}]
    before, _, after = tokenizer.apply_chat_template(messages, tokenize=False).partition(marker)
    return tuple(tokenizer(part, add_special_tokens=False)["input_ids"] for part in (before, after))


@pytest.mark.slow  # its fixture runs Best-of-N (SmolLM2 vocabulary) scored by a reward model
def test_best_of_n_with_classifier_reward(bon, rm, smol_tokenizer):
    # generator and reward model share SmolLM2's vocabulary: a response whose ids are what its text
    # renders to is scored on device (template prefix + its own ids + suffix); one whose sampled ids are
    # not its text's tokenization is scored through its text. Either way each stored score is the
    # reward model's score of [user: prompt, assistant: stored text] in its template.
    round_trips = rerendered = 0
    for prompt, result in zip(PROMPTS, bon, strict=True):
        prefix, suffix = template_ids(smol_tokenizer, prompt)
        for sample in result.samples:
            assert sample.text == smol_tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            rendered = rendered_ids(smol_tokenizer, prompt, sample.text)
            on_device = prefix + sample.token_ids + suffix == rendered
            round_trips, rerendered = round_trips + on_device, rerendered + (not on_device)
        rows = [rendered_ids(smol_tokenizer, prompt, s.text) for s in result.samples]
        expected = np.asarray(rm.scores(*left_padded(rows)))
        assert len(result.samples) == N and [s.index for s in result.samples] == list(range(N))
        check_best(result)
        np.testing.assert_allclose([s.score for s in result.samples], expected, atol=TOL, rtol=0)
        assert len({s.score for s in result.samples}) > 1
        forwards = result.stats["token_forwards"]
        assert forwards["reward"] > 0 and forwards["generator"] > 0
    assert round_trips > 0 and rerendered > 0  # both paths ran


@pytest.mark.slow
def test_zero_rejection_sr_equals_best_of_n(bon, generator, rm):
    sr = jaxsr.speculative_rejection(
        generator, rm, PROMPTS, n=N, rejection_rate=0.0, memory_budget=4096, max_new_tokens=MAX_NEW, seed=7
    )
    for a, b in zip(bon, sr, strict=True):
        # tokens and the choice exactly; rewards and log-probabilities to f32 rounding (SR decodes and
        # scores in its own batch shapes)
        assert [s.token_ids for s in b.samples] == [s.token_ids for s in a.samples]
        for got, expected in zip(b.samples, a.samples, strict=True):
            assert_same_sample(got, expected, atol=BATCH_TOL)
        assert b.best is not None and b.best.index == a.best.index
        assert b.stats["rounds"] == 1 and b.stats["token_forwards"]["reward"] > 0


@pytest.mark.slow
def test_speculative_rejection_keeps_the_best_partial_responses(bon, generator, rm, smol_tokenizer):
    """One decision point after a few tokens: the kept rows are the top half by the reward of their
    partial responses (scored on device from their ids), and they continue exactly as in Best-of-N
    (random streams are keyed by sample)."""
    (result,) = jaxsr.speculative_rejection(
        generator,
        rm,
        PROMPTS[:1],
        n=N,
        rejection_rate=0.5,
        memory_budget=4096,
        max_new_tokens=MAX_NEW,
        seed=7,
        decision_interval=6,
    )
    stats, full = result.stats, bon[0].samples
    assert stats["rounds"] == 2 and stats["batch_sizes"][0] == N and stats["batch_sizes"][1] <= N // 2
    cut = stats["round_log"][0]["end_token"]
    assert 1 < cut < MAX_NEW
    prefix, suffix = template_ids(smol_tokenizer, PROMPTS[0])
    partial = [prefix + s.token_ids[:cut] + suffix for s in full]
    partial_scores = np.asarray(rm.scores(*left_padded(partial)))
    # no near-tie at the cut: SR's on-device rewards differ from these by f32 rounding (< 1e-6), so the
    # kept set is well defined and compared exactly
    ranked = np.sort(partial_scores)[::-1]
    assert ranked[N // 2 - 1] - ranked[N // 2] > 100 * BATCH_TOL
    assert sorted(s.index for s in result.samples) == sorted(np.argsort(-partial_scores)[: N // 2].tolist())
    for sample in result.samples:  # tokens exactly, rewards to f32 rounding (another batch)
        assert_same_sample(sample, full[sample.index], atol=BATCH_TOL)
    assert stats["token_forwards"]["reward"] > bon[0].stats["token_forwards"]["reward"]
    check_best(result)


def test_search_refuses_a_reward_template_that_cannot_render(generator, rm, rm_checkpoint):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(rm_checkpoint[0]))
    tokenizer.chat_template = "{{ raise_exception('no conversations here') }}"
    bad = dataclasses.replace(rm, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="reward"):
        jaxsr.best_of_n(generator, bad, PROMPTS, n=N, max_new_tokens=MAX_NEW, seed=7)


def test_similarity_counts_the_padded_encoder_work(encoder):
    reward = EmbeddingSimilarity(encoder)
    texts = ["Paris is the capital of France.", "A short one.", "Three texts pad to four rows."]
    reward.score(candidates(PROMPT, texts))
    prompt_tokens, _ = encoder.tokenize([PROMPT])
    response_tokens, _ = encoder.tokenize(texts)
    # the prompt alone (one row), then the three responses in one call of three rows
    assert reward.token_forwards == prompt_tokens.size + 3 * response_tokens.shape[1]
    before = reward.token_forwards
    reward.score(candidates(PROMPT, texts[:1]))  # the prompt's embedding is cached
    assert reward.token_forwards - before == encoder.tokenize(texts[:1])[0].size


def test_a_reward_template_that_fails_is_refused_before_decoding(rm_checkpoint, monkeypatch):
    reward_model = jaxsr.load_reward_model(rm_checkpoint[0])
    reward_model.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no assistant turns') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    generator = jaxsr.load_model(smollm2_draft_path())

    def refuse(*args, **kwargs):
        raise AssertionError("decoding started before the reward could render the prompts")

    monkeypatch.setattr(Sampler, "prefill", refuse)
    for search in (jaxsr.best_of_n, jaxsr.speculative_rejection):
        with pytest.raises(ValueError, match=r"no assistant turns.*\(prompts\[0\]\)"):
            search(generator, reward_model, ["hi", "there"], n=2, max_new_tokens=4, memory_budget=4096)


def test_an_encoder_without_a_tokenizer_is_refused_as_a_reward(encoder):
    bare = dataclasses.replace(encoder, tokenizer=None)
    with pytest.raises(ValueError, match=r"reward: the encoder .* has no tokenizer"):
        as_reward(bare)
