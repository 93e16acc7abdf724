"""Embedding-similarity reward: cosine between prompt and response sentence embeddings."""

from __future__ import annotations

import numpy as np

from jaxsr.models.encoder import EncoderModel
from jaxsr.rewards.base import Candidates, reward_batch

PROMPTS_KEPT = 1024
"""Prompt embeddings kept for the prompts' later rounds (SR scores a prompt every round)."""


class EmbeddingSimilarity:
    """Relevance of a response to its prompt under a sentence encoder (e.g. all-MiniLM-L6-v2)."""

    def __init__(self, encoder: EncoderModel, batch_size: int | None = None):
        if not isinstance(encoder, EncoderModel):
            raise TypeError(f"reward: expected a jaxsr.EncoderModel, got {type(encoder).__name__}")
        if encoder.tokenizer is None:
            raise ValueError(f"reward: the encoder {encoder.name} has no tokenizer to embed text with")
        self.encoder = encoder
        self.batch_size = reward_batch(batch_size, accelerated=64)
        self.name = f"embedding_similarity:{encoder.name}"
        self.token_forwards = 0
        self._prompt_cache: dict[str, np.ndarray] = {}

    def _embed(self, texts: list[str]) -> np.ndarray:
        before = self.encoder.token_forwards
        embeddings = np.asarray(self.encoder.embed(texts, batch_size=self.batch_size))
        self.token_forwards += self.encoder.token_forwards - before
        return embeddings

    def score(self, candidates: Candidates) -> np.ndarray:
        return self.score_many([candidates])[0]

    def score_many(self, batches: list[Candidates]) -> list[np.ndarray]:
        """Several prompts' responses embedded in shared batches (each prompt embedded once while
        it stays among the last PROMPTS_KEPT)."""
        new = list(dict.fromkeys(c.prompt_text for c in batches if c.prompt_text not in self._prompt_cache))
        if new:
            self._prompt_cache.update(zip(new, self._embed(new), strict=True))
        prompts = [self._prompt_cache[c.prompt_text] for c in batches]
        while len(self._prompt_cache) > PROMPTS_KEPT:  # oldest first: memory does not grow with a job
            del self._prompt_cache[next(iter(self._prompt_cache))]
        texts = [t if t.strip() else " " for c in batches for t in c.texts]
        responses = self._embed(texts) if texts else np.zeros((0, 0), np.float32)
        ends = np.cumsum([len(c) for c in batches])
        return [part @ prompt for part, prompt in zip(np.split(responses, ends[:-1]), prompts, strict=True)]
