"""Plans: jaxsr's programs compiled for a TPU v5e-8 (libtpu's topology descriptions) and for 8 H100s (jax's
CUDA plugin given the GPU's figures) on this CPU machine, for a model of real structure — Llama-3.1-8B's
widths cut to 2 layers, bf16 — built from its config alone. The TPU and GPU compiles are backends of
their own: XLA_FLAGS' fake CPU devices play no part."""

from __future__ import annotations

import dataclasses
import json
import os
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxsr.cli import main
from jaxsr.decoding import loop, memory
from jaxsr.decoding.driver import as_sampler
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.jobs.config import JobConfig, load_job_config
from jaxsr.jobs.methods import DECODER_BUILDERS
from jaxsr.ladder import bucket
from jaxsr.loading.hf_config import decoder_config_from_hf
from jaxsr.plans import (
    Batch,
    abstract_model,
    bytes_per_device,
    gpus,
    hf_config_of,
    hlo,
    plan_batch,
    plan_job,
    target,
    target_devices,
    target_mesh,
)
from jaxsr.plans.compiled import abstract_tokens, compile_for
from jaxsr.plans.job import cut, dominated, first_rung, job_batch, job_budget, job_reward_model, job_sampler
from jaxsr.plans.targets import LIBRARY_ENV, SIDE_LIBTPU, has_libtpu, naming_side_libtpu, side_libtpu
from jaxsr.sharding import on_mesh

needs_libtpu = pytest.mark.skipif(
    not has_libtpu(), reason="libtpu not found (make setup puts it in .venv/libtpu)"
)


needs_cuda_plan = pytest.mark.skipif(
    not gpus.has_cuda_plan(),
    reason="jax's CUDA plugin or ptxas not found (make setup puts them in .venv/cuda-plan)",
)


def test_the_libtpu_make_setup_installs_is_found_with_no_variable_set(monkeypatch):
    """`make setup` puts libtpu beside the environment's packages: a TPU plan names it to jax only while
    jax loads it (after this process's own backends are up), and a slice is described."""
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    if side_libtpu() is None:
        pytest.skip("no libtpu beside the packages, or jax finds its own (the libtpu package)")
    assert has_libtpu()
    with naming_side_libtpu():
        assert os.environ[LIBRARY_ENV] == str(SIDE_LIBTPU)
    assert LIBRARY_ENV not in os.environ
    devices = target_devices.__wrapped__(target("v5e-8"))
    assert len(devices) == 8 and {d.platform for d in devices} == {"tpu"}
    assert LIBRARY_ENV not in os.environ


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
H100_8 = target("h100x8")
GEMMA_V5E_8_ROWS = 1688
"""The shipped Gemma-2-9B job's Speculative Rejection first batch on a v5e-8 split 2 × 4 (README)."""
LLAMA_H100_8_ROWS = 54672
"""A Llama-3.1-8B job's first batch on 8 H100s split 4 × 2."""


def parameter_count(hf: dict) -> tuple[int, int]:
    """(parameters split over `model` by the rules table, replicated norm scales) of a Llama config."""
    d, F, V, L = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    kv = d // hf["num_attention_heads"] * hf["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * F
    return 2 * V * d + L * per_layer, (2 * L + 1) * d


def test_targets_are_named_as_google_cloud_names_slices():
    assert (V5E_8.chips, V5E_8.hosts, V5E_8.topology) == (8, 1, "v5e:2x4")
    assert (target("v5p-8").chips, target("v5p-8").topology) == (4, "v5p:2x2x1")  # v5p counts cores
    # a larger slice is hosts of 8 chips (v5e, v6e) or 4 (v5p, v4): a plan compiles for one host's
    slices = [("v6e-16", 16, 2, "v6e:2x4"), ("v5e-64", 64, 8, "v5e:2x4"), ("v4-16", 8, 2, "v4:2x2x1"),
              ("v5p-32", 16, 4, "v5p:2x2x1")]  # fmt: skip
    for name, chips, hosts, host in slices:
        slice_ = target(name)
        assert (slice_.chips, slice_.hosts, slice_.topology, slice_.host.hosts) == (chips, hosts, host, 1)
    for bad in ("v5e", "v5e-3", "v5p-3", "h100-8", "v5e-x", "v5e-²", "h100x²"):  # ² passes str.isdigit
        with pytest.raises(ValueError, match="target"):
            target(bad)


def test_gpu_targets_are_named_by_the_gpu_and_how_many_one_host_holds():
    assert (H100_8.chips, H100_8.chip.kind, H100_8.chip.platform) == (8, "h100", "cuda")
    assert target("a100-80x4").chips == 4 and target("h200x1").chip.hbm_bytes == 143771 * 2**20
    # a program gets the share of the GPU's memory JAX's allocator takes by default
    assert H100_8.chip.usable_bytes == int(0.75 * 81559 * 2**20)
    assert (target("h100x16").hosts, target("h100x16").host.chips) == (2, 8)  # hosts of 8
    for bad in ("h100x3", "h100x12", "h100x0", "h100x"):
        with pytest.raises(
            ValueError, match=r"is no h100 host .*\(1, 2, 4, 8\) on one host, or a multiple of 8"
        ):
            target(bad)
    for bad in ("h100", "b200x8", "x8"):
        with pytest.raises(ValueError, match=r"like v5e-8 or h100x8 .*GPUs a100-80xN, h100xN, h200xN"):
            target(bad)


