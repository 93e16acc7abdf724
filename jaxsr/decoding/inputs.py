"""Every decoding and search call's inputs, validated and encoded once: `prepare(models, prompts,
Options(...))` → `Request`.

Errors name the argument and what was expected. Prompts are strings or conversations (lists of
`{"role", "content"}` messages; both through the target's chat template when its tokenizer has one,
unless `chat=False`) or lists of token ids (used as they are)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsr import text
from jaxsr.checks import check_int, check_positive_int, check_seed, check_unicode, is_int
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.stops import StopStrings, check_stops, stop_strings
from jaxsr.models.model import Model

MAX_PROMPT_ID = 2**30  # prompt ids are int32 on device; a job of any size stays far below


@dataclasses.dataclass(frozen=True)
class Request:
    """What every decoding call shares, checked: the prompts as given and encoded, and the rows' options."""

    prompts: Sequence[Any]
    encoded: list[list[int]]
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int
    stop_token_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]
    """Each prompt's index in its job (its random stream's): split or resumed jobs draw the same."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (its text cut before them)."""
    stops: StopStrings | None = None
    """`stop` as the device looks for it in generated text."""

    def subset(self, indices: Sequence[int]) -> Request:
        """The request of the prompts at `indices` alone, each keeping its prompt id (random stream)."""
        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in indices],
            encoded=[self.encoded[i] for i in indices],
            prompt_ids=tuple(self.prompt_ids[i] for i in indices),
        )


@dataclasses.dataclass(frozen=True)
class Options:
    """The options every decoding and search entry point takes, as given (`prepare` checks them)."""

    max_new_tokens: Any
    sampling: Any = SamplingConfig()
    seed: Any = 0
    chat: bool | None = None
    """Text prompts through the target's chat template (None: when its tokenizer has one)."""
    stop_token_ids: Any = ()
    prompt_offset: Any = 0
    """Index of `prompts[0]` in a larger job, or a list of each prompt's index: split, reordered or
    resumed jobs draw the same random streams."""
    stop: Any = ()
    """Strings whose appearance in a response's text ends it (vLLM's stop strings)."""


def prepare(models: Sequence[Model], prompts: Any, options: Options) -> Request:
    """Validate a call's options and encode its prompts with `models[0]`'s tokenizer; every model
    must fit the prompts plus `max_new_tokens` in its context."""
    max_new_tokens = check_positive_int("max_new_tokens", options.max_new_tokens)
    sampling = check_sampling(options.sampling)
    seed = check_seed(options.seed)
    target = models[0]
    encoded = encode_prompts(target, prompts, chat=options.chat)
    for model in models:
        check_context(model, encoded, max_new_tokens)
    stop_ids = check_stop_ids(target, options.stop_token_ids)
    check_forbidden(target, sampling.forbidden_token_ids)
    ids = check_prompt_ids(options.prompt_offset, len(encoded))
    stop = check_stops(options.stop)
    strings = stop_strings(target.tokenizer, target.config.vocab_size, stop)
    return Request(prompts, encoded, max_new_tokens, sampling, seed, tuple(stop_ids), ids, stop, strings)


def check_sampling(sampling: Any) -> SamplingConfig:
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling: expected a jaxsr.SamplingConfig, got {type(sampling).__name__}")
    return sampling


def check_language_model(model: Any, name: str) -> Model:
    if not isinstance(model, Model):
        raise TypeError(f"{name}: expected a jaxsr.Model, got {type(model).__name__}")
    if model.config.is_reward_model:
        raise TypeError(f"{name}: a reward model has no language-model head")
    return model


def check_pair(target: Any, second: Any, names: tuple[str, str]) -> None:
    """Both must be language models over the same vocabulary (same ids for the same tokens)."""
    for model, name in zip((target, second), names, strict=True):
        check_language_model(model, name)
    t, d = target.config.vocab_size, second.config.vocab_size
    if t != d:
        raise ValueError(f"{names[1]}: vocabulary of {d} tokens differs from the {names[0]}'s {t}")
    if None not in (target.tokenizer, second.tokenizer) and not text.same_vocabulary(
        target.tokenizer, second.tokenizer
    ):
        raise ValueError(f"{names[1]}: its tokenizer maps tokens to different ids than the {names[0]}'s")


def check_contrastive_pair(expert: Any, amateur: Any) -> None:
    """`check_pair`, and both models score every token: the contrast expert − β·amateur needs every
    log-probability of both, and a reduced output layer's -inf would make it +inf or NaN."""
    check_pair(expert, amateur, ("expert", "amateur"))
    for model, name in ((expert, "expert"), (amateur, "amateur")):
        if model.config.head_token_ids is not None:
            raise ValueError(
                f"{name}: contrastive decoding needs both models' log-probabilities of every token "
                f"(expert − β·amateur); this model's output layer scores only {model.config.head_size} "
                "ids (head_token_ids) and gives the others -inf"
            )


CHARACTER_SLACK = 4
"""How many times the characters of its longest token one token may cover (normalisation can fold
several characters of text into one)."""


