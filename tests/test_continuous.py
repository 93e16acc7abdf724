"""Continuous batching at prompt granularity (`jaxsr.decoding.continuous`): prompts stream through a
batch of prompt slots, a prompt whose rows have all ended hands its slot to the next one, each prompt is
handed over as soon as it is done, and every prompt's tokens are those it gets decoded alone, whatever
the schedule (slots, rows, mesh)."""

from __future__ import annotations

import json

import hf_fixtures as H
import jax.numpy as jnp
import numpy as np
import pytest
from test_sharding import _gathered_elements
from tiny import tiny_model

import jaxsr
from jaxsr.decoding import continuous, loop
from jaxsr.decoding.continuous import MIN_SLAB_LENGTH, decode, length_classes
from jaxsr.decoding.driver import Layout, as_sampler
from jaxsr.decoding.inputs import Options, prepare
from jaxsr.jobs.config import load_job_config
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.runner import JsonlOutput, run_job
from jaxsr.sharding import make_mesh, shard_model

EOS = 38
"""An id this tiny model draws often: its rows end after 1 to 32 tokens."""
LENGTHS = [3, 40, 4, 38, 5, 20, 6, 17, 2, 9]
PROMPTS = [[4 + (i * 5 + j) % 60 for j in range(n)] for i, n in enumerate(LENGTHS)]
"""Two length buckets (16 and 64 slots), one slab."""
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(EOS,))


def tokens_of(results) -> list[list[list[int]]]:
    return [[s.token_ids for s in r.samples] for r in results]


@pytest.fixture(scope="module")
def alone(lm):
    """Each prompt decoded alone (3 samples, one slot), with the stream of its index."""
    kwargs = dict(max_new_tokens=24, num_samples=3, sampling=SAMPLING, seed=5, max_rows=3)
    return [jaxsr.generate(lm, [p], prompt_offset=i, **kwargs)[0] for i, p in enumerate(PROMPTS)]


@pytest.mark.slow  # per schedule: continuous batching of 10 prompts; its fixture decodes each alone
@pytest.mark.parametrize("max_rows", [1, 2, 4, 64])
def test_a_prompt_s_tokens_do_not_depend_on_the_schedule(lm, alone, max_rows):
    """1 row a slot (3 turns per prompt), 2 (two turns), 4 slots of 1 row... 64 rows (all at once)."""
    kwargs = dict(max_new_tokens=24, num_samples=3, sampling=SAMPLING, seed=5)
    results = jaxsr.generate(lm, PROMPTS, max_rows=max_rows, **kwargs)
    assert tokens_of(results) == tokens_of(alone)
    for r, a in zip(results, alone, strict=True):
        assert [s.finished for s in r.samples] == [s.finished for s in a.samples]
        # sums of up to 24 float32 log-probabilities from batches of other shapes
        np.testing.assert_allclose([s.logprob for s in r.samples], [s.logprob for s in a.samples], atol=1e-4)


@pytest.mark.slow  # compiles continuous batching of 10 prompts over data=8 fake CPUs
def test_a_prompt_s_tokens_do_not_depend_on_the_mesh(lm, alone):
    sharded = shard_model(lm, make_mesh(data=8))
    kwargs = dict(max_new_tokens=24, num_samples=3, sampling=SAMPLING, seed=5, max_rows=6)
    results = jaxsr.generate(sharded, PROMPTS, **kwargs)
    assert tokens_of(results) == tokens_of(alone)
    assert {r.stats["batch_rows"] for r in results} == {8}  # 2 slots of 3 rows, each padded to 4


def test_a_prompt_whose_rows_end_early_hands_its_slot_on(lm):
    """Two slots of one row: a slot is refilled as soon as its row ends, so the slab runs fewer steps
    than batches of two prompts decoded until their longer row ends."""
    results = jaxsr.generate(lm, PROMPTS, max_new_tokens=32, sampling=SAMPLING, seed=1, max_rows=2)
    committed = [len(r.samples[0].token_ids) + (r.samples[0].stop_token is not None) for r in results]
    assert len(set(committed)) > 3 and min(committed) < 16 and max(committed) == 32  # EOS varies them
    decoded = sum(r.stats["token_forwards"]["generator"] - r.stats["prefill_positions"] for r in results)
    order = sorted(range(len(PROMPTS)), key=lambda i: LENGTHS[i])
    # a row's first token comes from the prefill; each later one is a step of every row of its batch
    batches = sum(2 * (max(committed[i] for i in order[k : k + 2]) - 1) for k in range(0, len(order), 2))
    assert decoded < batches
    assert sum(2 * (n - 1) for n in committed) / 2 <= decoded  # the rows' own steps: a lower bound


def test_prompts_are_handed_over_as_their_rows_end(lm):
    request = prepare((lm,), PROMPTS, Options(max_new_tokens=32, sampling=SAMPLING, seed=1))
    handed: list[list[int]] = []
    sampler = as_sampler(lm, SAMPLING)
    run = decode(
        sampler, request, num_samples=1, max_rows=2, on_done=lambda done: handed.append([i for i, *_ in done])
    )
    assert run.rows == [] and run.stats == []  # handed over, none kept
    assert sorted(i for batch in handed for i in batch) == list(range(len(PROMPTS)))
    assert len(handed) >= len(PROMPTS) // 2  # turn by turn as slots free up, not at the call's end


