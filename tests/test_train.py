"""Supervised fine-tuning (`jaxsr.training`, `jaxsr train sft`): data selection and encoding, the
response-only loss, the train step's compilations, resumption after SIGKILL, the exported checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from compiles import compilations
from hf_fixtures import build_llama_with_tokenizer, byte_tokenizer, left_padded_batch, torch_logits
from tiny import tiny_model

import jaxsr
from jaxsr.cli import main
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.jobs.export import export
from jaxsr.loading.safetensors import read_safetensors
from jaxsr.training import SFTConfig, load_sft_config, sft
from jaxsr.training.data import (
    Example,
    make_batch,
    read_results,
    select_responses,
    stream_indices,
    tokenize_examples,
)
from jaxsr.training.loop import make_optimizer, make_train_step
from jaxsr.training.sft import response_nll, sft_loss

ROOT = Path(__file__).resolve().parents[1]


def sample(text: str, score: float | None, finished: bool = True) -> dict:
    return {"token_ids": [], "text": text, "score": score, "finished": finished, "logprob": None, "index": 0}


def records(prompts: int = 6) -> list[dict]:
    """Results records as `jaxsr run` writes them: three scored samples per prompt, `best` the top."""
    out = []
    for i in range(prompts):
        samples = [sample(f"answer {i}: " + "yes " * j, float(j)) for j in range(3)]
        out.append(
            {"index": i, "prompt": f"Question {i}?", "samples": samples, "best": samples[2], "stats": {}}
        )
    return out


def write_results(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_export(directory: Path, rows: list[dict]) -> str:
    """The SFT export (`jaxsr export --sft`) of results records `rows`."""
    export(write_results(directory / "results.jsonl", rows), sft=directory / "sft.jsonl")
    return str(directory / "sft.jsonl")


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Name a color."},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A one-layer random Llama over a byte-level tokenizer with a ChatML template (vocab 259)."""
    directory = tmp_path_factory.mktemp("sft-llama")
    return build_llama_with_tokenizer(
        "LlamaForCausalLM", byte_tokenizer(), directory, seed=5, num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> str:
    return write_results(tmp_path_factory.mktemp("sft-data") / "results.jsonl", records())


def run_config(checkpoint: Path, results: str, output: Path, **keys) -> SFTConfig:
    """A short, fast run: batches of 4, learning rate 3e-3 after a 3-step warm-up."""
    fields = dict(model=str(checkpoint), data=results, output_dir=str(output), batch_size=4, steps=30)
    fields.update(learning_rate=3e-3, warmup_steps=3, save_every=10, max_length=64)
    return SFTConfig(**{**fields, **keys})


def mean_response_loss(model: jaxsr.Model, examples: list[Example]) -> float:
    batch = make_batch(examples, np.arange(len(examples)), 1, 64)
    tokens, mask, targets = (batch[name][0] for name in ("tokens", "mask", "targets"))
    window = targets.shape[-1]  # the last positions, where every response lies
    nll, count = response_nll(model.logits(tokens, mask)[:, -window:], tokens[:, -window:], targets)
    return float(nll / count)


# -- data ------------------------------------------------------------------------------------------
def test_selection_modes():
    rows = records(2)
    rows[1]["best"] = None  # a record without `best` (e.g. `generate` with rewards scored afterwards)
    rows[1]["samples"].append(sample("unscored", None))
    best = select_responses(rows, "best")
    assert [s["score"] for _, s in best] == [2.0, 2.0] and [p for p, _ in best] == [
        "Question 0?",
        "Question 1?",
    ]
    top = select_responses(rows, "top_k", k=2)
    assert [s["score"] for _, s in top] == [2.0, 1.0, 2.0, 1.0]
    assert [s["score"] for _, s in select_responses(rows, "threshold", threshold=1.0)] == [2.0, 1.0, 2.0, 1.0]
    assert select_responses(rows, "threshold", threshold=2.5) == []
    assert all(s["text"] != "unscored" for _, s in select_responses(rows, "top_k", k=10))


def test_sft_never_chooses_a_nan_or_infinite_score():
    samples = [
        {"text": "nan", "score": float("nan")},
        {"text": "inf", "score": float("inf")},
        {"text": "good", "score": 1.0},
        {"text": "worse", "score": 0.5},
    ]
    record = {"prompt": "p", "samples": samples, "best": None}
    assert [s["text"] for _, s in select_responses([record], "best")] == ["good"]
    assert [s["text"] for _, s in select_responses([record], "top_k", k=2)] == ["good", "worse"]
    assert [s["text"] for _, s in select_responses([record], "threshold", threshold=0.0)] == ["good", "worse"]


def test_examples_are_the_prompt_as_inference_encodes_it_then_the_response(checkpoint):
    model = jaxsr.load_model(checkpoint)
    eos = model.eos_token_ids[0]
    pairs = [("Hi?", sample("Hello", 1.0)), ("Hi?", sample("Cut", 1.0, finished=False))]
    finished, cut = tokenize_examples(model, pairs, chat=None, max_length=64)
    prompt = encode_prompts(model, ["Hi?"])[0]
    assert model.tokenizer.decode(prompt).startswith("<|im_start|>user")  # the chat template applied
    assert finished.prompt_length == len(prompt) and finished.tokens[: len(prompt)].tolist() == prompt
    assert finished.tokens[len(prompt) :].tolist() == [*model.tokenizer.encode("Hello"), eos]
    assert cut.tokens[len(prompt) :].tolist() == model.tokenizer.encode("Cut")  # no EOS: it did not end
    plain = tokenize_examples(model, pairs[:1], chat=False, max_length=64)[0]
    assert plain.tokens[: plain.prompt_length].tolist() == model.tokenizer.encode("Hi?")
    short = tokenize_examples(model, pairs, chat=None, max_length=len(prompt) + 2)
    assert [len(e.tokens) for e in short] == [len(prompt) + 2] * 2  # cut at the end
    assert tokenize_examples(model, pairs, chat=None, max_length=len(prompt)) == []  # no response left


def test_batches_are_left_padded_to_a_rung_and_mark_only_response_tokens():
    examples = [Example(np.arange(1, 1 + n, dtype=np.int32), p) for n, p in [(5, 2), (20, 15), (9, 8)]]
    batch = make_batch(examples, np.array([0, 1, 2, 0]), 2, 512)
    assert batch["tokens"].shape == (2, 2, 24)  # 20 tokens: the 24 rung (16, 24, 32, 48, …)
    assert make_batch(examples, np.array([0, 2]), 1, 512)["tokens"].shape == (1, 2, 16)
    # targets cover the last 16 positions: the longest response (5) and the position before it, on the rung
    assert batch["targets"].shape == (2, 2, 16)
    rows = {name: batch[name].reshape(4, -1) for name in batch}
    for r, i in enumerate([0, 1, 2, 0]):
        n, p = len(examples[i].tokens), examples[i].prompt_length
        assert rows["tokens"][r, 24 - n :].tolist() == examples[i].tokens.tolist()
        assert rows["mask"][r].tolist() == [0] * (24 - n) + [1] * n
        assert rows["targets"][r].tolist() == [0] * (16 - n + p) + [1] * (n - p)
    # a response as long as the batch allows: the window is the whole row
    whole = make_batch([Example(np.arange(1, 21, dtype=np.int32), 1)], np.array([0]), 1, 512)
    assert whole["targets"].shape == (1, 1, 24) and whole["targets"][0, 0].tolist() == [0] * 5 + [1] * 19


def test_the_example_stream_is_a_function_of_seed_and_position():
    whole = stream_indices(5, seed=3, start=0, size=12)
    assert np.array_equal(np.concatenate([stream_indices(5, 3, 0, 4), stream_indices(5, 3, 4, 8)]), whole)
    assert sorted(whole[:5]) == sorted(whole[5:10]) == list(range(5))  # each epoch a permutation
    assert not np.array_equal(stream_indices(5, seed=4, start=0, size=12), whole)


def test_unreadable_results_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(records(1)[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"data: line 2 .* not JSON"):
        read_results(path)
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"data: line 1 .* not a results record"):
        read_results(path)


def test_an_sft_export_gives_the_examples_its_results_give(checkpoint, tmp_path):
    """A text prompt comes back from the export's user turn as that text: encoded as the generator
    encoded it, with the chat template or without (chat=False)."""
    model = jaxsr.load_model(checkpoint)
    rows = records(3)
    exported = select_responses(read_results(sft_export(tmp_path, rows)), "best")
    direct = select_responses(rows, "best")
    assert (
        [prompt for prompt, _ in exported] == [prompt for prompt, _ in direct] == [r["prompt"] for r in rows]
    )
    for chat in (None, False):
        from_export = tokenize_examples(model, exported, chat=chat, max_length=64)
        from_results = tokenize_examples(model, direct, chat=chat, max_length=64)
        assert len(from_export) == 3
        for a, b in zip(from_export, from_results, strict=True):
            assert a.prompt_length == b.prompt_length and a.tokens.tolist() == b.tokens.tolist()


def test_a_conversation_of_an_sft_export_is_encoded_as_the_generator_sees_it(checkpoint, tmp_path):
    model = jaxsr.load_model(checkpoint)
    rows = records(1)
    rows[0]["prompt"] = CONVERSATION
    [(prompt, response)] = select_responses(read_results(sft_export(tmp_path, rows)), "best")
    assert prompt == CONVERSATION and response["text"] == rows[0]["best"]["text"]
    [example] = tokenize_examples(model, [(prompt, response)], chat=None, max_length=128)
    expected = encode_prompts(model, [CONVERSATION])[0]
    assert model.tokenizer.decode(expected).startswith("<|im_start|>system\nBe brief.")
    assert example.tokens[: example.prompt_length].tolist() == expected
    eos = model.eos_token_ids[0]
    assert example.tokens[example.prompt_length :].tolist() == [
        *model.tokenizer.encode(response["text"]),
        eos,
    ]


def test_an_sft_export_is_learnt_with_select_best_only(tmp_path):
    data = sft_export(tmp_path, records(2))
    with pytest.raises(
        ValueError, match=r"select: select=top_k chooses among scored samples.* use select=best"
    ):
        select_responses(read_results(data), "top_k", k=2)
    config = SFTConfig(
        model=str(tmp_path / "no-such-model"), data=data, output_dir=str(tmp_path / "o"), select="top_k", k=2
    )
    with pytest.raises(ValueError, match="select: select=top_k"):
        sft(config)  # refused before the model loads
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "messages, message",
    [
        ("Hi", "messages: expected a conversation ending in an assistant turn"),
        ([], "messages: expected a conversation ending in an assistant turn"),
        (CONVERSATION, "messages: expected a conversation ending in an assistant turn"),
        ([{"role": "assistant", "content": "x"}], "messages: expected a list of"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}],
            "messages: expected a conversation ending in an assistant turn",
        ),
        ([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}], r"messages\[0\]: role"),
    ],
)
def test_a_malformed_sft_row_is_refused_naming_the_line(tmp_path, messages, message):
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=f"data: line 2 of .*sft.jsonl: {message}"):
        read_results(path)


