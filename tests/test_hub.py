"""Sources of `load_model` that are hub ids: fetched with huggingface_hub (safetensors, configs and the
tokenizer only); a hub id offline, missing, gated, at an unknown revision or unreachable is a bad
source naming the id (other hub failures stay OSErrors); empty sources and paths that look local
never reach the hub."""

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


def _hub_response(status: int):
    import httpx2

    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))


def _hub_failures():
    """What snapshot_download raises for a source the hub cannot provide (built here: no network)."""
    import httpx2
    from huggingface_hub import errors

    unreachable = errors.LocalEntryNotFoundError("cannot find the files")
    unreachable.__cause__ = httpx2.ConnectError("no route to host")
    return [
        (errors.RepositoryNotFoundError("404", response=_hub_response(404)), "no such repository"),
        (errors.GatedRepoError("403", response=_hub_response(403)), "gated"),
        (errors.RevisionNotFoundError("404", response=_hub_response(404)), r"revision: .* no revision 'v9'"),
        (unreachable, r"unreachable \(ConnectError\) and its local cache holds no complete copy"),
    ]


def test_an_offline_hub_id_is_a_bad_source_naming_the_argument_the_id_and_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="source: 'no-such-org/no-such-model' names no local file") as error:
        jaxsr.load_model("no-such-org/no-such-model", cache=False)
    assert "HF_HUB_OFFLINE" in str(error.value) and isinstance(error.value, FileNotFoundError)


@pytest.mark.parametrize("index", range(4))
def test_hub_failures_that_name_nothing_are_value_errors(monkeypatch, index):
    failure, message = _hub_failures()[index]

    def snapshot_download(*args, **kwargs):
        raise failure

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=message):
        jaxsr.load_model("someorg/some-model", revision="v9", cache=False)


def test_other_hub_failures_stay_os_errors(monkeypatch):
    def snapshot_download(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(OSError, match=r"someorg/some-model.*No space left") as error:
        jaxsr.load_model("someorg/some-model", cache=False)
    assert not isinstance(error.value, ValueError)


@pytest.mark.parametrize("source", ["./no/such/dir", "/no/such/model.gguf", "~/no-such-dir", "missing.gguf"])
def test_missing_local_looking_paths_never_reach_the_hub(monkeypatch, source):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError, match=r"source: .* does not exist"):
        jaxsr.load_model(source, cache=False)


def test_load_model_refuses_an_empty_source_and_a_revision_that_is_not_text(monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError, match="source: expected a path or a hub id, got ''"):
        jaxsr.load_model("")  # (Path("") is the working directory)
    with pytest.raises(TypeError, match="revision: expected a branch, tag or commit"):
        jaxsr.load_model("someorg/some-model", revision=3)
