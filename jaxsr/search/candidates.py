"""Scoring sampled rows with a reward and picking the best: shared by Best-of-N and SR."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsr import text
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Sample
from jaxsr.rewards.base import Candidates, Reward, score_each
from jaxsr.rewards.classifier import TokenScorer
from jaxsr.rewards.function import FunctionReward

Prompt = str | list[int] | text.Messages
"""A prompt as a call takes it: a text, token ids, or a conversation."""
Scored = tuple[Prompt, list[int], list[Sample]]
"""(prompt, its ids as the generator saw it, samples)."""


def prompt_messages(model: Model, prompt: Prompt) -> text.Messages:
    """The prompt as the conversation a reward renders before the response: a conversation as it is,
    a text (or token ids, decoded) as one user turn."""
    if text.is_conversation(prompt):
        return [dict(message) for message in prompt]  # copies: a reward cannot alter the prompt
    return text.as_messages(prompt if isinstance(prompt, str) else text.decode(model.tokenizer, prompt))


def check_reward(
    reward: Reward, model: Model, prompts: Sequence[Prompt], encoded: Sequence[list[int]] = ()
) -> None:
    """Let the reward refuse, before any decoding, the prompts it could not score (a reward model
    whose template cannot render them): its optional `check(messages)`. A reward that is not one of
    jaxsr's own also scores two stand-in responses to the first prompt (`encoded`: the prompts' ids),
    so one that fails, or returns what no search can rank, is refused before hours of decoding."""
    check = getattr(reward, "check", None)
    if callable(check):
        for i, prompt in enumerate(prompts):
            try:
                check(prompt_messages(model, prompt))
            except ValueError as e:
                raise ValueError(f"{e} (prompts[{i}])") from None
    if encoded and _runs_user_code(reward):
        ids = encoded[0]
        stand_ins = [ids[-1:], ids[-2:]]
        texts = text.decode_batch(model.tokenizer, stand_ins)
        samples = [Sample(r, t, logprob=0.0) for r, t in zip(stand_ins, texts, strict=True)]
        try:
            score_samples(model, reward, prompts[0], ids, samples)
        except ValueError as e:
            raise ValueError(f"{e} (tried before decoding on two stand-in responses to prompts[0])") from None


def _runs_user_code(reward: Reward) -> bool:
    """Whether the reward's scores come from a user's code: a class of its own, or a function jaxsr
    wraps (`FunctionReward`)."""
    return isinstance(reward, FunctionReward) or not type(reward).__module__.startswith("jaxsr.")


def token_scorer(model: Model, reward: Reward, prompt: Prompt, max_new_tokens: int) -> TokenScorer | None:
    """The reward's on-device scorer of `model`'s response ids (a classifier reading the same
    vocabulary), or None: responses are then scored through text."""
    make = getattr(reward, "token_scorer", None)
    return None if make is None else make(model, prompt_messages(model, prompt), max_new_tokens)


def read_on_device(scorer: TokenScorer, samples: list[Sample]) -> np.ndarray:
    """[n] bool: the samples an on-device scorer scores as the reward scores their text (a scorer
    without `agrees`, a user's own, is trusted for all)."""
    agrees = getattr(scorer, "agrees", None)
    if agrees is None:
        return np.ones(len(samples), bool)
    return np.asarray(agrees([s.token_ids for s in samples], [s.text for s in samples]), bool)


def true_to_text(model: Model, reward: Reward, item: Scored, scorer: TokenScorer) -> list[Sample]:
    """Samples scored on device by `scorer`, those whose text the reward reads otherwise rescored
    through their text: every stored score is then the reward of the stored text."""
    prompt, prompt_ids, samples = item
    same = read_on_device(scorer, samples)
    if same.all():
        return samples
    redo = [s for s, ok in zip(samples, same, strict=True) if not ok]
    rescored = iter(score_prompts(model, reward, [(prompt, prompt_ids, redo)])[0])
    return [s if ok else next(rescored) for s, ok in zip(samples, same, strict=True)]


def score_ids(scorer: TokenScorer, token_lists: list[list[int]], max_new_tokens: int) -> np.ndarray:
    """Scores of host-side responses through an on-device scorer (rows padded to a bucket)."""
    rows = bucket(len(token_lists), 1)
    tokens = np.zeros((rows, bucket(max_new_tokens)), np.int32)
    lengths = np.zeros(rows, np.int32)
    for i, ids in enumerate(token_lists):
        tokens[i, : len(ids)], lengths[i] = ids, len(ids)
    return np.asarray(scorer(tokens, lengths), np.float64)[: len(token_lists)]


def score_samples(
    model: Model,
    reward: Reward,
    prompt: Prompt,
    prompt_ids: list[int],
    samples: list[Sample],
    scores: np.ndarray | None = None,
) -> list[Sample]:
    """The (partial) responses with their reward: `scores` where they were scored on device, else
    the reward's score of each."""
    if scores is None:
        return score_prompts(model, reward, [(prompt, prompt_ids, samples)])[0]
    return _with_scores(reward, samples, scores)


def _with_scores(reward: Reward, samples: list[Sample], scores: Any) -> list[Sample]:
    """The samples with the reward's `scores`, once `check_scores` has read them."""
    scores = check_scores(reward, scores, len(samples))
    return [dataclasses.replace(s, score=float(x)) for s, x in zip(samples, scores, strict=True)]


def known(values: list[float | None]) -> np.ndarray | None:
    """`values` as an array, or None where any is unknown (a sample not drawn by jaxsr's sampler)."""
    return None if any(v is None for v in values) else np.array(values, np.float64)


def score_prompts(model: Model, reward: Reward, items: list[Scored]) -> list[list[Sample]]:
    """Several prompts' samples with their reward, scored together (in shared model batches where
    the reward can: `rewards.base.score_each`)."""
    batches = [
        Candidates(
            prompt_text=text.last_user_turn(prompt_messages(model, prompt)),
            prompt_ids=prompt_ids,
            token_ids=[list(s.token_ids) for s in samples],  # copies: a reward cannot alter the samples
            texts=[s.text for s in samples],
            logprob_sum=np.array([s.logprob for s in samples], np.float64),
            num_tokens=np.array([len(s.token_ids) + s.finished for s in samples]),  # stop token included
            messages=prompt_messages(model, prompt),
            stop_tokens=[s.stop_token for s in samples],
            certainty_sum=known([s.certainty for s in samples]),
        )
        for prompt, prompt_ids, samples in items
    ]
    try:
        scores = score_each(reward, batches)
    except Exception as e:  # whatever a user's reward raises: the search names the reward
        raise ValueError(f"reward: {reward.name} raised {type(e).__name__}: {e}") from e
    if len(scores) != len(items):
        raise ValueError(f"reward: {reward.name} returned scores of {len(scores)} prompts for {len(items)}")
    return [_with_scores(reward, samples, x) for (_, _, samples), x in zip(items, scores, strict=True)]


def even_share(total: int, k: int, count: int) -> int:
    """Item `k`'s part of an integer `total` shared evenly by `count` items (the parts add up to it):
    a reward call's token positions charged to the prompts it scored together."""
    return total * (k + 1) // count - total * k // count


def check_scores(reward: Reward, scores: Any, count: int) -> np.ndarray:
    """A reward's output as [count] float64 scores, refused unless it is `count` finite real numbers
    (the search could not rank anything else)."""
    if np.ma.isMaskedArray(scores) and np.ma.getmaskarray(scores).any():
        raise ValueError(f"reward: {reward.name} returned masked scores (no score for some responses)")
    try:
        array = np.asarray(scores)
    except (ValueError, TypeError) as e:  # ragged nesting and the like
        raise ValueError(f"reward: {reward.name} returned scores numpy cannot read ({e})") from None
    if array.dtype.kind not in "iuf":  # not bool: a ranking needs scores, not pass/fail
        raise ValueError(
            f"reward: {reward.name} returned {type(scores).__name__} of {array.dtype}, expected real numbers"
        )
    if array.shape != (count,):
        raise ValueError(f"reward: {reward.name} returned shape {array.shape} for {count} responses")
    scores = array.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        raise ValueError(
            f"reward: {reward.name} returned a non-finite score ({scores[bad[0]]}) for response {bad[0]}"
        )
    return scores


def best(samples: list[Sample]) -> Sample | None:
    """The highest-scoring sample (the first one among equals)."""
    return max(samples, key=lambda s: s.score, default=None) if samples else None
