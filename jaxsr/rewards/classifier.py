"""A `*ForSequenceClassification` reward model scoring (partial) responses through its chat template."""

from __future__ import annotations

import numpy as np

from jaxsr.decoding.prompts import left_pad
from jaxsr.ladder import bucket
from jaxsr.models.model import RewardModel
from jaxsr.rewards.base import Candidates


class ClassifierReward:
    """Renders [user: prompt, assistant: response] with the reward model's own template (a closed
    assistant turn), tokenizes with its tokenizer, and reads the score at the last token. Inputs are
    padded to power-of-two length and row buckets so scoring compiles a bounded number of times."""

    def __init__(self, model: RewardModel, batch_size: int = 32):
        if not isinstance(model, RewardModel):
            raise TypeError(f"reward: expected a jaxsr.RewardModel, got {type(model).__name__}")
        if model.tokenizer is None:
            raise ValueError("reward: the reward model has no tokenizer to render prompts with")
        self.model = model
        self.batch_size = batch_size
        self.name = f"classifier:{model.name}"
        self.token_forwards = 0

    def render(self, prompt: str, response: str) -> list[int]:
        tokenizer = self.model.tokenizer
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
            except Exception as e:
                raise ValueError(
                    f"reward: the reward model's chat template cannot render the prompt: {e}"
                ) from e
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt + "\n" + response)["input_ids"]
        context = self.model.config.max_position_embeddings
        return ids[-context:] if len(ids) > context else ids

    def score(self, candidates: Candidates) -> np.ndarray:
        encoded = [self.render(candidates.prompt_text, text) for text in candidates.texts]
        scores = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            rows = bucket(len(chunk), 1)
            length = min(bucket(max(map(len, chunk))), self.model.config.max_position_embeddings)
            tokens, mask = left_pad(chunk, rows, length)
            mask[len(chunk) :, -1] = 1  # padding rows score one pad token instead of nothing
            self.token_forwards += rows * length
            scores.append(np.asarray(self.model.scores(tokens, mask))[: len(chunk)])
        return np.concatenate(scores)