def test_a_gpu_is_described_to_xla_from_its_published_figures():
    config = gpus.target_config(gpus.GPUS["h100"])
    assert (
        config.startswith("gpu_device_info {") and 'device_description_str: "NVIDIA H100 80GB HBM3"' in config
    )
    for field in ("core_count: 132", "threads_per_warp: 32", "block_dim_limit_x: 2147483647",
                  "shared_memory_per_block_optin: 232448", "device_memory_size: 85520809984",
                  "cuda_compute_capability { major: 9 minor: 0 }", 'platform_name: "CUDA"'):  # fmt: skip
        assert field in config
    assert "collective_memory_granularity" not in config  # jaxlib 0.10.2 refuses it
    assert "major: 8 minor: 0" in gpus.target_config(gpus.GPUS["a100-80"])


def test_a_gpu_plan_without_the_cuda_plugin_says_what_to_install(monkeypatch, capsys):
    from jaxlib import xla_client

    monkeypatch.setattr(xla_client, "pjrt_plugin_loaded", lambda name: False)
    monkeypatch.setattr(gpus, "plugin_location", lambda: None)
    with pytest.raises(ImportError, match=r"pip install 'jaxsr\[plan\]'.*cuda-plan"):
        gpus.cuda_devices(gpus.GPUS["h100"], 8)
    assert main(["plan", "configs/generate_alpaca.yaml", "--target", "h100x8"]) == 2  # one line, no traceback
    error = capsys.readouterr().err
    assert (
        error.startswith("jaxsr: error: ") and "pip install 'jaxsr[plan]'" in error and error.count("\n") == 1
    )


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


COUNTED = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%gemm (p0: bf16[8,64], p1: bf16[64,32]) -> bf16[8,32] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %d = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemv (q0: bf16[64,32], q1: bf16[64]) -> f32[32] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  %q1 = bf16[64]{0} parameter(1)
  %c = f32[64,32]{1,0} convert(%q0)
  %b = f32[64,32]{1,0} broadcast(%q1), dimensions={0}
  %m = f32[64,32]{1,0} multiply(%c, %b)
  %z = f32[] constant(0)
  ROOT %r = f32[32]{0} reduce(%m, %z), dimensions={0}, to_apply=%add
}

%write (c0: bf16[8,1024], c1: bf16[8,1], c2: s32[]) -> bf16[8,1024] {
  %c0 = bf16[8,1024]{1,0} parameter(0)
  %c1 = bf16[8,1]{1,0} parameter(1)
  %c2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %u = bf16[8,1024]{1,0} dynamic-update-slice(%c0, %c1, %zero, %c2)
}