def encode_prompts(model: Model, prompts: Any, *, chat: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt. Texts and conversations (lists of `{"role", "content"}` messages) go
    through the chat template when the tokenizer has one (and `chat` is not False); lists of ints are
    used as they are."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts: expected a list of strings, conversations or token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts: the list is empty")
    if chat is not None and not isinstance(chat, bool):
        raise TypeError(f"chat: expected True, False or None, got {chat!r}")
    use_chat = chat if chat is not None else text.has_chat_template(model.tokenizer)
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) or text.is_conversation(prompt):
            ids = _encode_text(model, prompt, f"prompts[{i}]", use_chat)
        elif isinstance(prompt, bytes | bytearray):
            raise TypeError(f"prompts[{i}]: expected a string or a list of ints, got bytes (decode it first)")
        elif isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            ids = [int(t) for t in prompt]
            if min(ids) < 0 or max(ids) >= model.config.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must lie in [0, {model.config.vocab_size})")
        else:
            raise TypeError(
                f"prompts[{i}]: expected a string, a list of {{'role', 'content'}} messages or a list of "
                f"ints, got {type(prompt).__name__}"
            )
        encoded.append(ids)
    return encoded


def _encode_text(model: Model, prompt: str | list, name: str, chat: bool) -> list[int]:
    """A text or conversation prompt's ids, refused (naming it) when empty, not valid Unicode, too long
    for the model's context, or encoded outside the model's vocabulary."""
    tokenizer = model.tokenizer
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{name}: empty prompt")
        check_unicode(name, prompt)
        size = len(prompt)
    else:
        prompt = text.check_conversation(name, prompt)
        for k, message in enumerate(prompt):
            check_unicode(f"{name}[{k}]", message["content"])
        size = sum(len(m["content"]) for m in prompt)
    if tokenizer is None:
        raise ValueError(f"{name}: text prompts need a model with a tokenizer; pass token ids")
    most = CHARACTER_SLACK * model.config.context * text.longest_token(tokenizer)
    if size > most:  # refused before tokenizing: a huge text can take gigabytes to encode
        raise ValueError(
            f"{name}: {size} characters cannot fit the model's context of {model.config.context} tokens"
        )
    try:
        ids = text.encode_prompt(tokenizer, prompt, chat=chat, max_chars=most)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if not ids:
        raise ValueError(f"{name}: encodes to no tokens (check the chat template)")
    if max(ids) >= model.config.vocab_size:
        raise ValueError(
            f"{name}: the tokenizer gives id {max(ids)}, outside the model's vocabulary of "
            f"{model.config.vocab_size} (tokenizer and checkpoint do not match)"
        )
    return ids


def check_context(model: Model, prompts: list[list[int]], max_new_tokens: int) -> None:
    cfg = model.config
    for i, ids in enumerate(prompts):
        if len(ids) + max_new_tokens > cfg.context:
            raise ValueError(
                f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens={max_new_tokens} exceed the "
                f"model's context of {cfg.context}"
            )


def check_stop_ids(model: Model, stop_token_ids: Any) -> list[int]:
    """Extra stop ids: token ids of `model`."""
    if (
        isinstance(stop_token_ids, str | bytes)
        or not isinstance(stop_token_ids, Sequence | np.ndarray)
        or (isinstance(stop_token_ids, np.ndarray) and stop_token_ids.ndim != 1)
    ):
        raise TypeError(f"stop_token_ids: expected a sequence of token ids, got {stop_token_ids!r}")
    check_token_ids("stop_token_ids", model, stop_token_ids)
    return [int(i) for i in stop_token_ids]


def check_token_ids(name: str, model: Model, ids: Sequence[Any]) -> None:
    """Every entry of `ids` is a token id of `model`."""
    vocab = model.config.vocab_size
    for i in ids:
        if not is_int(i) or not 0 <= i < vocab:
            raise ValueError(f"{name}: expected token ids in [0, {vocab}), got {i!r}")


def check_forbidden(model: Model, forbidden: Sequence[int]) -> None:
    """Forbidden ids are `model`'s token ids and leave it a token to draw (with none left, a step would
    draw a forbidden one)."""
    check_token_ids("forbidden_token_ids", model, forbidden)
    drawable = model.config.head_token_ids or range(model.config.vocab_size)
    if len(forbidden) >= len(drawable) and set(drawable) <= set(forbidden):
        raise ValueError(
            f"forbidden_token_ids: forbids every token the model can draw ({len(drawable)}); "
            "leave one at least"
        )


def check_prompt_ids(prompt_offset: Any, count: int) -> tuple[int, ...]:
    """Each prompt's index in its job: `prompt_offset` + position, or `prompt_offset` itself when it
    lists them (distinct, one per prompt)."""
    if isinstance(prompt_offset, Sequence | np.ndarray) and not isinstance(prompt_offset, str | bytes):
        ids = [check_int("prompt_offset", i) for i in prompt_offset]
        if len(ids) != count or len(set(ids)) != count:
            raise ValueError(f"prompt_offset: expected {count} distinct prompt indices, got {ids[:8]}")
    else:
        first = check_int("prompt_offset", prompt_offset)
        ids = list(range(first, first + count))
    if ids and not (min(ids) >= 0 and max(ids) < MAX_PROMPT_ID):
        raise ValueError(f"prompt_offset: expected prompt indices in [0, 2**30), got {min(ids)} … {max(ids)}")
    return tuple(ids)
