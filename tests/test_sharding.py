"""Decoding on a mesh of 8 fake CPU devices: rows split over `data`, results independent of the mesh."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import jaxsr
from jaxsr.decoding import state as decode_state
from jaxsr.decoding.driver import Layout, as_sampler
from jaxsr.decoding.inputs import Request
from jaxsr.rewards import SelfLikelihood
from jaxsr.sharding import RING_GROUPS, gather_rows, make_mesh, send_groups, shard_model

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13]]
MESHES = [(8, 1), (4, 2), (2, 4)]
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=1, eos_token_ids=(3,))


def tokens_of(results):
    return [[s.token_ids for s in r.samples] for r in results]


@pytest.mark.slow  # compiles generate on one device and on each of 3 meshes of 8 fake CPUs
@pytest.mark.parametrize("data,model", MESHES)
def test_generate_is_the_same_on_any_mesh(lm, data, model):
    kwargs = dict(max_new_tokens=12, num_samples=8, sampling=SAMPLING, seed=3)
    reference = jaxsr.generate(lm, PROMPTS, **kwargs)
    sharded = jaxsr.generate(shard_model(lm, make_mesh(data=data, model=model)), PROMPTS, **kwargs)
    assert tokens_of(sharded) == tokens_of(reference)
    for r, s in zip(reference, sharded, strict=True):
        assert [x.finished for x in s.samples] == [x.finished for x in r.samples]
        # sums of 12 f32 log-probabilities of O(1) computed with another partitioning of every matmul:
        # measured within 1.2e-5 on AVX2, AVX and SSE4.2
        np.testing.assert_allclose([x.logprob for x in s.samples], [x.logprob for x in r.samples], atol=1e-4)


def _new_rows(model, prompts: int, samples: int, max_new_tokens: int):
    """Every row alive: `samples` of each of `prompts` prompts, seed 0."""
    request = Request((), [], max_new_tokens, SAMPLING, 0, (), tuple(range(prompts)))
    return Layout(tuple(range(prompts)), prompts, samples, samples).new_rows(model, request)


def _decode_on_mesh(lm, prompts: int, samples: int, capacity: int = 32):
    """init_state + decode_loop on a (4, 2) mesh; returns the prompt cache, final state and the HLO of
    the compiled decode loop."""
    sharded = shard_model(lm, make_mesh(data=4, model=2))
    decoder = as_sampler(sharded, SAMPLING)
    tokens = jnp.ones((prompts, 8), jnp.int32)
    with decoder.on_mesh():
        prefilled = decoder.prefill(tokens, jnp.ones_like(tokens))
        new = _new_rows(sharded, prompts, samples, capacity)
        state = decoder.init_state(prefilled, new, capacity=capacity)
        hlo = decoder.compiled_loop(state, prefilled[1]).as_text()
        state = decoder.decode_loop(state, prefilled[1], None)
    return prefilled[1][0], state, hlo


@pytest.mark.slow  # compiles prefill and the decode loop twice on a (4, 2) mesh of fake CPUs
def test_rows_and_their_caches_are_split_over_data(lm):
    cache, state, _ = _decode_on_mesh(lm, prompts=4, samples=2)
    assert state.tokens.sharding.spec[0] == "data"
    assert state.done.sharding.spec[0] == "data"
    assert tuple(state.rows[0].k[0].sharding.spec)[:2] == ("data", "model")  # rows, KV heads
    assert tuple(state.rows[0].v[0].sharding.spec)[:2] == ("data", "model")
    assert tuple(cache.k[0].sharding.spec)[:2] == ("data", "model")  # 4 prompts over data=4
    # one prompt shared by all rows: its cache is replicated over data, rows still split
    one_prompt, state, _ = _decode_on_mesh(lm, prompts=1, samples=8)
    assert tuple(one_prompt.k[0].sharding.spec)[:2] == (None, "model")
    assert tuple(state.rows[0].k[0].sharding.spec)[:2] == ("data", "model")


COLLECTIVES = r"(?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"


def _gathered_elements(hlo: str) -> list[int]:
    """Element counts of the results of every collective in compiled HLO text (tuple results count
    each member)."""
    sizes = []
    for result in re.findall(rf"= (\(?[^=]*?\)?) {COLLECTIVES}(?:-start)?\(", hlo):
        for dims in re.findall(r"\w+\[([\d,]*)\]", result):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


@pytest.mark.slow  # compiles the decode loop and a compaction on a (4, 2) mesh, reads their HLO
def test_the_decode_loop_never_moves_a_cache_and_compaction_only_the_survivors(lm):
    _, state, hlo = _decode_on_mesh(lm, prompts=1, samples=8, capacity=64)
    row_cache_layer = state.rows[0].k[0].size
    gathered = _gathered_elements(hlo)
    assert gathered, "the positive control: the loop moves small per-row arrays and partial sums"
    assert max(gathered) < row_cache_layer // 8
    with jax.set_mesh(state.rows[0].k[0].sharding.mesh):
        index, alive = jnp.array([1, 3, 5, 7], jnp.int32), jnp.ones((4,), bool)
        hlo = decode_state.compact.lower(state, index, alive, cache_capacity=64).compile().as_text()
        compacted = decode_state.compact(state, index, alive, cache_capacity=64)
    # survivors move between shards one shard of the result at a time (`sharding.gather_rows`): no
    # collective assembles the compacted cache, let alone the current one (a plain gather's partition
    # summed the whole result over the devices)
    shards = 4 * 2
    moved = max(_gathered_elements(hlo))
    assert moved <= compacted.rows[0].k[0].size // shards
    assert "collective-permute" in hlo
    assert tuple(compacted.rows[0].k[0].sharding.spec)[:2] == ("data", "model")
    np.testing.assert_array_equal(compacted.tokens, np.asarray(state.tokens)[[1, 3, 5, 7]])
    kept, before = compacted.rows[0], state.rows[0]
    for old, new in zip(before.k + before.v, kept.k + kept.v, strict=True):
        np.testing.assert_array_equal(new, np.asarray(old)[[1, 3, 5, 7]])


def test_pair_compaction_moves_only_the_survivors(lm, draft):
    mesh = make_mesh(data=4, model=2)
    decoder = jaxsr.speculative_decoder(shard_model(lm, mesh), shard_model(draft, mesh), gamma=2)
    decoder = decoder.with_sampling(SAMPLING)
    tokens = jnp.ones((1, 8), jnp.int32)
    with decoder.on_mesh():
        prefilled = decoder.prefill(tokens, jnp.ones_like(tokens))
        new = _new_rows(lm, 1, 8, 64)
        state = decoder.init_state(prefilled, new, capacity=64, cache_capacity=64 + decoder.headroom)
        index, alive = jnp.array([0, 2, 4, 6], jnp.int32), jnp.ones((4,), bool)
        hlo = decode_state.compact.lower(state, index, alive, cache_capacity=32).compile().as_text()
        compacted = decoder.compact(state, index, alive, 32)
    moved = max(_gathered_elements(hlo))  # one shard of the compacted rows at most, as above
    assert moved <= max(r.k[0].size for r in compacted.rows) // (4 * 2)
    assert tuple(compacted.rows[1].k[0].sharding.spec)[:2] == ("data", "model")
    assert compacted.tokens.sharding.spec[0] == "data"


def test_meshes_jaxsr_cannot_pin_rows_on_are_refused(lm):
    devices = np.array(jax.devices()).reshape(4, 2)
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="mesh: expected automatic axes"):
        shard_model(lm, explicit)
    with pytest.raises(ValueError, match="mesh: expected axes named"):
        shard_model(lm, jax.sharding.Mesh(devices, ("x", "y")))


@pytest.mark.slow  # compiles Best-of-N and SR on one device and on a (4, 2) mesh of fake CPUs
def test_best_of_n_and_speculative_rejection_are_the_same_on_a_mesh(lm):
    sharded = shard_model(lm, make_mesh(data=4, model=2))
    reward = SelfLikelihood()
    for search, options in [
        (jaxsr.best_of_n, dict(n=8)),
        (
            jaxsr.speculative_rejection,
            dict(n=8, rejection_rate=0.5, memory_budget=16 + 8 * 8, min_first_segment=8),
        ),
    ]:
        kwargs = dict(max_new_tokens=24, seed=5, **options)
        reference = search(lm, reward, PROMPTS[:2], **kwargs)
        on_mesh_results = search(sharded, reward, PROMPTS[:2], **kwargs)
        assert tokens_of(on_mesh_results) == tokens_of(reference)
        assert [r.best.token_ids for r in on_mesh_results] == [r.best.token_ids for r in reference]
        if search is jaxsr.speculative_rejection:
            assert len(reference[0].stats["batch_sizes"]) > 1  # it did reject and compact
            assert [r.stats["batch_sizes"] for r in on_mesh_results] == [
                r.stats["batch_sizes"] for r in reference
            ]


@pytest.mark.slow  # compiles SCD on one device and on a (4, 2) mesh of fake CPUs
def test_speculative_contrastive_decoding_is_the_same_on_a_mesh(lm, draft):
    mesh = make_mesh(data=4, model=2)
    kwargs = dict(gamma=3, max_new_tokens=12, num_samples=4, sampling=SAMPLING, seed=2)
    reference = jaxsr.speculative_contrastive_decode(lm, draft, PROMPTS, **kwargs)
    sharded = jaxsr.speculative_contrastive_decode(
        shard_model(lm, mesh), shard_model(draft, mesh), PROMPTS, **kwargs
    )
    assert tokens_of(sharded) == tokens_of(reference)


def test_models_on_different_meshes_are_refused(lm, draft):
    devices = jax.devices()
    first = shard_model(lm, make_mesh(data=4, devices=devices[:4]))
    second = shard_model(draft, make_mesh(data=4, devices=devices[4:]))
    with pytest.raises(ValueError, match="mesh"):
        jaxsr.speculative_decode(first, second, PROMPTS, max_new_tokens=4)


def test_shard_model_places_parameters_by_the_rules_table(lm):
    sharded = shard_model(lm, make_mesh(data=4, model=2))
    block = sharded.params["blocks"][0]
    assert tuple(block["attn"]["q"][...].sharding.spec) == (None, "model", None)
    assert tuple(block["mlp"]["down"][...].sharding.spec) == ("model", None)
    assert sharded.mesh is not None and lm.mesh is None  # a copy; the original stays where it was
    with pytest.raises(TypeError, match="mesh"):
        shard_model(lm, "data")


class FakeAccelerator:
    """Reports memory like a GPU/TPU does (CPU devices report none)."""

    def __init__(self, free: int):
        self.free = free

    def memory_stats(self):
        return {"bytes_limit": self.free + 100, "bytes_in_use": 100}


def test_a_derived_memory_budget_is_the_fullest_mesh_device(monkeypatch):
    from jaxsr.decoding import memory

    mesh = make_mesh(data=4, model=2, devices=jax.devices()[::-1])  # its fullest device is not device 0
    fake = {d: FakeAccelerator(1000 + 100 * d.id) for d in jax.devices()}
    monkeypatch.setattr(memory, "device_free_bytes", lambda devices: min(fake[d].free for d in devices))
    assert memory.budget_slots(None, slot_bytes=10) == int(1000 * memory.DEVICE_HEADROOM) // 10
    on_mesh_devices = memory.budget_slots(None, slot_bytes=10, mesh=mesh)
    assert on_mesh_devices == int(1000 * memory.DEVICE_HEADROOM) // 10  # device 0 is in the mesh too
    half = make_mesh(data=4, devices=jax.devices()[4:])
    assert memory.budget_slots(None, slot_bytes=10, mesh=half) == int(1400 * memory.DEVICE_HEADROOM) // 10


def test_a_derived_search_budget_is_shared_by_the_prompts_in_flight(lm, monkeypatch):
    """Derived from the device, a prompt's budget is the fullest device's free slots split among the
    prompts in flight (with `n` given or not), then counted over the `data` shards (`mesh_budget`),
    each row's working memory beside its cache counted (`row_reserve`)."""
    from jaxsr.decoding import memory
    from jaxsr.search import memory as search_memory

    sampler = as_sampler(shard_model(lm, make_mesh(data=4, model=2)), SAMPLING)
    monkeypatch.setattr(memory, "device_free_bytes", lambda devices: 10**6)
    one_device = int(10**6 * memory.DEVICE_HEADROOM) // sampler.slot_bytes
    # 6 float32 rows of the device's half of the vocabulary (split over model=2), in slots
    work = -(-6 * 4 * (lm.config.vocab_size // 2) // sampler.slot_bytes)
    assert memory.row_reserve(sampler, True) == work and memory.row_reserve(sampler, False) == 0
    row = 32 + work
    alone = search_memory.prompt_budget(sampler, None, 16, 32, None, copies=1)
    assert alone == 16 + 4 * (one_device - 16 - row)
    half = one_device // 2
    assert search_memory.prompt_budget(sampler, None, 16, 32, 8, copies=2) == 16 + 4 * (half - 16 - row)
    assert search_memory.prompt_budget(sampler, 4096, 16, 32, None, copies=2) == 4096  # as given
    assert search_memory.mesh_budget(85, 16, 64, shards=8) == 85  # one device's share when it is more


@pytest.mark.slow  # runs SR 3 times, on one device and over data=8 fake CPUs
def test_a_derived_search_budget_counts_the_data_shards_and_fits_on_each_device(lm, monkeypatch):
    """80 free slots a device: alone (a budget of 80 KV slots) SR starts 4 rows; derived on 8 `data`
    shards 15 (2 a device: each row's working memory counted beside its cache), and no round puts more
    than 80 slots on a device (prompt cache on each, rows split and their working memory, mesh padding
    counted). The search is the one a single device runs with the same budget."""
    from jaxsr.decoding import memory
    from jaxsr.rewards import SelfLikelihood

    sharded = shard_model(lm, make_mesh(data=8))
    slot_bytes = lm.kv_slot_bytes
    free = {"slots": 80.5}
    monkeypatch.setattr(
        memory, "device_free_bytes", lambda devices: int(free["slots"] * slot_bytes / memory.DEVICE_HEADROOM)
    )
    kwargs = dict(rejection_rate=0.5, max_new_tokens=16, sampling=SAMPLING, seed=2, min_first_segment=16)
    prompt = [[3, 1, 4, 1, 5, 9]]
    alone = jaxsr.speculative_rejection(lm, SelfLikelihood(), prompt, memory_budget=80, **kwargs)[0]
    assert alone.stats["initial_batch"] == 4
    wide = jaxsr.speculative_rejection(sharded, SelfLikelihood(), prompt, **kwargs)[0]
    work = memory.row_reserve(as_sampler(sharded, SAMPLING), True)  # 6 slots a row for this model
    assert wide.stats["memory_budget_slots"] == 16 + 8 * (80 - 16 - 16 - work)
    assert wide.stats["initial_batch"] == 15  # (80 - 16 - 16 - 6) × 8 slots for rows of 16 + 6
    for round_ in wide.stats["round_log"]:
        rows, slots = round_["batch_size"], round_["kv_bytes"] // slot_bytes - 16
        # one device: its prompt cache, its rows' caches and their working memory
        assert rows % 8 == 0 and 16 + slots // 8 + rows // 8 * work <= 80, round_
    free["slots"] = wide.stats["memory_budget_slots"] + 0.5  # one device with that derived budget
    same = jaxsr.speculative_rejection(lm, SelfLikelihood(), prompt, **kwargs)[0]
    assert same.stats["memory_budget_slots"] == wide.stats["memory_budget_slots"]
    assert [s.token_ids for s in wide.samples] == [s.token_ids for s in same.samples]
    assert wide.best.index == same.best.index


@pytest.mark.slow  # compiles Best-of-N at 128 rows over data=8 and at 64 rows on one device
def test_best_of_n_decodes_as_many_rows_as_the_data_shards_hold(lm):
    """On 8 `data` shards a call decodes 64 rows a shard, not 64 in all: 16 prompts × 8 samples in one
    batch (a job's call takes a whole length class). Same tokens as one device with 64 rows."""
    from jaxsr.decoding.driver import default_rows
    from jaxsr.jobs.config import JobConfig
    from jaxsr.jobs.methods import prompts_per_call
    from jaxsr.rewards import SelfLikelihood

    sharded = shard_model(lm, make_mesh(data=8))
    assert default_rows(as_sampler(sharded, SAMPLING)) == 512
    job = JobConfig(method="best_of_n", reward="self_likelihood", n=8, mesh_data=-1)
    assert prompts_per_call(job) is None and prompts_per_call(JobConfig(max_rows=32, num_samples=4)) is None
    prompts = [[1 + (i * 7 + j) % 50 for j in range(5)] for i in range(16)]
    kwargs = dict(n=8, max_new_tokens=6, sampling=SAMPLING, seed=1)
    wide = jaxsr.best_of_n(sharded, SelfLikelihood(), prompts, **kwargs)
    assert {r.stats["batch_rows"] for r in wide} == {128}
    narrow = jaxsr.best_of_n(lm, SelfLikelihood(), prompts, **kwargs)
    assert {r.stats["batch_rows"] for r in narrow} == {64}
    assert [[s.token_ids for s in r.samples] for r in wide] == [
        [s.token_ids for s in r.samples] for r in narrow
    ]


@pytest.mark.slow  # compiles Best-of-N at 128 and 64 rows and generate at 128
def test_max_rows_above_the_default_is_what_a_call_decodes(lm):
    """On CPU without a budget, a `max_rows` above the default 64 is taken as given (it caps only a
    budget's rows): Best-of-N and plain decoding decode 128 rows, with the same samples as at 64."""
    prompts = [[1 + (i * 7 + j) % 50 for j in range(5)] for i in range(16)]
    kwargs = dict(max_new_tokens=6, sampling=SAMPLING, seed=1)
    wide = jaxsr.best_of_n(lm, SelfLikelihood(), prompts, n=8, max_rows=128, **kwargs)
    narrow = jaxsr.best_of_n(lm, SelfLikelihood(), prompts, n=8, **kwargs)
    assert {r.stats["batch_rows"] for r in wide} == {128} and {r.stats["batch_rows"] for r in narrow} == {64}
    assert tokens_of(wide) == tokens_of(narrow)
    assert [r.best.index for r in wide] == [r.best.index for r in narrow]
    decoded = jaxsr.generate(lm, prompts, num_samples=8, max_rows=128, **kwargs)
    assert {r.stats["batch_rows"] for r in decoded} == {128} and tokens_of(decoded) == tokens_of(narrow)


# (data shards, prompt caches and rows one device holds, rows the plan compiles, rows a call decodes)
HELD = [(1, (4, 32), 32, 32), (1, (64, 512), 512, 128), (8, (4, 4), 32, 32)]


@pytest.mark.slow  # per case: compiles Best-of-N at 64 and at its planned rows, one device or data=8
@pytest.mark.parametrize(("data", "held", "planned", "rows"), HELD)
def test_best_of_n_without_a_budget_takes_what_a_device_holds(lm, monkeypatch, data, held, planned, rows):
    """No `memory_budget`, on devices that report their free memory: a Best-of-N call decodes the rows
    `jaxsr plan` picks there (90% of the fullest device, each row's working memory counted, prompt
    slots to the prompts' own bucket, every `data` shard counted; a call takes at most its 16 prompts'
    128), not the CPU's 64, with the same samples and choices."""
    from jaxsr.decoding import memory
    from jaxsr.jobs.config import JobConfig
    from jaxsr.ladder import bucket
    from jaxsr.plans.job import job_batch

    prompts = [[1 + (i * 7 + j) % 50 for j in range(5)] for i in range(16)]
    kwargs = dict(n=8, max_new_tokens=6, sampling=SAMPLING, seed=1)
    cpu = jaxsr.best_of_n(lm, SelfLikelihood(), prompts, **kwargs)
    model = lm if data == 1 else shard_model(lm, make_mesh(data=data))
    sampler = as_sampler(model, SAMPLING)
    slots = held[0] * bucket(5) + held[1] * (bucket(6) + memory.row_reserve(sampler, True))
    free = int((slots + 0.5) * sampler.slot_bytes / memory.DEVICE_HEADROOM)
    monkeypatch.setattr(memory, "device_free_bytes", lambda devices: free)
    job = dict(method="best_of_n", reward="self_likelihood", n=8, max_new_tokens=6, mesh_data=data)
    batch = job_batch(JobConfig(**job), sampler, slots, bucket(5))
    assert batch.prompts * batch.rows == planned
    capped = job_batch(JobConfig(**job, max_rows=16), sampler, slots, bucket(5))
    assert capped.prompts * capped.rows == 16  # as a call caps its rows
    wide = jaxsr.best_of_n(model, SelfLikelihood(), prompts, **kwargs)
    assert {r.stats["batch_rows"] for r in wide} == {rows}
    assert {r.stats["batch_rows"] for r in cpu} == {64}
    assert [[s.token_ids for s in r.samples] for r in wide] == [[s.token_ids for s in r.samples] for r in cpu]
    assert [r.best.index for r in wide] == [r.best.index for r in cpu]


# (data shards, prompt caches and rows one device holds, rows the plan compiles, rows a call decodes)
GENERATE_HELD = [(1, (4, 8), 8, 8), (1, (64, 128), 128, 32), (8, (8, 8), 16, 16)]


@pytest.mark.slow  # per case: compiles generate at 3 row counts, one device or data=8
@pytest.mark.parametrize(("data", "held", "planned", "rows"), GENERATE_HELD)
def test_generate_without_max_rows_takes_what_a_device_holds(lm, monkeypatch, data, held, planned, rows):
    """No `max_rows`, on devices that report their free memory: plain decoding (and so every decoding
    and pair-method job) decodes the rows `jaxsr plan` picks there, sized as Best-of-N's (on 8 shards
    more than one device holds), not the CPU's 64 a shard; `max_rows` caps it; same tokens."""
    from jaxsr.decoding import memory
    from jaxsr.jobs.config import JobConfig
    from jaxsr.ladder import bucket
    from jaxsr.plans.job import job_batch

    prompts = [[1 + (i * 7 + j) % 50 for j in range(5)] for i in range(16)]
    kwargs = dict(num_samples=2, max_new_tokens=6, sampling=SAMPLING, seed=1)
    cpu = jaxsr.generate(lm, prompts, **kwargs)
    model = lm if data == 1 else shard_model(lm, make_mesh(data=data))
    sampler = as_sampler(model, SAMPLING)
    slots = held[0] * bucket(5) + held[1] * (bucket(6) + memory.row_reserve(sampler, True))
    free = int((slots + 0.5) * sampler.slot_bytes / memory.DEVICE_HEADROOM)
    monkeypatch.setattr(memory, "device_free_bytes", lambda devices: free)
    job = dict(method="generate", num_samples=2, max_new_tokens=6, mesh_data=data)
    batch = job_batch(JobConfig(**job), sampler, slots, bucket(5))
    assert batch.prompts * batch.rows == planned
    cap = 4 if data == 1 else 8  # 8 shards pad fewer rows to 8
    capped = job_batch(JobConfig(**job, max_rows=cap), sampler, slots, bucket(5))
    assert capped.prompts * capped.rows == cap
    wide = jaxsr.generate(model, prompts, **kwargs)
    assert {r.stats["batch_rows"] for r in wide} == {rows}
    assert {r.stats["batch_rows"] for r in cpu} == {32}
    assert tokens_of(wide) == tokens_of(cpu)
    narrow = jaxsr.generate(model, prompts, max_rows=cap, **kwargs)
    assert {r.stats["batch_rows"] for r in narrow} == {cap} and tokens_of(narrow) == tokens_of(cpu)


def test_best_of_n_rows_count_the_data_shards_and_fit_on_each():
    """The slab a call lays out from `rows_within`'s rows (G = min(n, rows) a slot, rows // G slots)
    puts on each of `shards` devices every slot's prompt cache and 1/shards of the padded rows: that
    fits the slots, and more shards never give fewer rows; one shard is one pool of slots, as before."""
    from jaxsr.decoding import memory
    from jaxsr.sharding import padded_over

    floor = lambda x: 1 << x.bit_length() - 1
    cases = itertools.product([300, 1000, 5000], [8, 64], [7, 40], [3, 8])
    for slots, prompt, row, n in ((s, p, r, n) for s, p, r, n in cases if s >= p + r):
        by_shards = {}
        for shards in (1, 2, 8):
            rows = by_shards[shards] = memory.rows_within(slots, prompt, row, n, shards)
            samples = min(n, rows)
            prompts = floor(rows // samples)
            on_device = prompts * prompt + prompts * padded_over(samples, shards, prompts) // shards * row
            assert on_device <= slots, (slots, prompt, row, n, shards)
        most = floor((slots - prompt) // row)
        one_pool = min(most, min(n, most) * floor(max(1, slots // (prompt + min(n, most) * row))))
        case = (slots, prompt, row, n)
        assert by_shards[1] == one_pool and by_shards[1] <= by_shards[2] <= by_shards[8], case
    assert memory.rows_within(4 * 8 + 4 * 40, 8, 40, 8, shards=8) == 32  # 4 prompts' 8 rows, 4 a device
    assert memory.rows_within(4 * 8 + 4 * 40, 8, 40, 8) == 4  # one pool: 4 of a prompt's rows


def test_device_free_bytes_is_none_where_the_backend_reports_nothing():
    from jaxsr.decoding.memory import device_free_bytes

    assert device_free_bytes(jax.devices()[:2]) is None  # CPU
    assert device_free_bytes([FakeAccelerator(500), FakeAccelerator(300)]) == 300


def test_logits_and_reward_scores_split_their_batch_over_data(lm):
    from flax import nnx
    from tiny import tiny_config

    from jaxsr.models.decoder import Decoder

    rm = jaxsr.RewardModel.from_module(Decoder(tiny_config(num_labels=1), rngs=nnx.Rngs(0)))
    tokens = (np.arange(32).reshape(8, 4) * 7) % 60
    mesh = make_mesh(data=4, model=2)
    scores = shard_model(rm, mesh).scores(tokens)
    # another partitioning of the same f32 computation: rounding only (measured ≤ 1.5e-8 on these small
    # scores, ≤ 1.5e-6 on logits of O(10), on AVX2, AVX and SSE4.2)
    np.testing.assert_allclose(scores, rm.scores(tokens), rtol=1e-5, atol=1e-6)
    assert scores.sharding.spec[0] == "data"
    logits = shard_model(lm, mesh).logits(tokens)
    np.testing.assert_allclose(logits, lm.logits(tokens), rtol=1e-5, atol=1e-5)
    assert logits.sharding.spec[0] == "data"


@pytest.mark.slow  # compiles generate and SR unpadded and padded over data=8 fake CPUs
def test_batches_are_padded_with_dead_rows_to_split_over_data(lm):
    """5 samples of 3 (→ 4) prompts are 20 rows: padded to 6 per prompt, 24 rows over data=8. An SR
    rung of 10 rows becomes 16. The samples, and SR's choices, are those of the unpadded run."""
    sharded = shard_model(lm, make_mesh(data=8))
    kwargs = dict(max_new_tokens=8, num_samples=5, sampling=SAMPLING, seed=1)
    reference, padded = jaxsr.generate(lm, PROMPTS, **kwargs), jaxsr.generate(sharded, PROMPTS, **kwargs)
    assert tokens_of(padded) == tokens_of(reference)
    assert (reference[0].stats["batch_rows"], padded[0].stats["batch_rows"]) == (20, 24)

    kwargs = dict(n=10, rejection_rate=0.5, max_new_tokens=40, memory_budget=16 + 10 * 16, seed=4)
    reference = jaxsr.speculative_rejection(lm, SelfLikelihood(), PROMPTS[:1], **kwargs)[0]
    padded = jaxsr.speculative_rejection(sharded, SelfLikelihood(), PROMPTS[:1], **kwargs)[0]
    assert tokens_of([padded]) == tokens_of([reference]) and padded.best.token_ids == reference.best.token_ids
    assert padded.stats["batch_sizes"] == reference.stats["batch_sizes"]  # live rows
    logical = [x["batch_size"] for x in reference.stats["round_log"]]
    physical = [x["batch_size"] for x in padded.stats["round_log"]]
    assert logical[0] == 10 and len(logical) > 1
    assert physical == [-(-b // 8) * 8 for b in logical]


def test_rows_are_sent_in_a_few_groups_of_similar_bytes():
    """A 42-layer cache's 85 arrays go in 8 groups (a barrier each per shift), in order, none larger
    than an eighth of the bytes unless one array is."""
    arrays = [jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)] * 84 + [jax.ShapeDtypeStruct((4,), jnp.int32)]
    groups = send_groups(arrays, RING_GROUPS)
    assert [i for g in groups for i in g] == list(range(85)) and len(groups) <= RING_GROUPS + 1
    share = sum(a.size * a.dtype.itemsize for a in arrays) / RING_GROUPS
    assert all(sum(arrays[i].size * arrays[i].dtype.itemsize for i in g) <= share for g in groups)
    big = [jax.ShapeDtypeStruct((100_000,), jnp.float32), *arrays[:3]]
    assert send_groups(big, RING_GROUPS) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("data,model", [(8, 1), (4, 2)])
def test_gathering_rows_shard_by_shard_is_a_plain_gather(data, model):
    """`gather_rows` on split rows equals `take` on one device, whatever shards the survivors come from
    (all from one shard, repeated, reordered), for results smaller and larger than the input."""
    mesh = make_mesh(data=data, model=model)
    rng = np.random.default_rng(0)
    tree = {"k": rng.normal(size=(16, 4, 6)).astype(np.float32), "n": np.arange(16, dtype=np.int32)}
    placed = {
        "k": jax.device_put(
            tree["k"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
        ),
        "n": jax.device_put(tree["n"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))),
    }
    take = lambda t, i: jax.tree.map(lambda x: x[i], t)
    gather = jax.jit(lambda t, i: gather_rows(t, i, take))
    for index in ([0, 1, 0, 1, 0, 1, 0, 1], [15] * 8, rng.permutation(16), rng.integers(0, 16, 32)):
        index = np.asarray(index, np.int32)
        with jax.set_mesh(mesh):
            got = gather(placed, jnp.asarray(index))
        np.testing.assert_array_equal(got["k"], tree["k"][index])
        np.testing.assert_array_equal(got["n"], tree["n"][index])
        assert got["k"].sharding.spec[0] == "data"