%body (s: (s32[], bf16[8,64], bf16[8,1024])) -> (s32[], bf16[8,64], bf16[8,1024]) {
  %s = (s32[], bf16[8,64]{1,0}, bf16[8,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = bf16[8,64]{1,0} get-tuple-element(%s), index=1
  %cache = bf16[8,1024]{1,0} get-tuple-element(%s), index=2
  %w = bf16[64,32]{1,0} constant({...})
  %y = bf16[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %new = bf16[8,1]{1,0} slice(%y), slice={[0:8], [0:1]}
  %cache2 = bf16[8,1024]{1,0} fusion(%cache, %new, %i), kind=kLoop, calls=%write
  ROOT %t = (s32[], bf16[8,64]{1,0}, /*index=2*/bf16[8,1024]{1,0}) tuple(%i, %x, %cache2)
}

%cond (s: (s32[], bf16[8,64], bf16[8,1024])) -> pred[] {
  %s = (s32[], bf16[8,64]{1,0}, bf16[8,1024]{1,0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (a: bf16[64,32], v: bf16[64], s: (s32[], bf16[8,64], bf16[8,1024])) -> f32[32] {
  %a = bf16[64,32]{1,0} parameter(0)
  %v = bf16[64]{0} parameter(1)
  %s = (s32[], bf16[8,64]{1,0}, bf16[8,1024]{1,0}) parameter(2)
  %w = (s32[], bf16[8,64]{1,0}, bf16[8,1024]{1,0}) while(%s), condition=%cond, body=%body
  ROOT %g = f32[32]{0} fusion(%a, %v), kind=kInput, calls=%gemv
}
"""


def test_gpu_work_and_traffic_are_counted_from_the_compiled_program():
    """A GPU program's FLOPs and bytes (XLA gives no cost analysis there), by hand: the loop's body
    once; a matrix-vector product XLA wrote as a multiply and a reduction counts as its dot."""
    module, entry = hlo.computations(COUNTED)
    dot, gemv = 2 * 8 * 32 * 64, 2 * 64 * 32  # the body's dot; the entry's multiply and reduction
    assert hlo.flops(module, entry) == dot + gemv
    # the dot reads x and w and writes y; the slice reads and writes what it takes; the cache is
    # updated in place (its row written, not read); the gemv reads a and v and writes its result
    dot_bytes = (8 * 64 + 64 * 32 + 8 * 32) * 2
    slice_bytes, update_bytes = 2 * 8 * 2, 8 * 2 + 8 * 2 + 4
    gemv_bytes = (64 * 32 + 64) * 2 + 32 * 4
    assert hlo.bytes_accessed(module, entry) == dot_bytes + slice_bytes + update_bytes + gemv_bytes


SCATTERED = """\
HloModule m

%assign (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  ROOT %b = bf16[] parameter(1)
}

%write (c0: bf16[64,4,32,128], c1: s32[64,4,3], c2: bf16[64,4,128]) -> bf16[64,4,32,128] {
  %c0 = bf16[64,4,32,128] parameter(0)
  %c1 = s32[64,4,3] parameter(1)
  %c2 = bf16[64,4,128] parameter(2)
  ROOT %s = bf16[64,4,32,128] scatter(%c0, %c1, %c2), update_window_dims={2}, to_apply=%assign
}

%body (s: (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128])) -> (bf16[64,4,32,128], s32[64,4,3]) {
  %s = (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128]) parameter(0)
  %cache = bf16[64,4,32,128] get-tuple-element(%s), index=0
  %at = s32[64,4,3] get-tuple-element(%s), index=1
  %new = bf16[64,4,128] get-tuple-element(%s), index=2
  %cache2 = bf16[64,4,32,128] fusion(%cache, %at, %new), kind=kInput, calls=%write
  %cache3 = bf16[64,4,32,128] scatter(%cache2, %at, %new), update_window_dims={2}, to_apply=%assign
  ROOT %t = (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128]) tuple(%cache3, %at, %new)
}

%cond (s: (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128])) -> pred[] {
  %s = (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128]) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (s: (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128])) -> bf16[64,4,32,128] {
  %s = (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128]) parameter(0)
  ROOT %w = (bf16[64,4,32,128], s32[64,4,3], bf16[64,4,128]) while(%s), condition=%cond, body=%body
}
"""


def test_a_scatter_into_a_cache_moves_its_update_not_the_cache():
    """A decode step's write of each (row, head)'s new key into its cache slot, fused (as XLA:GPU emits
    it) and not: the indices and the update are read and the update written, the cache updated in
    place (it was counted read and written whole)."""
    module, entry = hlo.computations(SCATTERED)
    indices, update = 64 * 4 * 3 * 4, 64 * 4 * 128 * 2
    assert hlo.bytes_accessed(module, entry) == 2 * (indices + 2 * update)


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
@pytest.mark.slow
def test_a_tpu_token_loop_writes_its_row_caches_in_place():
    """On a TPU the keys are stored as the values are, [rows, kv_heads, slots, head_dim]
    (`cache.key_slot_axis`), so a step writes each row's new key and value in place: its loop copies no
    array as large as one layer's row keys. Stored transposed, XLA:TPU copied every layer's keys and
    values into another layout and back each step (4 copies a layer). In place only where the slots
    fill whole 8-slot tiles: a later rung of 219 slots copies its caches, one of 216 does not
    (`cache.slot_tile`: `MemoryPlan` plans a TPU's rungs so)."""
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(V5E_8, data=8, model=1))
    rungs = ((16, 219), (8, 216))  # rows a prompt, slots: 16 and 8 rows a device
    plan = plan_batch(
        model, V5E_8, dataclasses.replace(BATCH, prompts=8, rows=64, max_new_tokens=256, rungs=rungs)
    )
    layer = plan.row_cache_bytes // (2 * LLAMA_31_8B_2_LAYERS["num_hidden_layers"])  # a device's keys
    loop = plan.program("decode_loop")
    assert layer > 2**20 and loop.step_copied is not None
    assert all(hlo.type_bytes(shape) < layer for shape in loop.step_copied), (layer, loop.step_copied)
    heads, head_dim = LLAMA_31_8B_2_LAYERS["num_key_value_heads"], 128

    def copies_its_keys(name: str, rows: int, slots: int) -> bool:
        keys = rows * heads * slots * head_dim * 2  # bf16
        return any(hlo.type_bytes(shape) >= keys for shape in plan.program(name).step_copied)

    assert copies_its_keys("decode_loop_rung2", 16, 219) and not copies_its_keys("decode_loop_rung3", 8, 216)


