"""Prompt and argument validation, tokenisation (with the chat template) and left padding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsr.models.config import DecoderConfig
from jaxsr.models.model import Model


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return int(value)


def encode_prompts(model: Model, prompts: Any, *, chat: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt. Strings go through the chat template when the tokenizer has one
    (and `chat` is not False); lists of ints are used as they are."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts: expected a list of strings or a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts: the list is empty")
    tokenizer = model.tokenizer
    use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompts[{i}]: empty prompt")
            if tokenizer is None:
                raise ValueError(f"prompts[{i}]: text prompts need a model with a tokenizer; pass token ids")
            if use_chat:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, Sequence) and all(isinstance(t, int | np.integer) for t in prompt):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            ids = [int(t) for t in prompt]
            if min(ids) < 0 or max(ids) >= model.config.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must lie in [0, {model.config.vocab_size})")
        else:
            raise TypeError(f"prompts[{i}]: expected a string or a list of ints, got {type(prompt).__name__}")
        encoded.append(list(ids))
    return encoded


def check_language_model(model: Any, name: str) -> Model:
    if not isinstance(model, Model):
        raise TypeError(f"{name}: expected a jaxsr.Model, got {type(model).__name__}")
    if model.config.is_reward_model:
        raise TypeError(f"{name}: a reward model has no language-model head")
    return model


def check_context(model: Model, prompts: list[list[int]], max_new_tokens: int) -> None:
    cfg = model.config
    for i, ids in enumerate(prompts):
        if len(ids) + max_new_tokens > cfg.context:
            raise ValueError(
                f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens={max_new_tokens} exceed the "
                f"model's context of {cfg.context}{_window_note(cfg)}"
            )


def _window_note(cfg: DecoderConfig) -> str:
    if cfg.context == cfg.max_position_embeddings:
        return ""
    return (
        f" (its sliding attention window, which jaxsr does not apply; positions go up to "
        f"{cfg.max_position_embeddings})"
    )


def left_pad(prompts: list[list[int]], rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """[rows, length] tokens and mask, prompts right-aligned; missing rows are all padding."""
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.int32)
    for r, ids in enumerate(prompts):
        tokens[r, length - len(ids) :] = ids
        mask[r, length - len(ids) :] = 1
    return tokens, mask
