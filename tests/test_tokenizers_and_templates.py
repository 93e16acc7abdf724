"""Chat templates and tokenizers: a template renders exactly as transformers renders it, or fails as a
ValueError naming the tokenizer; a template that fails, never ends, or renders more than any context
holds is stopped within a bound on time and memory, before anything is tokenized or decoded; a
tokenizer that panics, and prompt text that is not Unicode or too long for any tokenization, are named."""

from __future__ import annotations

import pytest

import jaxsr
from jaxsr.loading.embedded import smollm2_draft_path

# -- tokenizers and prompt text --------------------------------------------------------------------


def test_text_that_is_not_unicode_is_named():
    model = jaxsr.load_model(smollm2_draft_path())
    with pytest.raises(ValueError, match=r"^prompts\[1\]: not valid Unicode"):
        jaxsr.generate(model, ["fine", "\ud800 hi"], max_new_tokens=2)


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(monkeypatch):
    """30 MB of text would take gigabytes to tokenize only to be refused for its length."""
    model = jaxsr.load_model(smollm2_draft_path())

    encode = jaxsr.text.encode

    def short_only(tokenizer, text, **kwargs):
        assert len(text) < 1000, "the long text was tokenized"
        return encode(tokenizer, text, **kwargs)

    monkeypatch.setattr(jaxsr.text, "encode", short_only)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: 30000000 characters cannot fit .* context of"):
        jaxsr.generate(model, ["fine", "x" * 30_000_000], max_new_tokens=2)