# -- loss ------------------------------------------------------------------------------------------
def test_the_loss_counts_response_tokens_only():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 16, (2, 8))
    targets = np.array([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]])  # row 0 ends in padding
    logits = rng.normal(size=(2, 8, 16)).astype(np.float32)
    nll, count = response_nll(logits, tokens, targets)
    assert count == 6
    predicts_response = targets[:, 1:].astype(bool)  # position t predicts token t + 1
    other = logits.copy()
    other[:, :-1][~predicts_response] += rng.normal(size=(int((~predicts_response).sum()), 16))
    other_tokens = np.where(targets, tokens, rng.integers(0, 16, tokens.shape))  # prompt tokens changed
    assert np.isclose(response_nll(other, other_tokens, targets)[0], nll, rtol=1e-6)
    changed = logits.copy()
    changed[0, 3] += 1.0 * (np.arange(16) == tokens[0, 4])  # predicts response token 4 of row 0
    assert response_nll(changed, tokens, targets)[0] < nll
    grad = jax.grad(lambda x: response_nll(x, tokens, targets)[0])(logits)
    assert np.all(np.asarray(grad)[:, :-1][~predicts_response] == 0) and np.all(np.asarray(grad)[:, -1] == 0)
    assert np.all(np.abs(np.asarray(grad)[:, :-1][predicts_response]).sum(-1) > 0)