@needs_libtpu
@pytest.mark.slow
def test_a_speculative_tpu_token_loop_has_row_caches_of_whole_tiles_and_writes_them_in_place():
    """A draft's look-ahead (γ+1 = 5 slots) would leave 256-token rows' caches at 261 slots, off the
    TPU's tiles, so every step would copy them (as a rung of 208 + 5 slots does): `Sampler.cache_slots`
    rounds a full row's cache up to 264, which the step writes in place."""
    mesh = target_mesh(V5E_8, data=8, model=1)
    model = abstract_model(LLAMA_31_8B_2_LAYERS, mesh)
    draft = {**LLAMA_31_8B_2_LAYERS, "num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 8}
    sampler = as_sampler(DECODER_BUILDERS["speculative"](model, abstract_model(draft, mesh), gamma=4), None)
    assert (sampler.headroom, sampler.slot_tile, sampler.cache_slots(256)) == (5, 8, 264)
    batch = dataclasses.replace(BATCH, prompts=8, rows=64, max_new_tokens=256, rungs=((8, 208),))
    plan = plan_batch(sampler, V5E_8, batch)

    def copies_its_cache(name: str, slots: int) -> bool:  # a device's 8 rows of target keys or values
        return f"bf16[8,8,{slots},128]" in plan.program(name).step_copied

    assert not copies_its_cache("decode_loop", 264) and copies_its_cache("decode_loop_rung2", 213)


@needs_libtpu
def test_a_program_too_big_for_the_chip_is_refused_naming_the_target_and_its_memory():
    huge = {**LLAMA_31_8B_2_LAYERS, "vocab_size": 1_100_000, "num_hidden_layers": 1}  # 18 GB replicated
    model = abstract_model(huge, target_mesh(V5E_8, data=8, model=1))
    with pytest.raises(ValueError, match=r"prefill does not fit v5e-8: .*15\.75 GiB"):
        plan_batch(model, V5E_8, BATCH)


# --- the same model on 8 H100s: jax's CUDA plugin compiles for GPUs it is only told about -----------------


@pytest.fixture(scope="module")
def h100_rows_split_plan():
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(H100_8, data=8, model=1))
    return plan_batch(model, H100_8, BATCH)


@needs_cuda_plan
def test_an_abstract_model_split_over_eight_h100s_holds_its_shards():
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(H100_8, data=1, model=8))
    devices = list(model.mesh.devices.flat)
    assert {(d.platform, d.device_kind) for d in devices} == {("gpu", "NVIDIA H100 80GB HBM3")}
    split, replicated = parameter_count(LLAMA_31_8B_2_LAYERS)
    assert bytes_per_device(model.params) == 2 * (split // 8 + replicated)


@pytest.mark.slow  # its fixture compiles a 2-layer Llama-3.1-8B-wide plan for 8 H100s (CUDA plugin)
@needs_cuda_plan
def test_rows_split_over_eight_h100s_decode_without_gathering(h100_rows_split_plan):
    plan = h100_rows_split_plan
    split, replicated = parameter_count(LLAMA_31_8B_2_LAYERS)
    assert plan.parameter_bytes == 2 * (split + replicated)  # every GPU holds the whole model
    prefill, decode = plan.program("prefill"), plan.program("decode_loop")
    assert prefill.argument_bytes == plan.parameter_bytes + 2 * BATCH.prompts * BATCH.prompt_slots * 4
    assert plan.fits and decode.alias_bytes > 0  # the loop's state donated, written in place
    # each GPU decodes its own row: a step only asks whether any row is still running
    assert decode.step_collectives == {**dict.fromkeys(hlo.COLLECTIVES, 0), "all-reduce": 1}
    # one step of one row: 2 FLOPs per weight of every matrix but the embedding table (whose row is
    # only looked up), each read once from memory as bf16; attention and norms add a little
    hf = LLAMA_31_8B_2_LAYERS
    matrices = split - hf["vocab_size"] * hf["hidden_size"]
    assert 2 * matrices < decode.flops < 1.01 * 2 * matrices
    assert 2 * matrices < decode.bytes_accessed < 1.1 * 2 * matrices
    compiled = ", ".join(f"{p.name} {p.compile_s:.1f} s" for p in plan.programs)
    print(f"\nh100x8 data 8 × model 1, {BATCH}: step {decode.flops / 1e9:.2f} GFLOP, ", end="")
    print(f"{decode.bytes_accessed / 2**30:.2f} GiB; compiled: {compiled}")


@pytest.mark.slow  # compiles a 2-layer Llama-3.1-8B-wide decode loop for 8 H100s (CUDA plugin)
@needs_cuda_plan
def test_top_k_sampling_over_a_split_vocabulary_gathers_no_rows_across_data_shards():
    """Rows over 4 `data` shards, the vocabulary over 2 `model` shards, top-k 50: XLA GPU's top-k
    cannot split by rows and gathered every shard's candidates ([rows, 50·64] over the data shards)
    each step; top-k runs per data shard (`sharding.per_row_shard`), so the one all-gather left is
    the model shards' top-50 per row, over the `model` axis."""
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(H100_8, data=4, model=2))
    sampler = as_sampler(model, SamplingConfig(temperature=1.0, top_k=50, top_p=1.0))
    batch = Batch(prompts=1, rows=64, prompt_slots=128, max_new_tokens=32)
    loop = plan_batch(sampler, H100_8, batch).program("decode_loop")
    assert loop.step_collectives["all-gather"] == 1  # each model shard's top 50 of its vocabulary half
    # 16 rows a device: their candidates gathered over the 2 model shards, none over the data shards
    assert loop.gathered == ("((f32[16,50], s32[16,50]), (f32[32,50], s32[32,50]))",)


