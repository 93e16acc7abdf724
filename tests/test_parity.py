"""jaxsr models match the Hugging Face (torch) models they were loaded from.

Every family is a tiny random checkpoint written by transformers (see hf_fixtures.py); the same torch
model is the oracle. Inputs are LEFT-padded batches whose rows carry different amounts of padding, and
HF gets position_ids = clip(cumsum(mask) - 1, 0), the positions jaxsr uses.
"""

from __future__ import annotations

import json

import hf_fixtures as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxsr
from jaxsr.sharding import make_mesh

TOL = 1e-4
"""jaxsr against torch on logits and rewards of O(1–10): two float32 implementations, measured within
1e-5 on AVX2, AVX and SSE4.2. A mapping mistake is of the order of the logits."""


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    return lambda family, **kw: H.checkpoint(family, tmp_path_factory, **kw)


def _batch(seed: int = 0):
    return H.left_padded_batch(seed, lengths=(9, 6, 3, 1))


def _max_diff_on_real(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    real = mask.astype(bool)
    return float(np.abs(np.asarray(a)[real] - np.asarray(b)[real]).max())


def _param(model: jaxsr.Model, *path: str | int) -> jax.Array:
    flat = dict(nnx.to_flat_state(model.params))
    leaf = flat[path]
    return leaf.get_value() if hasattr(leaf, "get_value") else leaf.value


# -- causal LMs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", H.LM_FAMILIES)
def test_logits_match_torch(hf, family):
    directory, torch_model = hf(family)
    tokens, mask = _batch()
    expected = H.torch_logits(torch_model, tokens, mask)
    model = jaxsr.load_model(directory)
    assert type(model) is jaxsr.Model
    got = model.logits(tokens, mask)
    assert got.shape == expected.shape and got.dtype == jnp.float32
    # Not a vacuous comparison: logits are O(1–10) and differ between positions.
    assert np.abs(expected[mask.astype(bool)]).max() > 1.0
    assert _max_diff_on_real(got, expected, mask) < TOL


def test_padding_does_not_change_real_positions(hf):
    """A row's logits do not depend on how much left padding it carries (nor on the pad ids)."""
    directory, _ = hf("qwen3")
    model = jaxsr.load_model(directory)
    tokens, mask = H.left_padded_batch(3, lengths=(5,), width=5)
    alone = np.asarray(model.logits(tokens, mask))[0]
    padded = np.concatenate([np.full((1, 4), 7), tokens], axis=1)
    padded_mask = np.concatenate([np.zeros((1, 4), np.int64), mask], axis=1)
    got = np.asarray(model.logits(padded, padded_mask))[0, 4:]
    np.testing.assert_allclose(got, alone, atol=TOL, rtol=0)


def test_llama3_rope_scaling_matters(hf, tmp_path):
    """Guard for the llama3 parity test: with the scaling dropped the logits are clearly wrong."""
    directory, torch_model = hf("llama3")
    tokens, mask = _batch()
    expected = H.torch_logits(torch_model, tokens, mask)

    def drop_scaling(config):
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}

    unscaled = jaxsr.load_model(H.copy_checkpoint(directory, tmp_path / "unscaled", drop_scaling))
    assert _max_diff_on_real(unscaled.logits(tokens, mask), expected, mask) > 1e-2


# -- reward models -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", H.REWARD_FAMILIES)
def test_reward_scores_match_torch(hf, family):
    """HF reads the rightmost token that is not pad_token_id; jaxsr the last token with mask 1.

    Real tokens are never the pad id, so on left padding both read the last column and on right
    padding both read each row's last real token.
    """
    directory, torch_model = hf(family)
    model = jaxsr.load_reward_model(directory)
    assert isinstance(model, jaxsr.RewardModel)
    tokens, mask = _batch(1)
    expected = H.torch_logits(torch_model, tokens, mask)[:, 0]
    got = np.asarray(model.scores(tokens, mask))
    assert got.shape == (tokens.shape[0],) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    assert np.ptp(expected) > 0.05  # rows really differ

    # The same rows right-padded: same rewards (positions count real tokens only).
    right = np.full_like(tokens, H.PAD_ID)
    right_mask = np.zeros_like(mask)
    for b, n in enumerate(mask.sum(1)):
        right[b, :n] = tokens[b, -n:]
        right_mask[b, :n] = 1
    expected_right = H.torch_logits(torch_model, right, right_mask)[:, 0]
    np.testing.assert_allclose(expected_right, expected, atol=TOL, rtol=0)
    got_right = np.asarray(model.scores(right, right_mask))
    np.testing.assert_allclose(got_right, expected_right, atol=TOL, rtol=0)


def test_load_model_returns_reward_model_for_seq_cls(hf):
    directory, _ = hf("llama_rm")
    model = jaxsr.load_model(directory)
    assert isinstance(model, jaxsr.RewardModel) and model.config.num_labels == 1