@pytest.mark.slow  # compiles sft_loss and a full forward of a tiny model
def test_the_loss_on_the_response_window_is_the_loss_over_every_position():
    """sft_loss runs the output layer on the batch's response window only: the same loss as over the
    whole row (responses 5, 9 and 2 tokens: a 16-position window of 32)."""
    model = tiny_model()
    examples = [Example(np.arange(1, 1 + n, dtype=np.int32), p) for n, p in [(30, 25), (12, 3), (20, 18)]]
    micro = {name: x[0] for name, x in make_batch(examples, np.arange(3), 1, 64).items()}
    T, window = micro["tokens"].shape[-1], micro["targets"].shape[-1]
    assert (T, window) == (32, 16)
    every = np.zeros((3, T), np.int32)
    for r, e in enumerate(examples):
        every[r, T - (len(e.tokens) - e.prompt_length) :] = 1
    nll, count = sft_loss(model.module, micro)
    full_nll, full_count = response_nll(model.logits(micro["tokens"], micro["mask"]), micro["tokens"], every)
    assert int(count) == int(full_count) == 5 + 9 + 2
    np.testing.assert_allclose(float(nll), float(full_nll), rtol=1e-5)


@pytest.mark.slow
def test_the_train_step_compiles_once_per_bucket():
    model = tiny_model()
    config = SFTConfig(data="unused.jsonl", steps=10, warmup_steps=1)
    optimizer = make_optimizer(config)
    step = make_train_step(model.graph, optimizer, "float32", sft_loss)
    state = (model.params, jax.jit(optimizer.init)(model.params))
    examples = [Example(np.arange(1, 1 + n, dtype=np.int32), 2) for n in (10, 30, 12, 25)]
    with compilations() as compiled:
        for pair in ([0, 2], [1, 3], [2, 0], [3, 1]):  # (length, response window) (16, 16), (32, 32) twice
            params, opt_state, metrics = step(*state, make_batch(examples, np.array(pair), 1, 64))
            state = (params, opt_state)
    assert compiled.count("train_step") == 2
    assert np.isfinite(float(metrics["loss"])) and int(metrics["tokens"]) == (25 - 2) + (30 - 2)