@pytest.mark.slow  # compiles a 1-layer Llama-3.1-8B-wide decode loop of 512 rows for a v5e-8 twice (libtpu)
@needs_libtpu
def test_top_k_sampling_on_a_tpu_runs_the_tpus_own_top_k():
    """A TPU pads the blocked search's [blocks, 64] tiles to 128 lanes and holds its padded copy of the
    scores: there the token loop runs XLA's own top-k, which holds less (CPU and GPU keep the search)."""
    one_layer = {**LLAMA_31_8B_2_LAYERS, "num_hidden_layers": 1}  # sampling is after the layers
    model = abstract_model(one_layer, target_mesh(V5E_8, data=8, model=1))
    sampler = as_sampler(model, SamplingConfig(temperature=1.0, top_k=50, top_p=1.0))
    batch = Batch(prompts=1, rows=512, prompt_slots=128, max_new_tokens=32)
    own = plan_batch(sampler, V5E_8, batch).program("decode_loop")
    with pytest.MonkeyPatch.context() as patch:  # the blocked search everywhere, as before
        patch.setattr(jax.lax, "platform_dependent", lambda *args, default, **_: default(*args))
        jax.clear_caches()  # traced anew
        blocked = plan_batch(sampler, V5E_8, batch).program("decode_loop")
    jax.clear_caches()
    scores = 512 // 8 * LLAMA_31_8B_2_LAYERS["vocab_size"] * 4  # a device's float32 scores
    assert blocked.temp_bytes - own.temp_bytes > scores, (blocked.temp_bytes, own.temp_bytes)


@needs_libtpu
@needs_cuda_plan
@pytest.mark.slow
def test_gpu_counts_agree_with_the_tpu_cost_analysis_of_the_same_program():
    """The prefill of one prompt on rows split eight ways (each device runs it whole): its FLOPs
    counted from the GPU program within 5% of XLA's cost analysis of the TPU one, and its memory
    traffic within a factor of 2 (each compiler fuses differently; the TPU counts more of it)."""
    programs = {}
    for slice_ in (V5E_8, H100_8):
        model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(slice_, data=8, model=1))
        tokens = abstract_tokens(model.mesh, BATCH.prompts, BATCH.prompt_slots, PartitionSpec())
        compile_ = lambda m=model, t=tokens: loop.prefill.lower(m.graph, m.params, t, t).compile()
        with on_mesh(model):
            programs[slice_.chip.platform] = compile_for(slice_, "prefill", compile_)[1]
    tpu, gpu = programs["tpu"], programs["cuda"]
    assert gpu.flops == pytest.approx(tpu.flops, rel=0.05)
    assert 0.5 < gpu.bytes_accessed / tpu.bytes_accessed < 2


@needs_cuda_plan
def test_a_program_too_big_for_the_gpu_is_refused_naming_the_target_and_its_memory():
    huge = {**LLAMA_31_8B_2_LAYERS, "vocab_size": 4_000_000, "num_hidden_layers": 1}  # 66 GB replicated
    model = abstract_model(huge, target_mesh(H100_8, data=8, model=1))
    refusal = r"prefill does not fit h100x8: more than the 59\.74 GiB .* on an h100 \(.*75% of its 79\.65 GiB"
    with pytest.raises(ValueError, match=refusal):
        plan_batch(model, H100_8, BATCH)


# --- a job's plan: `jaxsr plan CONFIG.yaml --target ...` -------------------------------------------------


@pytest.mark.slow  # reads SmolLM2's GGUF with its tokenizer (transformers) and asks an offline hub
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
    sampler = types.SimpleNamespace(slot_bytes=1000, headroom=0, mesh=None, cache_slots=lambda tokens: tokens)
    # (slots, n, prompt, new tokens, rows): n samples in chunks; sixteen prompts of 8 each; one prompt
    for slots, n, prompt, new, rows in [
        (4096, 16, 128, 256, 8),
        (100_000, 8, 64, 512, 128),
        (700, 4, 128, 128, 4),
    ]:
        ours = memory.rows_within(slots, bucket(prompt), bucket(new), n)  # what a plan calls
        assert ours == rows == memory.budget_rows(sampler, slots, [[0] * prompt], n, new), (slots, n)