def test_length_classes_share_a_slab_up_to_its_least_length_and_prefill_by_bucket():
    classes = length_classes([5, 40, 300, 600, 20, 1000], num_samples=4, max_rows=64)
    assert [(shape.length, indices) for shape, indices in classes] == [
        (MIN_SLAB_LENGTH, [0, 4, 1]),
        (512, [2]),
        (1024, [3, 5]),
    ]
    first = classes[0][0]
    assert (first.slots, first.rows, first.live, first.prefill_lengths) == (4, 4, 4, (16, 32, 64))
    # 16 prompts of one sample: 16 slots; a prefill takes a quarter of them, at most 4096 slots
    wide = length_classes([30] * 16 + [900] * 16, num_samples=1, max_rows=64)
    assert [(s.slots, s.prefill) for s, _ in wide] == [(16, 4), (16, 4)]
    # within a memory budget (least=1) no prompt has slots beyond its own bucket
    budgeted = length_classes([5, 40, 300], num_samples=4, max_rows=64, least=1)
    assert [shape.length for shape, _ in budgeted] == [16, 64, 512]


def test_insert_takes_only_the_prefill_s_rows_across_shards(lm):
    """On 8 `data` shards the slab's caches stay where they are: each slot's caches are selected from
    its own or the prefill's, and no collective moves more than the small prefill's caches."""
    sharded = shard_model(lm, make_mesh(data=8))
    sampler = as_sampler(sharded, SAMPLING)
    request = prepare((sharded,), PROMPTS[:2], Options(max_new_tokens=8, sampling=SAMPLING))
    with sampler.on_mesh():
        prefill = sampler.prefill_prompts(request.encoded, 2, slots=MIN_SLAB_LENGTH)
        empty = Layout((), 8, 1, 1).new_rows(sharded, request)
        state, caches = sampler.empty_slab(prefill.caches, empty, request)
        new = Layout((0, 1), 2, 1, 1).new_rows(sharded, request)
        source = np.full(8, -1, np.int32)
        source[[5, 2]] = [0, 1]  # slot 5 takes prompt 0, slot 2 prompt 1
        hlo = (
            loop.insert.lower(
                state, caches, prefill[:2], sampler.controls, new, jnp.asarray(source), method=sampler.method
            )
            .compile()
            .as_text()
        )
        state, caches = sampler.insert(state, caches, prefill, new, source)
    assert max(_gathered_elements(hlo), default=0) <= prefill.caches[0].k[0].size
    assert caches[0].k[0].sharding.spec[0] == "data" and state.tokens.sharding.spec[0] == "data"
    for slot, row in ((5, 0), (2, 1)):
        np.testing.assert_array_equal(caches[0].k[0][slot], prefill.caches[0].k[0][row])
        np.testing.assert_array_equal(caches[0].mask[slot], prefill.caches[0].mask[row])
    alive = np.asarray(state.alive)
    assert alive.tolist() == [s in (2, 5) for s in range(8)]
    assert (np.asarray(state.num_generated) == alive).all()  # a first token in the two new rows only
    assert np.asarray(state.prompt_id)[[5, 2]].tolist() == list(request.prompt_ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte-llama")
    return H.build_llama_with_tokenizer("LlamaForCausalLM", H.byte_tokenizer(), directory, 23)


def test_a_job_writes_each_record_as_its_prompt_ends(model_dir, tmp_path, monkeypatch):
    """The job's one call streams its prompts through two slots: records are written between runs of
    the token loop, not when the call returns, and each prompt's record is the one it gets alone."""
    events: list[str] = []
    decode_step, write = continuous.Slab._decode, JsonlOutput.write

    def decoding(self) -> None:
        events.append("decode")
        decode_step(self)

    def writing(self, index, record) -> None:
        events.append("write")
        write(self, index, record)

    monkeypatch.setattr(continuous.Slab, "_decode", decoding)
    monkeypatch.setattr(JsonlOutput, "write", writing)
    prompts = ["Hi.", "Name a color.", "Yes?", "Count to three.", "Why?", "Say hello twice."]
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": p} for p in prompts]))
    job = tmp_path / "job.yaml"
    job.write_text(
        f"method: generate\nmodel: {model_dir}\ndata: {data}\nmax_new_tokens: 6\nmax_rows: 2\n"
        f"seed: 0\noutput: {tmp_path / 'out.jsonl'}\n"
    )
    config = load_job_config(job)
    output = run_job(config, build_solver, progress=False)
    last_decode = max(k for k, event in enumerate(events) if event == "decode")
    assert events.count("write") == len(prompts) and events.index("write") < last_decode
    records = {r["index"]: r for r in map(json.loads, output.read_text().splitlines())}
    lm = jaxsr.load_model(model_dir)
    for i, prompt in enumerate(prompts):
        alone = jaxsr.generate(lm, [prompt], max_new_tokens=6, seed=0, prompt_offset=i)[0]
        assert records[i]["samples"][0]["token_ids"] == alone.samples[0].token_ids
