"""The orbax cache of converted parameters: hits, exactness, damaged entries, location, invalidation
(an entry never serves a config other than its source's).

Tiny safetensors checkpoints stand in for large ones (the size threshold is lowered to 0); SmolLM2
covers the GGUF path end to end, tokenizer included. Every test writes under tmp_path only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hf_fixtures as H
import jax
import numpy as np
import pytest

import jaxsr
from jaxsr.loading import api, param_cache
from jaxsr.loading.gguf import smollm2_path
from jaxsr.sharding import make_mesh


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(directory))
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    return directory


@pytest.fixture
def checkpoint(tmp_path, tmp_path_factory) -> Path:
    """A private copy of a tiny llama checkpoint (tests touch its files)."""
    source = H.checkpoint("llama2", tmp_path_factory)[0]
    return H.copy_checkpoint(source, tmp_path / "llama2")


def entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if not p.name.startswith(".")) if cache_dir.exists() else []


def forbid_conversion(monkeypatch) -> None:
    """Make any load that does not come from the cache fail."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was converted again instead of read from the cache")

    monkeypatch.setattr(api, "convert_hf_tensors", refuse)
    monkeypatch.setattr(api, "_read_checkpoint", refuse)


def assert_same_params(a: jaxsr.Model, b: jaxsr.Model) -> None:
    flat_a = dict(jax.tree_util.tree_leaves_with_path(a.params))
    flat_b = dict(jax.tree_util.tree_leaves_with_path(b.params))
    assert flat_a.keys() == flat_b.keys()
    for path, x in flat_a.items():
        y = flat_b[path]
        assert x.dtype == y.dtype and x.sharding == y.sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_second_load_hits_the_cache_and_is_exact(cache_dir, checkpoint, monkeypatch):
    reference = jaxsr.load_model(checkpoint, cache=False)
    assert entries(cache_dir) == []
    first = jaxsr.load_model(checkpoint)
    assert len(entries(cache_dir)) == 1
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp")]
    forbid_conversion(monkeypatch)
    second = jaxsr.load_model(checkpoint)
    assert_same_params(first, second)
    assert_same_params(reference, second)
    assert second.config == reference.config and second.eos_token_ids == reference.eos_token_ids
    tokens, mask = H.left_padded_batch()
    np.testing.assert_array_equal(
        np.asarray(second.logits(tokens, mask)), np.asarray(reference.logits(tokens, mask))
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_entry_serves_every_dtype(cache_dir, checkpoint, monkeypatch, dtype):
    jaxsr.load_model(checkpoint, dtype="float32")
    reference = jaxsr.load_model(checkpoint, dtype=dtype, cache=False)
    forbid_conversion(monkeypatch)
    cached = jaxsr.load_model(checkpoint, dtype=dtype)
    assert cached.dtype == np.dtype(dtype)
    assert_same_params(reference, cached)


def test_cached_restore_lands_on_the_mesh_shards(cache_dir, checkpoint, monkeypatch):
    mesh = make_mesh(data=2, model=4)
    jaxsr.load_model(checkpoint)
    reference = jaxsr.load_model(checkpoint, mesh=mesh, cache=False)
    forbid_conversion(monkeypatch)
    cached = jaxsr.load_model(checkpoint, mesh=mesh)
    assert_same_params(reference, cached)  # same values and the same shardings
    assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(cached.params))


def _delete_meta(entry: Path) -> None:
    (entry / "meta.json").unlink()


def _garble_meta(entry: Path) -> None:
    (entry / "meta.json").write_text("{not json")


