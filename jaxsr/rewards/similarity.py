"""Embedding-similarity reward: cosine between prompt and response sentence embeddings."""

from __future__ import annotations

import numpy as np

from jaxsr.models.encoder import EncoderModel
from jaxsr.rewards.base import Candidates


class EmbeddingSimilarity:
    """Relevance of a response to its prompt under a sentence encoder (e.g. all-MiniLM-L6-v2)."""

    def __init__(self, encoder: EncoderModel):
        if not isinstance(encoder, EncoderModel):
            raise TypeError(f"reward: expected a jaxsr.EncoderModel, got {type(encoder).__name__}")
        if encoder.tokenizer is None:
            raise ValueError(f"reward: the encoder {encoder.name} has no tokenizer to embed text with")
        self.encoder = encoder
        self.name = f"embedding_similarity:{encoder.name}"
        self.token_forwards = 0
        self._prompt_cache: dict[str, np.ndarray] = {}

    def _embed(self, texts: list[str]) -> np.ndarray:
        before = self.encoder.token_forwards
        embeddings = np.asarray(self.encoder.embed(texts))
        self.token_forwards += self.encoder.token_forwards - before
        return embeddings

    def score(self, candidates: Candidates) -> np.ndarray:
        if candidates.prompt_text not in self._prompt_cache:
            self._prompt_cache[candidates.prompt_text] = self._embed([candidates.prompt_text])[0]
        prompt = self._prompt_cache[candidates.prompt_text]
        responses = self._embed([t if t.strip() else " " for t in candidates.texts])
        return responses @ prompt