# -- dtypes, sharded files, config spellings, meshes ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gpt2", "qwen3_rm"])
def test_bfloat16_within_tolerance(hf, family):
    """bfloat16 keeps 8 significand bits (relative rounding 2^-9 ≈ 0.2% per value). Weights, activations
    and K/V are rounded at every layer, so logit errors of a few percent of the logit scale are expected;
    a mapping mistake (wrong transpose, missing bias/norm) is of the order of the logits themselves.
    We require max error ≤ 5% of the largest |logit| and mean error ≤ 1%."""
    directory, torch_model = hf(family)
    tokens, mask = _batch()
    real = mask.astype(bool)
    if family.endswith("_rm"):
        model = jaxsr.load_reward_model(directory, dtype="bfloat16")
        expected = H.torch_logits(torch_model, tokens, mask)[:, 0]
        got = np.asarray(model.scores(tokens, mask))
    else:
        model = jaxsr.load_model(directory, dtype="bfloat16")
        expected = H.torch_logits(torch_model, tokens, mask)[real]
        got = np.asarray(model.logits(tokens, mask))[real]
    assert model.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(model.params))
    assert got.dtype == np.float32
    scale = np.abs(expected).max()
    err = np.abs(got - expected)
    assert err.max() <= 0.05 * scale, (err.max(), scale)
    assert err.mean() <= 0.01 * scale, (err.mean(), scale)
    assert err.max() > 0  # it really ran in bfloat16


def test_sharded_checkpoint_loads_identically(hf):
    directory, torch_model = hf("llama2")
    sharded, _ = hf("llama2", max_shard_size="10KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    assert all((sharded / name).exists() for name in shards)
    tokens, mask = _batch()
    got = np.asarray(jaxsr.load_model(sharded).logits(tokens, mask))
    # the same tensors, config and shapes: the same computation, bitwise equal
    np.testing.assert_array_equal(got, np.asarray(jaxsr.load_model(directory).logits(tokens, mask)))
    assert _max_diff_on_real(got, H.torch_logits(torch_model, tokens, mask), mask) < TOL


def _to_v4(config: dict) -> None:
    """Rewrite a transformers-5 config.json in transformers-4 spelling."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.46.0"


def _to_v4_type_key(config: dict) -> None:
    """Older transformers-4 spelling: `type` instead of `rope_type` inside rope_scaling."""
    _to_v4(config)
    if config["rope_scaling"]:
        config["rope_scaling"]["type"] = config["rope_scaling"].pop("rope_type")


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_transformers4_config_spelling(hf, tmp_path, family):
    directory, torch_model = hf(family)
    assert "rope_parameters" in json.loads((directory / "config.json").read_text())
    tokens, mask = _batch()
    v5 = np.asarray(jaxsr.load_model(directory).logits(tokens, mask))
    for i, edit in enumerate((_to_v4, _to_v4_type_key)):
        copy = H.copy_checkpoint(directory, tmp_path / f"v4-{i}", edit)
        written = json.loads((copy / "config.json").read_text())
        assert "rope_parameters" not in written and "rope_theta" in written and "torch_dtype" in written
        model = jaxsr.load_model(copy)
        assert model.config.rope_theta == (500.0 if family == "llama3" else 10000.0)
        assert (model.config.rope_scaling is not None) == (family == "llama3")
        np.testing.assert_array_equal(np.asarray(model.logits(tokens, mask)), v5)
    assert _max_diff_on_real(v5, H.torch_logits(torch_model, tokens, mask), mask) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 4), (8, 1)], ids=["data2-model4", "data8-model1"])
@pytest.mark.parametrize("family", ["llama_bias", "qwen3_rm"])
def test_mesh_gives_same_results_and_shards_params(hf, shape, family):
    directory, torch_model = hf(family)
    data, model_axis = shape
    mesh = make_mesh(data=data, model=model_axis)
    tokens, mask = _batch()
    reward = family.endswith("_rm")
    plain = jaxsr.load_model(directory)
    sharded = jaxsr.load_model(directory, mesh=mesh)
    assert sharded.mesh is mesh

    up = _param(sharded, "blocks", 1, "mlp", "up")  # [d, ffn]; ffn = 48 divides by 4
    assert up.sharding.mesh.shape == mesh.shape and len(up.sharding.device_set) == 8
    embed = _param(sharded, "embed")  # [vocab=96, d]
    q = _param(sharded, "blocks", 1, "attn", "q")  # [d, heads=4, head_dim]
    if model_axis > 1:
        assert up.sharding.spec == PartitionSpec(None, "model")
        assert embed.sharding.spec == PartitionSpec("model", None)
        assert q.sharding.spec == PartitionSpec(None, "model", None)
        # Each device holds a quarter of the MLP columns, not a replica.
        assert {s.data.shape for s in up.addressable_shards} == {(up.shape[0], up.shape[1] // 4)}
    else:
        assert up.sharding.is_fully_replicated

    # sharded vs plain: another partitioning of the same f32 computation, measured within 7e-7
    if reward:
        got, ref = sharded.scores(tokens, mask), plain.scores(tokens, mask)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
        expected = H.torch_logits(torch_model, tokens, mask)[:, 0]
        np.testing.assert_allclose(np.asarray(got), expected, atol=TOL, rtol=0)
    else:
        got, ref = sharded.logits(tokens, mask), plain.logits(tokens, mask)
        assert _max_diff_on_real(got, ref, mask) < 1e-5
        assert _max_diff_on_real(got, H.torch_logits(torch_model, tokens, mask), mask) < TOL
