"""Plans: jaxsr's programs compiled for a TPU v5e-8 on this CPU machine (libtpu's topology descriptions),
for a model of real structure — Llama-3.1-8B's widths cut to 2 layers, bf16 — built from its config
alone. The TPU compiles are a backend of their own: XLA_FLAGS' fake CPU devices play no part."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxsr.cli import main
from jaxsr.ladder import bucket
from jaxsr.loading.hf_config import decoder_config_from_hf
from jaxsr.plans import (
    Batch,
    abstract_model,
    bytes_per_device,
    hf_config_of,
    hlo,
    plan_batch,
    target,
    target_mesh,
)
from jaxsr.plans.targets import LIBRARY_ENV, has_libtpu
from jaxsr.search import memory

SIDE_LIBTPU = Path(sys.prefix) / "libtpu" / "libtpu" / "libtpu.so"
"""Where `make setup` puts libtpu: beside the environment's packages, not among them."""
needs_libtpu = pytest.mark.skipif(
    not (has_libtpu() or SIDE_LIBTPU.is_file()),
    reason="libtpu not found (make setup puts it in .venv/libtpu)",
)


@pytest.fixture(autouse=True, scope="module")
def libtpu_beside_the_packages():
    """TPU_LIBRARY_PATH names the libtpu `make setup` installed, once this process's own backends are
    up (they stay CPU: libtpu found later only describes slices)."""
    jax.devices()
    if has_libtpu() or not SIDE_LIBTPU.is_file():
        yield
        return
    os.environ[LIBRARY_ENV] = str(SIDE_LIBTPU)
    yield
    del os.environ[LIBRARY_ENV]


LLAMA_31_8B_2_LAYERS = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "num_hidden_layers": 2,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
BATCH = Batch(prompts=1, rows=8, prompt_slots=128, max_new_tokens=32)
V5E_8 = target("v5e-8")


def parameter_count(hf: dict) -> tuple[int, int]:
    """(parameters split over `model` by the rules table, replicated norm scales) of a Llama config."""
    d, F, V, L = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    kv = d // hf["num_attention_heads"] * hf["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * F
    return 2 * V * d + L * per_layer, (2 * L + 1) * d


def test_targets_are_named_as_google_cloud_names_slices():
    assert V5E_8.chips == 8 and V5E_8.topology == "v5e:2x4"
    assert target("v6e-16").topology == "v6e:4x4"
    assert (target("v5p-8").chips, target("v5p-8").topology) == (4, "v5p:2x2x1")  # v5p counts cores
    assert target("v4-16").topology == "v4:2x2x2"
    for bad in ("v5e", "v5e-3", "v5p-3", "h100-8", "v5e-x"):
        with pytest.raises(ValueError, match="target"):
            target(bad)


HLO = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0:T(128)} all-reduce(%x), replica_groups={}, to_apply=%add
  %ag-start = (f32[1,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%y), dimensions={0}
  %ag-done = f32[8,8]{1,0} all-gather-done(%ag-start)
  ROOT %f = (s32[], f32[8]) fusion(%ar), kind=kLoop, calls=%fused
}

