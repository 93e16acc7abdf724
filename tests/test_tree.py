"""TreeBoN (`jaxsr.tree_best_of_n`): Best-of-N when nothing is pruned, children that grow from their
parents' tokens, one decode program per search, the same result packed or alone, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import build_llama_with_tokenizer, byte_tokenizer
from tiny import tiny_model

import jaxsr
from jaxsr.cli import main
from jaxsr.decoding import loop
from jaxsr.rewards import ImplicitReward, SelfCertainty, SelfLikelihood
from jaxsr.search.tree import Tree, TreeShape

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13], [2, 4, 6]]
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(3,))


def by_index(result: jaxsr.Result) -> dict[int, jaxsr.Sample]:
    return {s.index: s for s in result.samples}


@pytest.mark.slow  # compiles TreeBoN's layers and Best-of-N, 4 prompts × 6 rows
def test_one_child_per_row_is_best_of_n(lm):
    """branch=1 keeps every unfinished row on its own stream: Best-of-N's samples and choice."""
    kwargs = dict(n=6, max_new_tokens=24, sampling=SAMPLING, seed=4)
    tree = jaxsr.tree_best_of_n(lm, SelfLikelihood(), PROMPTS, branch=1, layers=3, **kwargs)
    flat = jaxsr.best_of_n(lm, SelfLikelihood(), PROMPTS, **kwargs)
    for t, f in zip(tree, flat, strict=True):
        assert sorted(by_index(t)) == list(range(6))
        for i, sample in by_index(f).items():
            assert by_index(t)[i].token_ids == sample.token_ids
            assert by_index(t)[i].finished == sample.finished
            # sums of ≤ 24 log-probabilities accumulated in batches of other shapes
            assert by_index(t)[i].score == pytest.approx(sample.score, abs=1e-5)
        assert t.best.index == f.best.index
    assert any(len(t.stats["layers"]) >= 2 for t in tree)  # the tree did pause and go on


def test_survivors_branch_into_children_that_share_their_prefix(lm):
    n, branch, layer = 8, 4, 6
    result = jaxsr.tree_best_of_n(
        lm, SelfLikelihood(), PROMPTS[:1], n=n, branch=branch, layers=3, max_new_tokens=3 * layer,
        sampling=SAMPLING, seed=1,
    )[0]  # fmt: skip
    first = result.stats["layers"][0]
    assert first["token"] == layer and first["kept"] == min(first["growing"], n // branch)
    grown = [s for s in result.samples if len(s.token_ids) > layer]
    assert grown, "some rows went past the first layer"
    # every row past the first layer descends from one of its n // branch survivors
    assert len({tuple(s.token_ids[:layer]) for s in grown}) <= n // branch
    new_streams = [s for s in result.samples if s.index >= n]
    assert new_streams, "children other than the first take new sample indices"
    assert len({s.index for s in result.samples}) == len(result.samples)
    assert result.best.score == max(s.score for s in result.samples)


def test_a_tree_is_the_same_packed_with_other_prompts_or_alone(lm):
    kwargs = dict(n=4, branch=2, layers=4, max_new_tokens=16, sampling=SAMPLING, seed=2)
    alone = [
        jaxsr.tree_best_of_n(lm, SelfLikelihood(), [p], prompt_offset=i, **kwargs)[0]
        for i, p in enumerate(PROMPTS)
    ]
    packed = jaxsr.tree_best_of_n(lm, SelfLikelihood(), PROMPTS, concurrent_prompts=3, **kwargs)
    for a, p in zip(alone, packed, strict=True):
        assert [(s.index, s.token_ids) for s in a.samples] == [(s.index, s.token_ids) for s in p.samples]
        assert a.best.index == p.best.index
        np.testing.assert_allclose([s.score for s in p.samples], [s.score for s in a.samples], atol=1e-5)


def test_every_layer_decodes_in_one_compiled_program():
    lm = tiny_model(seed=0, eos_token_ids=(3,), num_layers=3)  # cache shapes no other test compiles
    before = loop.decode_loop._cache_size()
    result = jaxsr.tree_best_of_n(
        lm, SelfLikelihood(), PROMPTS[:1], n=8, branch=2, layers=4, max_new_tokens=32, sampling=SAMPLING
    )[0]
    assert len(result.stats["layers"]) >= 2
    assert loop.decode_loop._cache_size() - before == 1


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(branch=5), "branch: expected a divisor of n=4"),
        (dict(branch=3), "branch: expected a divisor of n=4"),
        (dict(branch=0), "branch"),
        (dict(layers=0), "layers"),
        (dict(n=0), "n"),
    ],
)
def test_bad_tree_settings_are_refused_naming_them(lm, keys, message):
    with pytest.raises(ValueError, match=message):
        jaxsr.tree_best_of_n(lm, SelfLikelihood(), PROMPTS[:1], **{"n": 4, "max_new_tokens": 8, **keys})