def _wrong_shapes(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["arrays"]["embed"]["shape"][0] += 1
    (entry / "meta.json").write_text(json.dumps(meta))


def _bad_eos(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["hf_config"]["eos_token_id"] = 10**6  # outside the vocabulary: the stored config, not the source
    (entry / "meta.json").write_text(json.dumps(meta))


def _not_a_decoder(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["hf_config"]["num_attention_heads"] = "four"
    (entry / "meta.json").write_text(json.dumps(meta))


def _truncate_metadata(entry: Path) -> None:
    for f in (entry / "params").rglob("*METADATA*"):
        f.write_bytes(f.read_bytes()[:100])


def _truncate_data(entry: Path) -> None:
    data = [f for f in (entry / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for f in data:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_arrays(entry: Path) -> None:
    for f in (entry / "params").rglob("*"):
        if f.is_file() and "METADATA" not in f.name:
            f.unlink()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop, on failure
@pytest.mark.parametrize(
    "damage",
    [
        _delete_meta, _garble_meta, _wrong_shapes, _bad_eos, _not_a_decoder,
        _truncate_metadata, _truncate_data, _drop_arrays,
    ],
)  # fmt: skip
def test_damaged_entry_is_ignored_and_rebuilt(cache_dir, checkpoint, monkeypatch, damage):
    reference = jaxsr.load_model(checkpoint, cache=False)
    jaxsr.load_model(checkpoint)
    (entry,) = entries(cache_dir)
    damage(entry)
    with pytest.warns(UserWarning, match="rebuilding the parameter cache"):
        rebuilt = jaxsr.load_model(checkpoint)
    assert_same_params(reference, rebuilt)
    assert entries(cache_dir) == [entry]
    forbid_conversion(monkeypatch)
    assert_same_params(reference, jaxsr.load_model(checkpoint))  # the rebuilt entry is good


def test_abandoned_temporary_directory_is_ignored_and_removed(cache_dir, checkpoint, monkeypatch):
    """A writer killed mid-way leaves only a .tmp-<host>-<pid>-… directory, never a readable entry."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = cache_dir / f"{param_cache._tmp_prefix()}{dead.pid}-deadbeef"
    (abandoned / "params").mkdir(parents=True)
    (abandoned / "meta.json").write_text("{}")
    live = cache_dir / f"{param_cache._tmp_prefix()}{os.getpid()}-cafecafe"  # another writer, still working
    live.mkdir()
    jaxsr.load_model(checkpoint)
    assert not abandoned.exists() and live.exists()
    assert len(entries(cache_dir)) == 1


def test_failed_write_leaves_nothing_and_still_loads(cache_dir, checkpoint, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(param_cache.ocp.Checkpointer, "save", full_disk)
    with pytest.warns(UserWarning, match="No space left"):
        model = jaxsr.load_model(checkpoint)
    assert model.config.model_type == "llama"
    assert list(cache_dir.iterdir()) == []


def test_cache_dir_env_var_is_honoured(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(elsewhere))
    assert param_cache.cache_root() == elsewhere
    jaxsr.load_model(checkpoint)
    assert len(entries(elsewhere)) == 1
    assert str(elsewhere) in str(param_cache.entry_path(checkpoint))


@pytest.mark.parametrize("setting", ["off", "OFF", "0", "false"])
def test_env_var_switches_the_cache_off(tmp_path, checkpoint, monkeypatch, setting):
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    monkeypatch.setenv("JAXSR_CACHE_DIR", setting)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # would catch a write to the default location
    assert param_cache.cache_root() is None
    jaxsr.load_model(checkpoint)
    assert not (tmp_path / "home").exists()


def test_default_location_and_cache_false(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    monkeypatch.delenv("JAXSR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert param_cache.cache_root() == tmp_path / "home" / ".cache" / "jaxsr" / "params"
    jaxsr.load_model(checkpoint, cache=False)
    assert not (tmp_path / "home").exists()
    jaxsr.load_model(checkpoint)
    assert len(entries(tmp_path / "home" / ".cache" / "jaxsr" / "params")) == 1


def test_small_checkpoints_are_not_cached(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    assert param_cache.entry_path(checkpoint) is None  # default threshold: tiny checkpoints convert fast
    jaxsr.load_model(checkpoint)
    assert not (tmp_path / "cache").exists()


def test_changed_source_misses_and_replaces_its_old_entry(cache_dir, checkpoint, monkeypatch):
    jaxsr.load_model(checkpoint)
    (old,) = entries(cache_dir)
    weights = checkpoint / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert param_cache.lookup(checkpoint) is None
    jaxsr.load_model(checkpoint)
    (new,) = entries(cache_dir)
    assert new != old


@pytest.mark.slow
def test_smollm2_gguf_is_cached_with_its_tokenizer(cache_dir, monkeypatch, capsys):
    path = smollm2_path()
    # CPU seconds, not wall: CI runs two test workers on two cores, and the wall ratio swung from 13x
    # (alone) to 2.7x (loaded) while the work each load does stayed the same
    start = time.process_time()
    first = jaxsr.load_model(path)
    first_s = time.process_time() - start
    forbid_conversion(monkeypatch)
    start = time.process_time()
    cached = jaxsr.load_model(path)
    cached_s = time.process_time() - start
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF: first {first_s:.1f} CPU s (writing the cache), cached {cached_s:.1f} CPU s")
    assert_same_params(first, cached)
    assert cached.eos_token_ids == first.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "What are three tips for staying healthy?"}]
    for tok in (first.tokenizer, cached.tokenizer):
        assert tok.eos_token == "<|im_end|>"
    text = first.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert cached.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert cached.tokenizer(text).input_ids == first.tokenizer(text).input_ids
    assert cached_s < first_s / 2


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unusable_cache_location_loads_without_it_and_warns_once(tmp_path, checkpoint, monkeypatch, where):
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    monkeypatch.setattr(param_cache, "_UNUSABLE", set())
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(blocker if where == "a file" else blocker / "params"))
    with pytest.warns(UserWarning, match="cannot be written") as caught:
        first = jaxsr.load_model(checkpoint)
        second = jaxsr.load_model(checkpoint)
    assert len([w for w in caught if "parameter cache" in str(w.message)]) == 1
    assert_same_params(first, second)
    assert blocker.read_text() == "not a folder"


def test_a_meta_file_nested_too_deeply_is_a_damaged_entry(cache_dir, checkpoint, monkeypatch):
    first = jaxsr.load_model(checkpoint)
    (entries(cache_dir)[0] / "meta.json").write_text("[" * 200000 + "]" * 200000)
    with pytest.warns(UserWarning, match="damaged entry"):
        again = jaxsr.load_model(checkpoint)
    assert_same_params(first, again)


@pytest.fixture
def cached_checkpoint(cache_dir, checkpoint) -> Path:
    """A private tiny llama checkpoint, with the parameter cache on for it (under tmp_path)."""
    return checkpoint


def _rewrite_keeping_size_and_mtime(path, old: str, new: str) -> None:
    """Edit `path` so that only its content differs: same size, same mtime (as `cp -p` or a fast edit)."""
    stat, text = path.stat(), path.read_text()
    assert old in text and len(old) == len(new)
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_param_cache_misses_when_config_json_changes_in_content_only(cached_checkpoint):
    config = cached_checkpoint / "config.json"
    json_text = config.read_text()
    old = json.dumps({"rms_norm_eps": json.loads(json_text)["rms_norm_eps"]})[1:-1]
    assert old in json_text, old
    first = jaxsr.load_model(cached_checkpoint)
    _rewrite_keeping_size_and_mtime(config, old, old.replace("1e-05", "3e-05"))
    second = jaxsr.load_model(cached_checkpoint)
    assert (first.config.norm_eps, second.config.norm_eps) == (1e-5, 3e-5)


def test_param_cache_never_serves_an_edited_entry_config(cached_checkpoint, tmp_path):
    reference = jaxsr.load_model(cached_checkpoint, cache=False)
    jaxsr.load_model(cached_checkpoint)
    (meta,) = (tmp_path / "cache").glob("*/meta.json")
    record = json.loads(meta.read_text())
    record["hf_config"]["rope_theta"] = 123.0  # a valid config, just not the source's
    meta.write_text(json.dumps(record))
    with pytest.warns(UserWarning, match="rebuilding the parameter cache.*edited"):
        rebuilt = jaxsr.load_model(cached_checkpoint)
    assert rebuilt.config == reference.config
