"""Draft distillation (`jaxsr.training.distill`, `jaxsr train distill`): the teacher's labels recorded
while it samples, the loss, the subset head, the run (λ rises, resumes, exports), configs and CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiles import compilations
from hf_fixtures import build_llama_with_tokenizer, byte_tokenizer

import jaxsr
from jaxsr.cli import main
from jaxsr.training import DistillConfig, distill, load_distill_config
from jaxsr.training.distill import (
    distill_terms,
    head_index,
    labelled_batch,
    most_probable_ids,
    read_chunks,
    teacher_request,
    write_chunks,
)

TOPICS = ("cats", "dogs", "rain", "the sea", "bread", "music", "maps", "trains")
PROMPTS = [f"Tell me about {w}." for w in TOPICS]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A two-layer random Llama over a byte-level tokenizer with a ChatML template (vocab 259)."""
    directory = tmp_path_factory.mktemp("distill-teacher")
    return build_llama_with_tokenizer(
        "LlamaForCausalLM", byte_tokenizer(), directory, seed=3, num_hidden_layers=2
    )


@pytest.fixture(scope="module")
def prompt_sets(tmp_path_factory) -> tuple[str, str]:
    directory = tmp_path_factory.mktemp("distill-prompts")
    train, held = directory / "train.jsonl", directory / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS, "Held out one?"]))
    held.write_text(
        json.dumps({"prompt": "Held out one?"}) + "\n" + json.dumps({"prompt": "And two?"}) + "\n"
    )
    return str(train), str(held)


def run_config(teacher_dir: Path, prompt_sets: tuple[str, str], output: Path, **keys) -> DistillConfig:
    """A short run: 8 prompts × 4 samples of ≤ 24 tokens, a 1-layer student of width 32."""
    fields = dict(
        teacher=str(teacher_dir), output_dir=str(output), prompts=prompt_sets[0], heldout=prompt_sets[1],
        heldout_prompts=2, samples_per_prompt=4, max_new_tokens=24, rows_per_batch=16, label_top_k=8,
        hidden_size=32, num_layers=1, head_dim=16, num_kv_heads=1, intermediate_size=64,
        batch_size=8, max_length=64, steps=30, warmup_steps=3, learning_rate=1e-2, end_learning_rate=1e-3,
        save_every=10, measure_cost=False,
    )  # fmt: skip
    return DistillConfig(**{**fields, **keys})


# -- labels recorded while sampling ------------------------------------------------------------------
@pytest.mark.slow
def test_labels_are_the_teachers_distribution_and_samples_are_generates(teacher_dir, prompt_sets, tmp_path):
    """Each recorded row is the top-k of log_softmax of the teacher's logits at that position (computed
    again by a full forward pass), and the sampled tokens are the ones `jaxsr.generate` draws with the
    same seed (the same random streams)."""
    teacher = jaxsr.load_model(teacher_dir)
    config = run_config(teacher_dir, prompt_sets, tmp_path)
    prompts = PROMPTS[:4]
    with compilations() as compiled:
        request = teacher_request(teacher, prompts, config, 0)
        paths = write_chunks(
            teacher, request, tmp_path, name="t", samples_per_prompt=4, config=config, progress=False
        )
    assert compiled.count("decode_loop") == 1  # the token loop, observed by the teacher's labels
    examples = read_chunks(paths, 1000)
    assert len(examples) == 16
    generated = jaxsr.generate(
        teacher, prompts, max_new_tokens=24, num_samples=4, seed=0, sampling=config.sampling()
    )
    responses = [
        list(s.token_ids) + ([teacher.eos_token_ids[0]] if s.finished else [])
        for r in generated
        for s in r.samples
    ]
    assert [e.tokens[e.prompt_length :].tolist() for e in examples] == responses
    for e in examples[:6]:
        logits = np.asarray(teacher.logits(e.tokens[None]))[0]
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        predicting = logp[e.prompt_length - 1 : len(e.tokens) - 1]  # position t predicts token t + 1
        top = np.sort(predicting, axis=-1)[:, ::-1][:, :8]
        np.testing.assert_allclose(e.values, top, atol=2e-3)  # float16 storage
        np.testing.assert_allclose(np.take_along_axis(predicting, e.ids, -1), e.values, atol=2e-3)
        drawn = e.tokens[e.prompt_length :]  # each drawn from the teacher's top 50 (the sampling's top_k)
        rank = (predicting > predicting[np.arange(len(drawn)), drawn][:, None]).sum(-1)
        assert (rank < 50).all()


