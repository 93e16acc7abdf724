"""Sliding attention windows (Mistral v0.1, Qwen2/3 with use_sliding_window): jaxsr reads the window
from config.json, keeps it through save_model, agrees with Hugging Face inside it (test_parity's
`*_window` families) and refuses longer contexts, where Hugging Face's windowed attention differs."""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest
import torch
import transformers
from tiny import tiny_model

import jaxsr
from jaxsr.loading.hf_config import decoder_config_from_hf, hf_config_from_decoder
from jaxsr.models.model import _logits


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (transformers.MistralConfig(sliding_window=4096), (4096, 0)),
        (transformers.MistralConfig(sliding_window=None), (None, 0)),
        (transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096), (None, 0)),
        (
            transformers.Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=20),
            (512, 20),
        ),
        (
            transformers.Qwen3Config(use_sliding_window=True, sliding_window=256, max_window_layers=0),
            (256, 0),
        ),
        (transformers.LlamaConfig(), (None, 0)),
    ],
)
def test_the_window_and_its_first_layer_are_read_as_transformers_applies_them(config, expected):
    cfg = decoder_config_from_hf(config.to_dict())
    assert (cfg.sliding_window, cfg.first_sliding_layer) == expected
    window = expected[0] or config.max_position_embeddings
    assert cfg.context == min(window, config.max_position_embeddings)
    saved = hf_config_from_decoder(cfg)
    assert decoder_config_from_hf(saved) == cfg
    reread = type(config)(**saved)
    assert getattr(reread, "layer_types", None) == getattr(config, "layer_types", None)


def test_generation_past_the_window_is_refused():
    lm = tiny_model(sliding_window=8)
    assert lm.config.context == 8
    jaxsr.generate(lm, [[1, 2, 3, 4, 5]], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"prompts\[0\].*context of 8 .*sliding attention window"):
        jaxsr.generate(lm, [[1, 2, 3, 4, 5]], max_new_tokens=4)


@pytest.mark.parametrize("family", ["mistral_window", "qwen2_window"])
def test_past_the_window_hugging_face_attends_differently(family, tmp_path_factory):
    """Why the refusal: beyond the window full attention (what jaxsr computes) is not the model."""
    directory, torch_model = H.checkpoint(family, tmp_path_factory)
    lm = jaxsr.load_model(directory, cache=False)
    window = lm.config.sliding_window
    ids = np.random.default_rng(0).integers(1, H.VOCAB, size=(1, window + 8))
    with torch.no_grad():
        theirs = torch_model(torch.as_tensor(ids)).logits.numpy()
    with pytest.raises(ValueError, match="sliding attention window"):
        lm.logits(ids)
    ours = np.asarray(_logits(lm.graph, lm.params, ids, np.ones_like(ids)))  # what jaxsr would compute
    np.testing.assert_allclose(ours[:, :window], theirs[:, :window], atol=1e-4)
    assert np.abs(ours[:, window:] - theirs[:, window:]).max() > 1e-2