@pytest.mark.slow
def test_accumulated_micro_batches_make_the_update_of_one_batch():
    """Two micro-batches of 2 examples give the step one batch of 4 gives (the loss is the mean over
    every response token of the step, whatever the split)."""
    model = tiny_model()
    optimizer = make_optimizer(SFTConfig(data="unused.jsonl", steps=10, warmup_steps=0, learning_rate=1e-2))
    lengths = [(10, 3), (14, 9), (6, 2), (12, 4)]
    examples = [Example(np.arange(1, 1 + n, dtype=np.int32), p) for n, p in lengths]
    updated = []
    for micro_batches in (1, 2):
        step = make_train_step(model.graph, optimizer, "float32", sft_loss)
        params = jax.tree.map(jax.numpy.copy, model.params)
        batch = make_batch(examples, np.arange(4), micro_batches, 64)
        params, _, metrics = step(params, optimizer.init(params), batch)
        updated.append((jax.tree.leaves(params), float(metrics["loss"])))
    (whole, whole_loss), (split, split_loss) = updated
    assert np.isclose(whole_loss, split_loss, rtol=1e-6)
    # Adam divides each gradient entry by its own size: entries whose gradient is near Adam's eps turn a
    # summation-order difference into up to ~1e-6 of an update of lr = 1e-2 (measured 2.4e-6 on a Xeon)
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(whole, split, strict=True))