@pytest.mark.slow  # loads a 2-layer HF teacher and compiles its sampling for a chunk
def test_a_chunk_on_disk_is_not_sampled_again(teacher_dir, prompt_sets, tmp_path):
    teacher = jaxsr.load_model(teacher_dir)
    config = run_config(teacher_dir, prompt_sets, tmp_path, max_new_tokens=8)
    request = teacher_request(teacher, PROMPTS[:2], config, 0)
    kwargs = dict(name="t", samples_per_prompt=2, config=config, progress=False)
    (path,) = write_chunks(teacher, request, tmp_path, **kwargs)
    stamp = path.stat().st_mtime_ns
    assert write_chunks(teacher, request, tmp_path, **kwargs) == [path]
    assert path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial file left


# -- loss, batches, head ---------------------------------------------------------------------------
def test_distill_terms_against_numpy():
    rng = np.random.default_rng(0)
    V, k = 12, 4
    p = rng.dirichlet(np.ones(V) * 0.5, size=5)
    logq = np.log(rng.dirichlet(np.ones(V), size=5))
    ids = np.argsort(-p, axis=-1)[:, :k]
    values = np.log(np.take_along_axis(p, ids, -1))
    kl, overlap = map(
        np.asarray, distill_terms(jnp.asarray(logq), jnp.asarray(values), jnp.asarray(ids), None)
    )
    q = np.exp(logq)
    p_top, q_top = np.exp(values), np.take_along_axis(q, ids, -1)
    p_rest, q_rest = 1 - p_top.sum(-1), 1 - q_top.sum(-1)
    expected_kl = (p_top * (values - np.log(q_top))).sum(-1) + p_rest * np.log(p_rest / q_rest)
    np.testing.assert_allclose(kl, expected_kl, rtol=1e-5)
    np.testing.assert_allclose(
        overlap, np.minimum(p_top, q_top).sum(-1) + np.minimum(p_rest, q_rest), rtol=1e-5
    )
    # q = p: no divergence, full overlap
    kl_same, overlap_same = distill_terms(
        jnp.log(jnp.asarray(p)), jnp.asarray(values), jnp.asarray(ids), None
    )
    np.testing.assert_allclose(kl_same, 0, atol=1e-6)
    np.testing.assert_allclose(overlap_same, 1, atol=1e-6)


def test_a_subset_head_drops_the_ids_it_cannot_score():
    """With head ids H, teacher ids outside H add nothing; those inside are read at their head column."""
    cfg = dataclasses.make_dataclass("C", [("head_token_ids", tuple), ("vocab_size", int)])((1, 3, 5, 7), 9)
    index = head_index(cfg)
    assert index.tolist() == [-1, 0, -1, 1, -1, 2, -1, 3, -1]
    logq = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1]]))
    values = jnp.log(jnp.asarray([[0.5, 0.3]]))
    ids = jnp.asarray([[3, 2]])  # 3 is head column 1 (q = 0.3); 2 is not in the head
    kl, overlap = distill_terms(logq, values, ids, index)
    p_rest, q_rest = 1 - 0.8, 1 - 0.3
    assert np.isclose(float(kl[0]), 0.5 * np.log(0.5 / 0.3) + p_rest * np.log(p_rest / q_rest), rtol=1e-5)
    assert np.isclose(float(overlap[0]), 0.3 + p_rest, rtol=1e-5)


def test_most_probable_ids_rank_teacher_mass_and_keep_eos():
    from jaxsr.training.distill import LabelledExample

    e = LabelledExample(
        tokens=np.zeros(3, np.int32), prompt_length=1,
        values=np.log(np.array([[0.6, 0.3], [0.5, 0.4]], np.float32)), ids=np.array([[4, 2], [2, 6]]),
    )  # fmt: skip
    assert most_probable_ids([e], 2, 10, always=()) == (2, 4)  # mass 2: 0.7, 4: 0.6, 6: 0.4
    assert most_probable_ids([e], 2, 10, always=(9,)) == (2, 9)


def test_labels_sit_at_their_tokens_columns(teacher_dir, prompt_sets, tmp_path):
    from jaxsr.training.distill import LabelledExample

    k = 2
    examples = [
        LabelledExample(
            np.arange(1, 6, dtype=np.int32), 2, np.full((3, k), -1.0, np.float32), np.full((3, k), 7)
        ),
        LabelledExample(
            np.arange(1, 4, dtype=np.int32), 1, np.full((2, k), -2.0, np.float32), np.full((2, k), 8)
        ),
    ]
    batch = labelled_batch(examples, np.array([0, 1]), 1, 64)
    targets, values, ids = batch["targets"][0], batch["values"][0], batch["ids"][0]
    assert targets.shape == (2, 16) and values.shape == (2, 16, k)
    assert (values[..., 0] > -100).tolist() == targets.astype(bool).tolist()
    assert (ids[0, 13:] == 7).all() and (ids[1, 14:] == 8).all() and (values[1, 14:] == -2).all()