def test_a_tree_best_of_n_plan_decodes_n_rows_of_each_prompt_in_flight():
    """TreeBoN keeps N rows a prompt at every layer, `concurrent_prompts` prompts in one batch (the
    scheduler's layout), whatever the memory: its plan is that batch, not a decoding call's."""
    job = JobConfig(method="tree_best_of_n", reward="self_likelihood", n=8, branch=2, layers=2)
    batch = job_batch(job, types.SimpleNamespace(mesh=None), 10**6, 64)
    shape = (batch.prompts, batch.rows, batch.prompt_slots, batch.segment)
    assert shape == (job.concurrent_prompts, 8, 64, None)


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
        "next_rows": None,
        "next_segment": None,
        "rungs": [],
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


@pytest.mark.slow  # compiles a 1-layer SmolLM2-draft plan for a v4-16 (libtpu)
@needs_libtpu
def test_a_slice_of_several_hosts_is_planned_as_one_hosts_job_process(tmp_path, capsys):
    """A v4-16 is two hosts of 4 chips: each runs the job on its own chips (a mesh of `local_devices`),
    so the programs are one host's and the job's tokens/s twice one host's."""
    config_file = tmp_path / "job.yaml"
    config_file.write_text("model: smollm2-draft\nmax_new_tokens: 16\nmesh_data: -1\nmax_rows: 8\n")
    out = tmp_path / "plan.json"
    assert main(["plan", str(config_file), "--target", "v4-16", "--layers", "1", "--json", str(out)]) == 0
    printed, plan = capsys.readouterr().out, json.loads(out.read_text())
    assert plan["target"]["chips"] == 8 and plan["target"]["hosts"] == 2
    assert plan["mesh"] == {"data": 4, "model": 1} and plan["rows"] == 8
    step = plan["decode_step"]
    assert step["job_tokens_per_s"] == pytest.approx(2 * step["tokens_per_s"]) and step["tokens_per_s"] > 0
    assert "2 hosts of 4 chips: each runs a job process on its own chips" in printed
    assert f"{step['job_tokens_per_s']:,.0f} on all 2" in printed


def test_a_later_rung_is_left_out_only_where_compiled_rungs_hold_more_rows_and_slots_between_them():
    # (rows, slots): the first rung's 16-slot rows, then ever fewer, longer rows: 1708 rows of 512
    # slots hold more slots than 3412 of 255, and the rungs of 512 after it fewer rows and slots
    batch = Batch(4, 6820, 128, 512, 16, rungs=((3412, 255), (1708, 512), (852, 512), (4, 512)))
    kept, skipped = dominated(batch, 0, all_rungs=False)
    assert kept.rungs == ((3412, 255), (1708, 512)) and skipped == ((852, 512), (4, 512))
    assert dominated(batch, 0, all_rungs=True) == (batch, ())
    # a v5e-8's ladder: 692 rows of 44 slots have fewer rows and slots than 0.53 of the first rung
    # (1384 × 16) and 0.47 of 88 rows of 453, and so do 348 × 102 and 176 × 218
    batch = Batch(4, 1384, 128, 512, 16, rungs=((692, 44), (348, 102), (176, 218), (88, 453), (44, 512)))
    kept, skipped = dominated(batch, 0, all_rungs=False)
    assert kept.rungs == ((88, 453),) and skipped == ((692, 44), (348, 102), (176, 218), (44, 512))
    # a look-ahead's slots count: 4 rows of 20 hold more than 8 rows of 8, not than 8 of 8 + 8
    batch = Batch(1, 8, 128, 64, 8, rungs=((4, 20),))
    assert dominated(batch, 0, all_rungs=False)[0].rungs == ((4, 20),)
    assert dominated(batch, 8, all_rungs=False)[1] == ((4, 20),)


