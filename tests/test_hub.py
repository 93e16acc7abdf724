"""Hub ids: fetched with huggingface_hub (safetensors, configs, tokenizer only); errors name the id."""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest

import jaxsr
from jaxsr.loading import hub


def test_offline_hub_id_is_named_in_the_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="someorg/some-model"):
        jaxsr.load_model("someorg/some-model", cache=False)


def test_a_string_that_is_neither_a_path_nor_a_hub_id_is_refused():
    with pytest.raises(ValueError, match="source"):
        jaxsr.load_model("not a valid id!!", cache=False)


def test_missing_local_paths_are_not_sent_to_the_hub():
    with pytest.raises(FileNotFoundError, match="source") as error:
        jaxsr.load_model("./no/such/dir", cache=False)
    assert isinstance(error.value, ValueError)  # a bad argument, as every other


def test_hub_download_is_pinned_and_fetches_no_pickles_or_code(monkeypatch, tmp_path_factory):
    path, _ = H.checkpoint("llama2", tmp_path_factory)
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    lm = jaxsr.load_model("someorg/tiny-llama", revision="abc123", cache=False)
    ((repo, revision, patterns),) = calls
    assert (repo, revision) == ("someorg/tiny-llama", "abc123")
    assert patterns == hub.PATTERNS
    assert not any(p.endswith((".bin", ".pt", ".py", ".pth")) for p in patterns)
    tokens = np.array([[1, 2, 3, 4]])
    np.testing.assert_allclose(
        np.asarray(lm.logits(tokens)), np.asarray(jaxsr.load_model(path, cache=False).logits(tokens))
    )