# -- the run ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def distilled(teacher_dir, prompt_sets, tmp_path_factory) -> tuple[DistillConfig, Path]:
    config = run_config(
        teacher_dir, prompt_sets, tmp_path_factory.mktemp("distill-run"), measure_cost=True,
        export_dtype="bfloat16",
    )  # fmt: skip
    return config, distill(config, progress=False)


@pytest.mark.slow
def test_the_run_raises_lambda_and_records_it(distilled):
    config, _ = distilled
    report = json.loads((Path(config.output_dir) / "distill.json").read_text())
    history = report["history"]
    assert [h["step"] for h in history] == [10, 20, 30]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["lambda"] > history[0]["lambda"]
    assert all(0 < h["lambda"] <= 1 and 0 < h["lambda_top50"] <= 1 for h in history)
    assert history[0]["tokens"] < history[-1]["tokens"]
    assert report["data"]["sequences"] == 8 * 4 and report["cost_ratio"] > 0
    print(f"λ {history[0]['lambda']:.3f} -> {history[-1]['lambda']:.3f}, c = {report['cost_ratio']:.2f}")


@pytest.mark.slow
def test_the_draft_loads_and_drafts_for_its_teacher(teacher_dir, distilled):
    _, final = distilled
    teacher, draft = jaxsr.load_model(teacher_dir), jaxsr.load_model(final)
    assert draft.config.num_layers == 1 and draft.config.hidden_size == 32
    data = (final / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert {t["dtype"] for name, t in header.items() if name != "__metadata__"} == {"BF16"}  # export_dtype
    out = jaxsr.speculative_decode(
        teacher, draft, ["Tell me about cats."], gamma=3, max_new_tokens=16, seed=1
    )
    assert out[0].stats["acceptance_rate"] is not None


@pytest.mark.slow
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(distilled):
    """Remove the final model and the newest checkpoint: the run resumes from step 20 and exports the
    same parameters, bit for bit."""
    config, final = distilled
    before = jaxsr.load_model(final, cache=False)
    output = Path(config.output_dir)
    checkpoints = output / "checkpoints"
    shutil.rmtree(final)
    shutil.rmtree(checkpoints / "30")
    again = distill(config, progress=False)
    after = jaxsr.load_model(again, cache=False)
    for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    history = json.loads((output / "distill.json").read_text())["history"]
    assert [h["step"] for h in history] == [10, 20, 30]


@pytest.mark.slow
def test_a_subset_head_draft(teacher_dir, prompt_sets, tmp_path):
    config = run_config(teacher_dir, prompt_sets, tmp_path, head_tokens=64, steps=10, save_every=10)
    final = distill(config, progress=False)
    draft = jaxsr.load_model(final)
    ids = draft.config.head_token_ids
    assert len(ids) == 64 and draft.eos_token_ids[0] in ids
    logits = np.asarray(draft.logits(np.array([[5, 6, 7]])))
    outside = np.setdiff1d(np.arange(draft.config.vocab_size), ids)
    assert np.isneginf(logits[..., outside]).all() and np.isfinite(logits[..., list(ids)]).all()
    teacher = jaxsr.load_model(teacher_dir)
    out = jaxsr.speculative_decode(teacher, draft, ["Tell me about maps."], gamma=2, max_new_tokens=12)
    assert len(out[0].samples[0].token_ids) > 0
    history = json.loads((tmp_path / "distill.json").read_text())["history"]
    assert 0 < history[-1]["lambda"] <= 1
    results = tmp_path / "results.jsonl"
    sample = {"text": "fine", "score": 1.0, "finished": True}
    results.write_text(json.dumps({"prompt": "Hi?", "samples": [sample], "best": sample}) + "\n")
    sft_config = jaxsr.training.SFTConfig(
        model=str(final), data=str(results), output_dir=str(tmp_path / "sft")
    )
    with pytest.raises(ValueError, match=r"model: .* scores only 64 of its 259 ids"):
        jaxsr.training.sft(sft_config, progress=False)


# -- configs and CLI -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, key",
    [
        ("hidden_sise=64", "hidden_size"),  # unknown, with a suggestion
        ("head_dim=48", "head_dim"),  # does not divide hidden_size=256
        ("num_kv_heads=3", "num_kv_heads"),
        ("head_tokens=0", "head_tokens"),
        ("temperature=-1", "temperature"),
        ("tv_weight=-0.5", "tv_weight"),
        ("warmup_steps=300", "warmup_steps"),
        ("label_top_k=0", "label_top_k"),
        ("prompts=,", "prompts"),
        ("measure_cost=maybe", "measure_cost"),
        ("export_dtype=float16", "export_dtype"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        load_distill_config(None, [override])


def test_a_teacher_that_cannot_load_is_named_and_nothing_is_written(prompt_sets, tmp_path):
    config = DistillConfig(
        teacher=str(tmp_path / "missing"), prompts=prompt_sets[0], heldout=prompt_sets[1],
        output_dir=str(tmp_path / "o"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="teacher: "):
        distill(config, progress=False)
    assert not (tmp_path / "o" / "data").exists()


def test_a_max_length_no_prompt_fits_under_is_refused_before_the_teacher_loads(
    teacher_dir, prompt_sets, tmp_path, monkeypatch
):
    """The prompts are encoded from the teacher's config and tokenizer alone: its weights never load."""
    monkeypatch.setattr(
        sys.modules["jaxsr.training.distill"], "resolve_model", lambda *a, **k: pytest.fail("a model loaded")
    )
    config = run_config(teacher_dir, prompt_sets, tmp_path, max_length=8)
    with pytest.raises(ValueError, match="max_length: every training prompt"):
        distill(config, progress=False)
    assert list(tmp_path.iterdir()) == []  # no lock, no data


def test_prompts_left_after_the_heldout_set_are_required(prompt_sets, tmp_path):
    config = DistillConfig(prompts=prompt_sets[1], heldout=prompt_sets[1], output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="prompts: no prompt"):
        distill(config, progress=False)


@pytest.mark.slow
def test_the_cli_distils(teacher_dir, prompt_sets, tmp_path, capsys):
    config = tmp_path / "distill.yaml"
    config.write_text(f"teacher: {teacher_dir}\nprompts: {prompt_sets[0]}\nheldout: {prompt_sets[1]}\n")
    small = [f"{k}={v}" for k, v in dict(
        output_dir=tmp_path / "o", heldout_prompts=1, max_prompts=2, samples_per_prompt=2, max_new_tokens=8,
        rows_per_batch=4, hidden_size=16, num_layers=1, head_dim=16, num_kv_heads=1, intermediate_size=32,
        batch_size=2, max_length=64, steps=2, warmup_steps=0, save_every=2, measure_cost="false",
    ).items()]  # fmt: skip
    assert main(["train", "distill", str(config), *small, "--no-progress"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(printed) == tmp_path / "o" / "final"
    assert jaxsr.load_model(printed).config.num_layers == 1
    assert main(["train", "distill", str(config), "steps=0"]) == 2
    assert capsys.readouterr().err.strip().startswith("jaxsr: error: steps:")


@pytest.mark.slow
def test_the_accelerator_script_runs_end_to_end(teacher_dir, prompt_sets, tmp_path):
    """scripts/distill_on_accelerator.sh (sized for one H200) runs its config through the CLI and prints
    the λ curve; here on the CPU, its config shrunk to a tiny teacher and student by overrides."""
    repository = Path(__file__).resolve().parents[1]
    overrides = [
        f"teacher={teacher_dir}", f"prompts={prompt_sets[0]}", f"heldout={prompt_sets[1]}",
        "heldout_prompts=1", "samples_per_prompt=2", "max_new_tokens=8", "rows_per_batch=8",
        "label_top_k=4", "hidden_size=32", "num_layers=1", "head_dim=16", "num_kv_heads=1",
        "intermediate_size=64", "head_tokens=64", "batch_size=4", "max_length=64", "steps=2",
        "warmup_steps=0", "save_every=2", "measure_cost=false",
    ]  # fmt: skip
    env = {  # the environment's jaxsr and python3 first on the PATH, as after the script's install line
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OUTPUT_DIR": str(tmp_path / "run"),
    }
    run = subprocess.run(
        ["bash", "scripts/distill_on_accelerator.sh", *overrides],
        cwd=repository, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wall: " in run.stdout and "step     2" in run.stdout, run.stdout
    assert jaxsr.load_model(tmp_path / "run" / "final").config.head_size == 64


def test_the_shipped_configs_read(tmp_path):
    configs = Path(__file__).resolve().parents[1] / "configs" / "train"
    shipped = load_distill_config(configs / "distill_smollm2_draft.yaml")
    # the shipped draft is also the contrastive amateur: a whole-vocabulary head, saved in bfloat16
    assert shipped.teacher == "smollm2" and shipped.head_tokens is None
    assert shipped.export_dtype == "bfloat16"
    assert load_distill_config(configs / "distill_smollm2_draft_h200.yaml").head_tokens == 8192
