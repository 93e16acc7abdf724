"""Text ↔ token ids: the one adapter over transformers tokenizers (chat templates, encoding, decoding),
and left padding of id lists into fixed-shape arrays."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from jaxsr import chat_template
from jaxsr.loading.files import is_panic

Messages = list[dict[str, str]]
"""A conversation: `{"role", "content"}` messages, as chat templates and TRL's datasets hold them."""
ROLES = ("system", "user", "assistant")


def is_conversation(prompt: Any) -> bool:
    """Whether a prompt is given as messages (a list of mappings) rather than a text or token ids."""
    return isinstance(prompt, list | tuple) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def check_conversation(name: str, messages: Any) -> Messages:
    """A conversation to answer, checked: `{"role", "content"}` messages with string contents, a system
    message only first, ending in a user turn (the generator writes the assistant's next turn)."""
    if not is_conversation(messages):
        raise TypeError(
            f"{name}: expected a list of {{'role', 'content'}} messages, got {type(messages).__name__}"
        )
    checked = []
    for k, message in enumerate(messages):
        where = f"{name}[{k}]"
        if set(message) != {"role", "content"}:
            raise ValueError(
                f"{where}: expected the keys 'role' and 'content', got {sorted(map(str, message))}"
            )
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"{where}: role must be one of {ROLES}, got {role!r}")
        if role == "system" and k > 0:
            raise ValueError(f"{where}: a system message may only come first")
        if not isinstance(content, str):
            raise TypeError(f"{where}: content must be a string, got {type(content).__name__}")
        checked.append({"role": role, "content": content})
    if checked[-1]["role"] != "user" or not checked[-1]["content"].strip():
        raise ValueError(f"{name}: the conversation must end in a non-empty user turn (the one to answer)")
    return checked


def as_messages(prompt: str | Messages) -> Messages:
    """A prompt as a conversation: a text is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def last_user_turn(prompt: str | Messages) -> str:
    """What the user asked last: a text prompt itself, or a conversation's final user message."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The conversation as text, in the tokenizer's chat template (rendered as transformers renders it,
    in jinja's sandbox bounded in work: `jaxsr.chat_template`); a template that fails or runs away
    raises ValueError naming the tokenizer."""
    try:
        text = chat_template.render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    except chat_template.TemplateOverBudget as e:
        raise ValueError(f"chat template of {_name(tokenizer)}: {e}") from None
    except Exception as e:  # jinja's TemplateError, or whatever the template's own code raised
        raise ValueError(f"chat template of {_name(tokenizer)}: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ValueError(f"chat template of {_name(tokenizer)}: rendered a {type(text).__name__}, not text")
    return text


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


@functools.lru_cache(maxsize=16)
def longest_token(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest vocabulary entry: no token covers many more characters
    of text, so a text longer than context × this (with slack for normalisation) cannot fit."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def encode(tokenizer: Any, text: str, *, special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; `special_tokens=False` for text a chat template already marked up. A
    tokenizer that panics (a pyo3 `PanicException`) is a ValueError naming it."""
    try:
        return list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])
    except BaseException as e:
        if not is_panic(e):
            raise
        raise ValueError(f"tokenizer of {_name(tokenizer)} failed on a text: {e}") from None


def encode_prompt(
    tokenizer: Any, prompt: str | Messages, *, chat: bool, max_chars: int | None = None
) -> list[int]:
    """A prompt as the generator sees it: a text (one user turn) or a conversation in the chat template,
    ready for the assistant's answer, or a text as it is (`chat=False`). A rendering longer than
    `max_chars` is refused before it is tokenized (a template can turn a short prompt into gigabytes)."""
    if not chat:
        if not isinstance(prompt, str):
            raise ValueError("a conversation needs a chat template (the model has none, or chat=False)")
        return encode(tokenizer, prompt)
    text = render_chat(tokenizer, as_messages(prompt), add_generation_prompt=True)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"chat template of {_name(tokenizer)}: renders the prompt as {len(text)} characters, more than "
            f"the model's context can hold ({max_chars})"
        )
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
