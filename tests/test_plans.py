"""Plans: jaxsr's programs compiled for a TPU v5e-8 on this CPU machine (libtpu's topology descriptions),
for a model of real structure — Llama-3.1-8B's widths cut to 2 layers, bf16 — built from its config
alone. The TPU compiles are a backend of their own: XLA_FLAGS' fake CPU devices play no part."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxsr.plans import Batch, abstract_model, bytes_per_device, hlo, plan_batch, target, target_mesh

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")

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