%fused (q: f32[8]) -> (s32[], f32[8]) {
  %cp = f32[8]{0} collective-permute(%q), source_target_pairs={{0,1}}
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %any = pred[] all-reduce(%z), to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %pre = f32[8]{0} all-reduce(%a), to_apply=%add
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
}
"""


def test_collectives_are_counted_per_program_and_per_loop_step():
    module, entry = hlo.computations(HLO)
    assert entry == "main" and set(module) == {"add", "body", "fused", "cond", "main"}
    step = hlo.loop_step(module, entry)
    assert sorted(step) == ["body", "cond"]
    counts = hlo.collectives(module, step)
    assert counts["all-reduce"] == 2 and counts["all-gather"] == 1 and counts["collective-permute"] == 1
    assert hlo.collectives(module, [entry])["all-reduce"] == 3  # the one before the loop too
    assert hlo.gathered_shapes(module, [entry]) == ["(f32[1,8], f32[8,8])"]


@needs_libtpu
def test_an_abstract_model_is_placed_by_the_rules_table_with_nothing_allocated():
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(V5E_8, data=1, model=8))
    leaves = jax.tree.leaves(model.params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {x.dtype for x in leaves} == {np.dtype("bfloat16")}
    assert {d.platform for d in model.mesh.devices.flat} == {"tpu"}
    # vocabulary 128256 = 8 × 16032: embeddings split by rows, the LM head by columns
    assert model.params["embed"].get_value().sharding.spec == PartitionSpec("model", None)
    assert model.params["lm_head"].get_value().sharding.spec == PartitionSpec(None, "model")
    assert model.params["final_norm"]["scale"].get_value().sharding.spec == PartitionSpec()
    split, replicated = parameter_count(LLAMA_31_8B_2_LAYERS)
    assert bytes_per_device(model.params) == 2 * (split // 8 + replicated)
    assert abs(bytes_per_device(model.params) / (2 * (split + replicated) / 8) - 1) < 0.05


@pytest.fixture(scope="module")
def model_split_plan():
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(V5E_8, data=1, model=8))
    return plan_batch(model, V5E_8, BATCH)


@needs_libtpu
@pytest.mark.slow
def test_a_model_split_eight_ways_compiles_fits_and_all_reduces(model_split_plan):
    plan = model_split_plan
    split, replicated = parameter_count(LLAMA_31_8B_2_LAYERS)
    assert plan.parameter_bytes == 2 * (split // 8 + replicated)
    prefill, decode = plan.program("prefill"), plan.program("decode_loop")
    tokens_and_mask = 2 * BATCH.prompts * BATCH.prompt_slots * 4
    assert prefill.argument_bytes == plan.parameter_bytes + tokens_and_mask  # the parameters, once
    assert decode.argument_bytes > plan.parameter_bytes  # and the caches and the state
    assert decode.alias_bytes > 0  # the state is donated: the loop writes it in place
    assert plan.fits and decode.peak_bytes < V5E_8.chip.usable_bytes
    # one all-reduce for the embedding lookup and one per attention and MLP output: 1 + 2 × 2 layers
    assert prefill.collectives["all-reduce"] == 5
    assert decode.step_collectives is not None and decode.step_collectives["all-reduce"] >= 5
    assert prefill.flops > 0 and decode.flops > 0
    print(f"\nv5e-8 data 1 × model 8, {BATCH}: parameters {plan.parameter_bytes / 2**20:.1f} MiB/device")
    for p in plan.programs:
        print(f"  {p.name}: {p.compile_s:.1f} s, peak {p.peak_bytes / 2**20:.1f} MiB, {p.collectives}")
    print(f"  per decode step: {decode.step_collectives}; all-gathers: {decode.gathered}")


@needs_libtpu
@pytest.mark.slow
def test_rows_split_eight_ways_decode_without_communicating():
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(V5E_8, data=8, model=1))
    plan = plan_batch(model, V5E_8, BATCH)
    split, replicated = parameter_count(LLAMA_31_8B_2_LAYERS)
    assert plan.parameter_bytes == 2 * (split + replicated)  # every device holds the whole model
    decode = plan.program("decode_loop")
    assert plan.fits
    # each device decodes its own row: a step only asks whether any row is still running
    assert decode.step_collectives == {**dict.fromkeys(hlo.COLLECTIVES, 0), "all-reduce": 1}


@needs_libtpu
def test_a_program_too_big_for_the_chip_is_refused_naming_the_target_and_its_memory():
    huge = {**LLAMA_31_8B_2_LAYERS, "vocab_size": 1_100_000, "num_hidden_layers": 1}  # 18 GB replicated
    model = abstract_model(huge, target_mesh(V5E_8, data=8, model=1))
    with pytest.raises(ValueError, match=r"prefill does not fit v5e-8: .*15\.75 GiB"):
        plan_batch(model, V5E_8, BATCH)


# --- a job's plan: `jaxsr plan CONFIG.yaml --target ...` -------------------------------------------------


def test_shipped_configs_are_the_hub_models_and_plan_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gemma = decoder_config_from_hf(hf_config_of("google/gemma-2-9b-it"))
    assert (gemma.num_layers, gemma.hidden_size, gemma.vocab_size) == (42, 3584, 256000)
    skywork = decoder_config_from_hf(hf_config_of("Skywork/Skywork-Reward-Llama-3.1-8B-v0.2"))
    assert skywork.is_reward_model and skywork.num_layers == 32
    llama = hf_config_of("meta-llama/Llama-3.1-8B-Instruct")
    assert {k: llama[k] for k in LLAMA_31_8B_2_LAYERS if k != "num_hidden_layers"} == {
        k: v for k, v in LLAMA_31_8B_2_LAYERS.items() if k != "num_hidden_layers"
    }
    assert hf_config_of("smollm2")["num_hidden_layers"] == 30  # the embedded GGUF's metadata
    assert hf_config_of("smollm2-draft")["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="ships no config for it, and the hub could not provide"):
        hf_config_of("no-such-owner/no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        hf_config_of("./no/such/dir")


def test_best_of_n_rows_of_a_plan_are_the_searchs_own():
    sampler = types.SimpleNamespace(slot_bytes=1000, headroom=0, mesh=None)
    # (slots, n, prompt, new tokens, rows): n samples in chunks; sixteen prompts of 8 each; one prompt
    for slots, n, prompt, new, rows in [
        (4096, 16, 128, 256, 8),
        (100_000, 8, 64, 512, 128),
        (700, 4, 128, 128, 4),
    ]:
        ours = memory.rows_within(slots, bucket(prompt), bucket(new), n)  # what a plan calls
        assert ours == rows == memory.best_of_n_rows(sampler, slots, [[0] * prompt], n, new), (slots, n)


def reward_checkpoint(tmp_path) -> str:
    """A reward model's directory: the embedded draft's config as a sequence classifier (config only)."""
    config = hf_config_of("smollm2-draft") | {"architectures": ["LlamaForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@needs_libtpu
@pytest.mark.slow
def test_a_jobs_plan_counts_its_reward_model_and_prints_and_writes_it(tmp_path, capsys):
    """Best-of-N over the embedded SmolLM2 (cut to 1 layer) scored by a reward model, on a v5e-4 split
    2 × 2: the batch within the memory_budget, the reward model's scoring compiled and counted."""
    config_file = tmp_path / "job.yaml"
    config_file.write_text(
        f"method: best_of_n\nn: 8\nreward: {reward_checkpoint(tmp_path)}\nmax_new_tokens: 32\n"
        "dtype: bfloat16\nmesh_data: -1\nmesh_model: 2\nmemory_budget: 1024\n"
    )
    out = tmp_path / "plan.json"
    argv = ["plan", str(config_file), "--target", "v5e-4", "--layers", "1", "--prompt-tokens", "60"]
    assert main([*argv, "--json", str(out)]) == 0
    printed, plan = capsys.readouterr().out, json.loads(out.read_text())
    assert plan["mesh"] == {"data": 2, "model": 2} and plan["layers"] == 1
    # 1024 slots, prompts of 64, rows of 32: 16 rows = 2 prompts' 8 samples
    assert plan["batch"] == {
        "prompts": 2,
        "rows": 8,
        "prompt_slots": 64,
        "max_new_tokens": 32,
        "segment": None,
    }
    names = [p["name"] for p in plan["programs"]]
    assert names == ["prefill", "start", "decode_loop", "reward_scores"]
    assert plan["reward_batch"] == {"rows": 32, "length": 96}
    assert set(plan["parameter_bytes"]) == {"model", "reward"} and plan["fits"]
    loop = plan["programs"][2]
    # the reward model's parameters stay beside the decoder's programs
    assert plan["peak_bytes"]["decode_loop"] == _peak(loop) + plan["parameter_bytes"]["reward"]
    assert plan["peak_bytes"]["reward_scores"] == _peak(plan["programs"][3]) + loop["argument_bytes"]
    step = plan["decode_step"]
    v5e = V5E_8.chip
    assert step["step_s"] == max(loop["flops"] / v5e.bf16_flops, loop["bytes_accessed"] / v5e.hbm_bytes_per_s)
    assert step["tokens_per_s"] == pytest.approx(16 / step["step_s"])
    # one row's caches: 1 layer × (K + V) × 3 KV heads × 64 dims × 32 slots × 2 bytes, on one device
    assert plan["kv_bytes_per_row"] == 2 * 3 * 64 * 32 * 2
    assert "best_of_n on v5e-4" in printed and "reward_scores: peak" in printed and "lower bound" in printed


def _peak(program: dict) -> int:
    keys = ("argument_bytes", "output_bytes", "temp_bytes", "code_bytes")
    return sum(program[k] for k in keys) - program["alias_bytes"]


@needs_libtpu
def test_a_job_whose_parameters_exceed_the_chip_is_refused_in_one_line(capsys):
    argv = ["plan", "configs/speculative_rejection_gemma2_9b.yaml", "--target", "v5e-8", "mesh_model=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (libtpu's own warnings before it)
    assert err.startswith("jaxsr: error: parameters: ") and "15.75 GiB a v5e-8 program may use" in err


def test_plan_usage_errors_are_one_line(capsys):
    assert main(["plan", "configs/speculative_rejection_gemma2_9b.yaml", "--target", "h100-8"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("jaxsr: error: target: expected a name like")
    with pytest.raises(SystemExit) as e:
        main(["plan", "configs/speculative_rejection_gemma2_9b.yaml"])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err