def reference_logprob(model: jaxsr.Model, prompt: list[int], response: list[int]) -> float:
    """log p(response | prompt) from the model's full logits, one sequence at a time."""
    logits = np.asarray(model.logits([prompt + response]))[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return sum(logp[len(prompt) - 1 + t, token] for t, token in enumerate(response))


@pytest.mark.slow  # compiles Best-of-N with an implicit reward (a reference model), 3 runs
def test_the_implicit_reward_is_the_policy_against_its_reference(lm):
    reference = tiny_model(seed=7, eos_token_ids=(3,))
    implicit = ImplicitReward(lm, reference, kind="sum")
    results = jaxsr.best_of_n(lm, implicit, PROMPTS[:2], n=4, max_new_tokens=10, sampling=SAMPLING, seed=3)
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        for s in result.samples:
            response = s.token_ids + [s.stop_token] * s.finished  # a stopped response ends with its EOS
            expected = s.logprob - reference_logprob(reference, prompt, response)
            assert s.score == pytest.approx(expected, abs=1e-4)
    assert implicit.token_forwards > 0
    mean = jaxsr.best_of_n(
        lm, ImplicitReward(lm, reference), PROMPTS[:1], n=4, max_new_tokens=10, sampling=SAMPLING, seed=3
    )
    for s, t in zip(mean[0].samples, results[0].samples, strict=True):
        assert s.score == pytest.approx(t.score / (len(t.token_ids) + t.finished), abs=1e-5)
    same = jaxsr.best_of_n(lm, ImplicitReward(lm, lm), PROMPTS[:2], n=4, max_new_tokens=10, sampling=SAMPLING)
    assert max(abs(s.score) for r in same for s in r.samples) < 1e-4  # a policy against itself: 0


def test_tree_search_prunes_by_the_implicit_reward(lm):
    reference = tiny_model(seed=7, eos_token_ids=(3,))
    result = jaxsr.tree_best_of_n(
        lm, ImplicitReward(lm, reference), PROMPTS[:2], n=8, branch=2, layers=4, max_new_tokens=16,
        sampling=SAMPLING, concurrent_prompts=2,
    )  # fmt: skip
    for r in result:
        assert r.best.score == max(s.score for s in r.samples)


def test_an_implicit_reward_needs_two_language_models_of_one_vocabulary(lm):
    with pytest.raises(ValueError, match="reference: its vocabulary"):
        ImplicitReward(lm, tiny_model(seed=1, vocab_size=lm.config.vocab_size + 1))
    with pytest.raises(ValueError, match="kind"):
        ImplicitReward(lm, lm, kind="max")


def certainty_of(lm, prompt: list[int], sample: jaxsr.Sample) -> float:
    """Self-certainty of a sample from one forward pass of `lm` over prompt and response (float64)."""
    response = sample.token_ids + [sample.stop_token] * sample.finished
    logits = np.asarray(lm.logits([prompt + response]))[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    positions = logp[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    return float(np.mean(-np.log(logp.shape[-1]) - positions.mean(-1)))


@pytest.mark.slow  # per sampler: compiles Best-of-N with self-certainty, then TreeBoN
@pytest.mark.parametrize("kind", ["plain", "speculative", "contrastive"])
def test_self_certainty_is_the_mean_kl_from_uniform_of_the_generators_distributions(lm, kind):
    """Summed by the sampler as it samples (a speculative step sums the target's distributions at the
    positions it commits; contrastive decoding the expert's), equal to one forward pass over the
    response; no forward pass of its own."""
    certainty = SelfCertainty()
    second = tiny_model(seed=9, eos_token_ids=(3,))
    sampler = {
        "plain": lm,
        "speculative": jaxsr.speculative_decoder(lm, second, gamma=3),
        "contrastive": jaxsr.contrastive_decoder(lm, second),
    }[kind]
    results = jaxsr.best_of_n(
        sampler, certainty, PROMPTS[:2], n=4, max_new_tokens=10, sampling=SAMPLING, seed=5
    )
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        for s in result.samples:
            assert s.score == pytest.approx(certainty_of(lm, prompt, s), abs=1e-4)
        assert result.best.score == max(s.score for s in result.samples)
    assert certainty.token_forwards == 0
    tree = jaxsr.tree_best_of_n(
        lm, certainty, PROMPTS[:1], n=4, branch=2, max_new_tokens=8, sampling=SAMPLING
    )
    assert tree[0].best.score == max(s.score for s in tree[0].samples)
    for s in tree[0].samples:  # children carry their parent's sum on
        assert s.score == pytest.approx(certainty_of(lm, PROMPTS[0], s), abs=1e-4)


def test_self_certainty_refuses_responses_it_did_not_see_sampled():
    from jaxsr.rewards import Candidates

    candidates = Candidates("hi", [1], [[2, 3]], ["ab"], np.zeros(1), np.array([2]))
    with pytest.raises(ValueError, match="self_certainty: the candidates carry no certainty_sum"):
        SelfCertainty().score(candidates)


@pytest.mark.slow  # compiles Best-of-N of 4 prompts × 8 rows with an implicit reward
def test_the_implicit_reward_reads_the_stop_token_each_response_ended_on():
    """A model with two EOS ids (as Llama-3-Instruct and Gemma 2 have): a response that ends on the
    second is compared with the reference on that token, not on the first EOS id."""
    policy, reference = tiny_model(seed=0, eos_token_ids=(5, 3)), tiny_model(seed=7, eos_token_ids=(5, 3))
    results = jaxsr.best_of_n(
        policy,
        ImplicitReward(policy, reference, kind="sum"),
        PROMPTS,
        n=8,
        max_new_tokens=12,
        sampling=SAMPLING,
    )
    stopped = [(p, s) for p, r in zip(PROMPTS, results, strict=True) for s in r.samples if s.finished]
    assert {s.stop_token for _, s in stopped} == {5, 3}  # both ends occur
    for prompt, s in stopped:
        expected = s.logprob - reference_logprob(reference, prompt, [*s.token_ids, s.stop_token])
        assert s.score == pytest.approx(expected, abs=1e-4)


def test_a_layers_end_keeps_the_best_growing_rows_and_lets_finished_ones_leave():
    tree = Tree(TreeShape(n=6, branch=2, layer_tokens=4, max_new_tokens=16, segment=16), prompt_slots=16)
    scores = [0.1, 0.9, 0.5, 0.7, 0.3, 0.8]
    finished = [False, True, False, False, False, False]
    samples = [
        jaxsr.Sample([1] * 4, "", score, done, -1.0, index)
        for index, (score, done) in enumerate(zip(scores, finished, strict=True))
    ]
    decision = tree.decide(samples, 4)
    # rows 5 (0.8), 3 (0.7), 2 (0.5) are the best growing ones; row 1 (0.9) finished and left
    assert decision.keep == [5, 5, 3, 3, 2, 2]
    assert decision.sample_ids == [5, 6, 3, 7, 2, 8]  # the first child keeps its parent's stream
    assert decision.batch.rows == 6 and [s.index for s in tree.done] == [1]
    assert tree.final(samples[2:3])[0].index == 1  # candidates that left, then the last layer's rows


JOB_PROMPTS = ["Name a color.", "Say hi.", "Count to three."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random Llama (safetensors) with a byte tokenizer and a chat template: a job's `model`."""
    directory = tmp_path_factory.mktemp("tree-llama")
    return str(build_llama_with_tokenizer("LlamaForCausalLM", byte_tokenizer(), directory, 21))


@pytest.mark.slow  # per reward: a TreeBoN job on a byte-level Llama from the CLI, then the API
@pytest.mark.parametrize("reward", ["self_likelihood", "self_certainty"])
def test_a_tree_job_writes_the_searches_the_api_returns(checkpoint, tmp_path, reward):
    data, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in JOB_PROMPTS))
    keys = dict(n=4, branch=2, layers=2, max_new_tokens=8, seed=3, concurrent_prompts=2)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"method: tree_best_of_n\nmodel: {checkpoint}\nreward: {reward}\ndata: {data}\noutput: {output}\n"
        + "".join(f"{k}: {v}\n" for k, v in keys.items())
    )
    assert main(["run", str(config), "--no-progress"]) == 0
    records = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda r: r["index"])
    lm = jaxsr.load_model(checkpoint)
    scorer = SelfCertainty() if reward == "self_certainty" else SelfLikelihood()
    api = jaxsr.tree_best_of_n(lm, scorer, JOB_PROMPTS, sampling=jaxsr.SamplingConfig(), **keys)
    assert [r["index"] for r in records] == [0, 1, 2]  # each written as its search ended
    for record, result in zip(records, api, strict=True):
        assert [s["token_ids"] for s in record["samples"]] == [s.token_ids for s in result.samples]
        assert record["best"]["index"] == result.best.index
        assert record["stats"]["layers"] == result.stats["layers"]


def test_a_tree_job_refuses_the_keys_it_does_not_read(checkpoint, tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(f"method: tree_best_of_n\nmodel: {checkpoint}\nreward: self_likelihood\nn: 4\n")
    assert main(["run", str(config), "memory_budget=4096", "--no-progress"]) == 2
    assert "memory_budget: method=tree_best_of_n does not use it" in capsys.readouterr().err
    assert main(["run", str(config), "n=null", "--no-progress"]) == 2
    assert "n: tree_best_of_n needs n" in capsys.readouterr().err