# -- configs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, key",
    [
        ("learning_rat=1e-3", "learning_rate"),  # unknown, with a suggestion
        ("learning_rate=0", "learning_rate"),
        ("learning_rate=-1e-5", "learning_rate"),
        ("learning_rate=fast", "learning_rate"),
        ("steps=0", "steps"),
        ("batch_size=2.5", "batch_size"),
        ("warmup_steps=100", "warmup_steps"),
        ("select=worst", "select"),
        ("k=3", "k"),  # select=best does not use it
        ("select=threshold", "threshold"),  # needs one
        ("threshold=0.5", "threshold"),  # select=best does not use it
        ("param_dtype=float16", "param_dtype"),
        ("max_grad_norm=0", "max_grad_norm"),
        ("mesh_data=0", "mesh_data"),
        ("seed=-1", "seed"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        load_sft_config(None, ["data=results.jsonl", override])


def test_a_config_without_data_is_refused():
    with pytest.raises(ValueError, match="data: expected the path of a results JSONL"):
        load_sft_config(None, [])


@pytest.mark.parametrize(
    "rows, keys, message",
    [
        (None, {}, "data: .* does not exist"),
        ([], {}, "data: .* no response selected"),
        (records(2), {"select": "threshold", "threshold": 9.0}, r"no response selected \(select=threshold"),
    ],
    ids=["missing file", "empty file", "nothing above the threshold"],
)
def test_data_that_gives_no_example_is_refused_before_the_model_loads(tmp_path, rows, keys, message):
    data = tmp_path / "results.jsonl"
    if rows is not None:
        write_results(data, rows)
    config = SFTConfig(
        model=str(tmp_path / "no-such-model"), data=str(data), output_dir=str(tmp_path / "o"), **keys
    )
    with pytest.raises(ValueError, match=message):
        sft(config)
    assert not (tmp_path / "o").exists()


def test_what_the_tokenizer_refuses_is_refused_before_the_weights_load(
    checkpoint, results, tmp_path, monkeypatch
):
    """Checks that need the model's tokenizer or config run on its header (`read_header`): a draft
    with a subset head, and data no response of which fits `max_length`, load no weights."""
    monkeypatch.setattr(
        sys.modules["jaxsr.training.sft"], "resolve_model", lambda *a, **k: pytest.fail("weights loaded")
    )
    short = run_config(checkpoint, results, tmp_path / "short", max_length=4)
    with pytest.raises(ValueError, match="no selected response fits max_length=4"):
        sft(short)
    subset = tmp_path / "subset-head"  # the checkpoint's config names a head of 3 ids (its weights: any)
    shutil.copytree(checkpoint, subset)
    config = json.loads((subset / "config.json").read_text())
    (subset / "config.json").write_text(json.dumps({**config, "jaxsr_head_token_ids": [0, 1, 2]}))
    with pytest.raises(
        ValueError, match=r"model: .*subset-head scores only 3 of its 259 ids \(a distilled draft\)"
    ):
        sft(run_config(subset, results, tmp_path / "draft"))
    assert not (tmp_path / "short").exists() and not (tmp_path / "draft").exists()


def test_the_cli_refuses_a_bad_config_in_one_line(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("data: results.jsonl\nlearning_rate: 0.0\n")
    assert main(["train", "sft", str(config)]) == 2
    assert main(["train", "sft", str(config), "learning_rate=1e-4", "batch_sise=2"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith("jaxsr: error: learning_rate:")
    assert errors[1].startswith(
        "jaxsr: error: config key 'batch_sise' does not exist; did you mean 'batch_size'?"
    )
    assert len(errors) == 2


# -- runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(checkpoint, results, tmp_path_factory) -> tuple[SFTConfig, Path]:
    config = run_config(checkpoint, results, tmp_path_factory.mktemp("sft-run"))
    return config, sft(config, progress=False)


@pytest.mark.slow
def test_the_loss_falls(checkpoint, trained):
    config, final = trained
    before = jaxsr.load_model(checkpoint)
    pairs = select_responses(read_results(config.data), "best")
    examples = tokenize_examples(before, pairs, chat=None, max_length=64)
    initial, tuned = (
        mean_response_loss(before, examples),
        mean_response_loss(jaxsr.load_model(final), examples),
    )
    print(f"mean response-token loss {initial:.3f} -> {tuned:.3f} after {config.steps} steps")
    assert tuned < 0.4 * initial
    # the run's report: the training loss at every checkpoint, falling, and the data it was taken on
    report = json.loads((final.parent / "sft.json").read_text())
    steps = [entry["step"] for entry in report["history"]]
    assert steps == list(range(config.save_every, config.steps + 1, config.save_every))
    assert report["history"][-1]["loss"] < report["history"][0]["loss"]
    assert report["data"]["examples"] == len(pairs) and report["data"]["response_tokens"] > 0


@pytest.mark.slow
def test_the_exported_model_matches_in_transformers(checkpoint, trained):
    import transformers

    _, final = trained
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()
    tuned = read_safetensors(final / "model.safetensors")
    original = read_safetensors(checkpoint / "model.safetensors")
    assert set(tuned) == set(original) and any(not np.allclose(tuned[k], original[k]) for k in tuned)
    tokens, mask = left_padded_batch(seed=1, lengths=(12, 7, 3))
    ours = np.asarray(jaxsr.load_model(final).logits(tokens, mask))
    theirs = torch_logits(
        transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32), tokens, mask
    )
    real = mask.astype(bool)
    difference = np.abs(ours[real] - theirs[real]).max()
    print(f"jaxsr vs transformers logits of the fine-tuned model: max |diff| {difference:.2e}")
    assert difference < 1e-4


@pytest.mark.slow
def test_a_run_on_an_sft_export(checkpoint, tmp_path):
    """`jaxsr train sft` with an SFT export as its data: its rows are the examples."""
    rows = records()
    rows[0]["prompt"] = CONVERSATION
    data = sft_export(tmp_path, rows)
    config = run_config(checkpoint, data, tmp_path / "run", steps=4, save_every=4, max_length=128)
    final = sft(config, progress=False)
    report = json.loads((final.parent / "sft.json").read_text())
    assert report["data"]["examples"] == len(rows) and (final / "model.safetensors").exists()
    assert np.isfinite(report["history"][-1]["loss"])


@pytest.mark.slow
def test_a_sharded_run_matches_one_device(checkpoint, results, tmp_path):
    single = sft(run_config(checkpoint, results, tmp_path / "one", steps=4, save_every=4), progress=False)
    mesh = run_config(
        checkpoint, results, tmp_path / "mesh", steps=4, save_every=4, mesh_data=4, mesh_model=2
    )
    sharded = sft(mesh, progress=False)
    a, b = read_safetensors(single / "model.safetensors"), read_safetensors(sharded / "model.safetensors")
    assert all(np.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_bfloat16_parameters_train_on_float32_masters(checkpoint, results, tmp_path):
    final = sft(run_config(checkpoint, results, tmp_path, steps=4, param_dtype="bfloat16"), progress=False)
    tensors = read_safetensors(final / "model.safetensors")
    assert all(t.dtype == jax.numpy.bfloat16 for t in tensors.values())
    assert jaxsr.load_model(final, dtype="bfloat16").logits([[1, 2, 3]]).dtype == np.float32


@pytest.mark.slow
def test_a_run_killed_mid_way_resumes_to_the_same_parameters(checkpoint, results, tmp_path):
    """SIGKILL after the first checkpoint, run the same command again: the final parameters equal
    those of a run that was never interrupted."""
    config = tmp_path / "sft.yaml"
    keys = dict(model=str(checkpoint), data=results, batch_size=4, steps=60, learning_rate=3e-3)
    config.write_text("".join(f"{k}: {v}\n" for k, v in {**keys, "warmup_steps": 3, "save_every": 5}.items()))
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache")}  # compile once

    def command(output: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "jaxsr.cli",
            "train",
            "sft",
            str(config),
            f"output_dir={output}",
            "--no-progress",
        ]

    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True)
    killed = subprocess.Popen(
        command(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoints = tmp_path / "killed" / "checkpoints"
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert killed.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.01)
    assert killed.poll() is None, "the run ended before it could be killed"
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 60 and not (tmp_path / "killed" / "final").exists()
    done = subprocess.run(command(tmp_path / "killed"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    whole = read_safetensors(tmp_path / "whole" / "final" / "model.safetensors")
    resumed = read_safetensors(tmp_path / "killed" / "final" / "model.safetensors")
    print(f"killed after checkpoint {steps[-1]} of 60")
    assert all(np.array_equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("sft*.yaml")), ids=lambda p: p.name)
def test_shipped_sft_configs_are_valid(path):
    config = load_sft_config(path)
    assert config.data.startswith("out/") and config.output_dir.startswith("out/")


@pytest.mark.slow
def test_checkpoints_of_another_run_are_not_resumed(trained):
    config, _ = trained
    with pytest.raises(ValueError, match=r"output_dir: .* holds checkpoints of a different run"):
        sft(dataclasses.replace(config, learning_rate=1e-3), progress=False)
    again = sft(dataclasses.replace(config, save_every=7), progress=False)  # done: exported again
    assert (again / "model.safetensors").exists()
