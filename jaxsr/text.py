"""Text ↔ token ids: the one adapter over transformers tokenizers (chat templates, encoding, decoding),
and left padding of id lists into fixed-shape arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The conversation as text, in the tokenizer's chat template."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer: Any, text: str, *, special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; `special_tokens=False` for text a chat template already marked up."""
    return list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def encode_user_turn(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    """A user prompt as the generator sees it: in the chat template ready for the assistant's answer,
    or as plain text."""
    if not chat:
        return encode(tokenizer, prompt)
    text = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return encode(tokenizer, text, special_tokens=False)


def decode(tokenizer: Any, ids: list[int]) -> str:
    """The text of `ids` without special tokens ("" without a tokenizer)."""
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def decode_batch(tokenizer: Any, id_lists: list[list[int]]) -> list[str]:
    if tokenizer is None:
        return ["" for _ in id_lists]
    return tokenizer.batch_decode(id_lists, skip_special_tokens=True)


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return a is not None and b is not None and a.get_vocab() == b.get_vocab()


def left_pad(id_lists: list[list[int]], rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """[rows, length] int32 tokens and mask, each list right-aligned; missing rows are all padding."""
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.int32)
    for r, ids in enumerate(id_lists):
        tokens[r, length - len(ids) :] = ids
        mask[r, length - len(ids) :] = 1
    return tokens, mask