@pytest.mark.slow  # compiles a 1-layer SmolLM2-draft SR plan for an H100 twice, all rungs the second time
@needs_cuda_plan
def test_an_sr_plan_compiles_the_later_rungs_decode_loops_at_their_shapes(tmp_path, capsys):
    """Speculative Rejection decodes each rung in a loop of its own shape: the plan compiles the next
    rung's, leaves out rungs it dominates, and with --all-rungs compiles every one, its rows' caches as
    the decisions' compaction leaves them."""
    config_file = tmp_path / "job.yaml"
    config_file.write_text(
        "method: speculative_rejection\nmodel: smollm2-draft\nreward: self_likelihood\nmax_new_tokens: 64\n"
        "n: 8\nmemory_budget: 400\nconcurrent_prompts: 2\nmesh_data: 1\nmin_first_segment: 8\n"
    )
    out = tmp_path / "plan.json"
    argv = ["plan", str(config_file), "--target", "h100x1", "--layers", "1", "--json", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    # 8 rows of 32 slots, then 4, 2 and 1 rows of every token's 64 slots in the 272 slots a prompt has:
    # none holds more rows or slots than the first
    assert (plan["batch"]["rows"], plan["batch"]["segment"]) == (8, 32)
    assert plan["batch"]["rungs"] == [] and plan["skipped_rungs"] == [[4, 64], [2, 64], [1, 64]]
    assert not any(p["name"].startswith("decode_loop_rung") for p in plan["programs"])
    assert (
        "later rungs not compiled (--all-rungs compiles them): 4×64, 2×64, 1×64; a mix"
        in capsys.readouterr().out
    )
    assert main([*argv, "--all-rungs"]) == 0
    plan = json.loads(out.read_text())
    programs = {p["name"]: p for p in plan["programs"]}
    assert [p for p in programs if p.startswith("decode_loop_rung")] == [
        f"decode_loop_rung{n}" for n in (2, 3, 4)
    ]
    # inputs grow by each row's K and V slots (a GPU's arrays are not padded to tiles as a TPU's are)
    # and its other fields: rungs 2 and 3 (4 and 2 rows of 64 slots, 2 prompts) give a row's fields,
    # and so the first rung's inputs (8 rows of 32 slots) and rung 4's (1 row)
    args = {name: programs[name]["argument_bytes"] for name in programs}
    slot, prompts = plan["kv_bytes_per_row"] // 32, 2
    row = (args["decode_loop_rung2"] - args["decode_loop_rung3"]) // (prompts * 2) - 64 * slot
    at = lambda rows, slots: (
        args["decode_loop_rung3"] + prompts * (rows * (slots * slot + row) - 2 * (64 * slot + row))
    )
    assert 0 < row < 64 * slot  # a row's tokens, counters and flags
    assert args["decode_loop"] == at(8, 32) and args["decode_loop_rung4"] == at(1, 64)


@pytest.mark.slow  # starts libtpu and lays out Gemma-2-9B's and its reward model's parameters
@needs_libtpu
def test_a_job_whose_parameters_exceed_the_chip_is_refused_in_one_line(capsys):
    argv = ["plan", "configs/speculative_rejection_gemma2_9b.yaml", "--target", "v5e-8", "mesh_model=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (libtpu's own warnings before it)
    assert err.startswith("jaxsr: error: parameters: ") and "15.75 GiB a v5e-8 program may use" in err


@needs_cuda_plan
@pytest.mark.slow
def test_a_jobs_plan_for_eight_h100s(tmp_path, capsys):
    """The shipped Gemma-2-9B job (cut to 1 layer, a small budget) planned for an 8-GPU host."""
    out = tmp_path / "plan.json"
    argv = ["plan", "configs/speculative_rejection_gemma2_9b.yaml", "--target", "h100x8", "--layers", "1"]
    assert main([*argv, "memory_budget=4096", "--json", str(out)]) == 0
    printed, plan = capsys.readouterr().out, json.loads(out.read_text())
    assert plan["target"]["platform"] == "cuda" and plan["mesh"] == {"data": 4, "model": 2} and plan["fits"]
    assert plan["decode_step"]["flops"] > 0 and plan["decode_step"]["bytes"] > 0
    assert "on h100x8 (8 × h100, 59.74 GiB usable per GPU: JAX's default 75% of 79.65 GiB)" in printed


@needs_libtpu
@pytest.mark.slow
def test_the_shipped_gemma_job_fits_a_v5e_8():
    """configs/speculative_rejection_gemma2_9b.yaml (Gemma-2-9B and the Skywork 8B reward) on a v5e-8
    split 2 × 4, as the README plans it: whole (42 layers), Speculative Rejection starts
    GEMMA_V5E_8_ROWS rows in what the parameters leave of each chip; cut to 2 layers, every program
    fits, and a decode step all-reduces the `model` split's sums and all-gathers only the top-k
    candidates (values and ids) over `model`, never a cache. (Compiled whole, as the README's table
    is, the plan takes 5 minutes or more.)"""
    config = load_job_config("configs/speculative_rejection_gemma2_9b.yaml", ["mesh_model=4"])
    mesh = target_mesh(V5E_8, config.mesh_data, config.mesh_model)
    sampler, reward = job_sampler(config, mesh, None), job_reward_model(config, mesh, None)
    resident = bytes_per_device(sampler.params) + bytes_per_device(reward.params)
    batch = job_batch(config, sampler, job_budget(config, V5E_8, resident, sampler.slot_bytes), 128)
    assert (batch.prompts * batch.rows, dict(mesh.shape)) == (GEMMA_V5E_8_ROWS, {"data": 2, "model": 4})
    plan = plan_job(config, V5E_8, layers=2)
    assert plan.fits
    loop = plan.decode.program("decode_loop")
    assert loop.step_collectives["all-gather"] == 2 and loop.step_collectives["all-reduce"] > 0
    assert all(shape[3:].startswith("[4,50,") for shape in loop.gathered), loop.gathered
    assert plan.decode.program("compact").collectives["all-gather"] == 0


@needs_cuda_plan
@pytest.mark.slow
def test_a_llama_31_8b_sr_job_fits_eight_h100s_at_full_size():
    """A Llama-3.1-8B-Instruct Speculative Rejection job (the shipped config's settings, its own
    likelihood as reward) on 8 H100s split 4 × 2: it fits, starts LLAMA_H100_8_ROWS rows, and its
    token loops gather no cache."""
    overrides = ["model=meta-llama/Llama-3.1-8B-Instruct", "reward=self_likelihood"]
    plan = plan_job(load_job_config("configs/speculative_rejection_gemma2_9b.yaml", overrides), H100_8)
    assert plan.fits and plan.mesh == {"data": 4, "model": 2} and plan.rows == LLAMA_H100_8_ROWS
    loops = [p for p in plan.decode.programs if p.name.startswith("decode_loop")]
    assert len(loops) > 1  # a later rung's too
    for rung in loops:  # one all-gather a step: the 2 model shards' top-50 values and ids together
        assert rung.step_collectives["all-gather"] == 1 and ",50], s32[" in rung.gathered[0], rung.gathered


def test_plan_usage_errors_are_one_line(capsys):
    assert main(["plan", "configs/speculative_rejection_gemma2_9b.yaml", "--target", "h100-8"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("jaxsr: error: target: expected a name like")
    with pytest.raises(SystemExit) as e:
        main(["plan", "configs/speculative_rejection_gemma2_9b.yaml"])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err


def test_a_plan_of_what_cannot_run_is_refused_and_a_cut_never_adds_layers(monkeypatch):
    """No prompt of 0 tokens and no model of 0 layers is planned, before any model is read; `--layers
    50` plans a 2-layer model as it is (it planned 50 layers the model does not have)."""
    monkeypatch.setattr("jaxsr.plans.job.hf_config_of", lambda *_: pytest.fail("a model was read"))
    config = JobConfig(model="unused")
    for planning, named in [({"prompt_tokens": 0}, "prompt_tokens"), ({"layers": -1}, "layers")]:
        with pytest.raises(ValueError, match=f"^{named}: expected an int >= 1"):
            plan_job(config, V5E_8, **planning)
    assert cut(LLAMA_31_8B_2_LAYERS, 50)["num_hidden_layers"] == 2
    assert (
        cut(LLAMA_31_8B_2_LAYERS, 1)["num_hidden_layers"] == 1
        and cut(LLAMA_31_8B_2_LAYERS, None) is LLAMA_31_8B_2_LAYERS
    )


@needs_libtpu
def test_an_sr_plan_counts_each_rows_working_memory_and_starts_wider_with_int8_caches(tmp_path):
    """Derived from a v5e's memory, SR's first rung leaves each row its decode step's working memory
    (`memory.row_reserve`) beside its cache on every device; int8 caches start it wider."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B_2_LAYERS))
    job = JobConfig(
        method="speculative_rejection", model=str(tmp_path), reward="self_likelihood", dtype="bfloat16",
        mesh_data=-1, concurrent_prompts=1, max_new_tokens=512,
    )  # fmt: skip
    mesh, rows = target_mesh(V5E_8, 8, 1), {}
    for kv in (None, "int8"):
        sampler = job_sampler(dataclasses.replace(job, kv_dtype=kv), mesh, None)
        free = V5E_8.chip.usable_bytes - bytes_per_device(sampler.params)
        batch = first_rung(job, sampler, int(free * memory.DEVICE_HEADROOM) // sampler.slot_bytes, 128)
        per_device = batch.rows // 8
        work = memory.row_reserve(sampler, True) * sampler.slot_bytes
        assert work >= 6 * 4 * LLAMA_31_8B_2_LAYERS["vocab_size"]
        used = (128 + per_device * batch.segment) * sampler.slot_bytes + per_device * work
        assert used <= free * memory.DEVICE_HEADROOM, kv  # caches and working memory fit each device
        rows[kv] = batch.rows
    assert rows["int8"] > rows[None]


@pytest.mark.slow  # compiles a 2-layer Llama-3.1-8B-wide SR plan of 512 rows for a v5e-8 (libtpu)
@needs_libtpu
def test_a_decisions_compaction_on_data_shards_gathers_no_cache():
    """Speculative Rejection's first decision on a v5e-8 (rows over 8 data shards): one prompt's 512
    rows gathered to 256 moves survivors between shards by collective-permutes of one shard's part,
    never an all-gather (or an all-reduce) of a cache; its temporaries stay below one prompt's caches."""
    model = abstract_model(LLAMA_31_8B_2_LAYERS, target_mesh(V5E_8, data=8, model=1))
    batch = Batch(prompts=1, rows=512, prompt_slots=128, max_new_tokens=512, next_rows=256, next_segment=512)
    plan = plan_batch(model, V5E_8, batch)
    step = plan.program("compact")
    assert step.collectives["all-gather"] == 0 and step.collectives["collective-permute"] > 0
    # XLA's partition of a plain gather held the whole compacted cache: 4× the rows' caches a device
    assert step.temp_bytes < plan.row_cache_bytes
    assert step.argument_bytes > plan.row_cache_bytes  # the caches are its input
