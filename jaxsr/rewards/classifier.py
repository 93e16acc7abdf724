"""A `*ForSequenceClassification` reward model scoring (partial) responses through its chat template.

Responses normally go through text: decoded, rendered with the reward model's template, re-tokenized.
When the reward model reads the generator's token ids (same vocabulary), `token_scorer` instead builds
the rendered conversation on device from the template's fixed prefix and suffix ids and the generated
ids themselves, so a search scores its decode buffer without a host round trip. The two agree when
rendering and tokenizing a response's text gives back exactly those ids; sampled ids often are not their
text's canonical tokenization (SmolLM2 samples `ĊĊ` before a digit, its text re-encodes as `Ċ`,`Ċ`), and
`IdScorer.agrees` tells which responses the reward reads the same both ways.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.ladder import bucket, fine_bucket, length_sorted_chunks
from jaxsr.models.model import Model, RewardModel
from jaxsr.rewards.base import Candidates, reward_batch
from jaxsr.sharding import padded_rows, place_rows
from jaxsr.text import Messages, encode, has_chat_template, left_pad, render_chat, same_vocabulary

TokenScorer = Callable[[jax.Array, jax.Array], jax.Array]
"""(response ids [B, N], response lengths [B]) → scores [B], on device."""
_RESPONSE = "\ue000response\ue000"  # a private-use placeholder that no template or prompt contains


@partial(jax.jit, static_argnums=(0, 7))
def _score_ids(graph, params, prefix, prefix_len, suffix, tokens, lengths, width: int) -> jax.Array:
    """Score rows [prefix[:prefix_len] | tokens[b, :lengths[b]] | suffix], right-padded to `width`."""
    j = jnp.arange(width)[None, :]
    n = lengths[:, None]
    response = jnp.take_along_axis(tokens, jnp.clip(j - prefix_len, 0, tokens.shape[1] - 1), axis=1)
    closing = suffix[jnp.clip(j - prefix_len - n, 0, suffix.shape[0] - 1)]
    ids = jnp.where(j < prefix_len, prefix[jnp.minimum(j, prefix.shape[0] - 1)], response)
    ids = jnp.where(j < prefix_len + n, ids, closing)
    mask = j < prefix_len + n + suffix.shape[0]
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(jnp.where(mask, ids, 0), mask)
    return module.scores(hidden, mask)[:, 0]


class ClassifierReward:
    """Renders [user: prompt, assistant: response] with the reward model's own template (a closed
    assistant turn), tokenizes with its tokenizer, and reads the score at the last token. Inputs go to
    the model shortest first, each call's rows and length padded to rungs of `fine_bucket`, so scoring
    pads little and compiles a bounded number of times."""

    def __init__(self, model: RewardModel, batch_size: int | None = None):
        if not isinstance(model, RewardModel):
            raise TypeError(f"reward: expected a jaxsr.RewardModel, got {type(model).__name__}")
        if model.tokenizer is None:
            raise ValueError("reward: the reward model has no tokenizer to render prompts with")
        self.model = model
        self.batch_size = reward_batch(batch_size, accelerated=32)
        self.name = f"classifier:{model.name}"
        self.token_forwards = 0

    def conversation(self, messages: Messages, response: str) -> str | None:
        """The conversation and the response as the assistant's turn, in the reward model's chat
        template (None without one)."""
        tokenizer = self.model.tokenizer
        if not has_chat_template(tokenizer):
            return None
        turns = [*messages, {"role": "assistant", "content": response}]
        try:
            return render_chat(tokenizer, turns, add_generation_prompt=False)
        except Exception as e:
            raise ValueError(f"reward: the reward model's chat template cannot render the prompt: {e}") from e

    def check(self, messages: Messages) -> None:
        """Refuse, before any decoding, a prompt the reward model's template cannot render (with an
        empty answer and a short one: templates may treat the two differently)."""
        for response in ("", "A short answer."):
            self.render(messages, response)

    def render(self, messages: Messages, response: str) -> list[int]:
        """The ids the reward model reads: the conversation with the response, through its template
        (without one: the turns' texts and the response, a line each), its last `context` tokens."""
        tokenizer = self.model.tokenizer
        text = self.conversation(messages, response)
        if text is not None:
            ids = encode(tokenizer, text, special_tokens=False)
        else:
            ids = encode(tokenizer, "\n".join([*(m["content"] for m in messages), response]))
        context = self.model.config.context
        return ids[-context:] if len(ids) > context else ids

    def token_scorer(self, generator: Model, messages: Messages, max_new_tokens: int) -> IdScorer | None:
        """On-device scoring of `generator`'s response ids to `prompt`, or None when the reward model
        does not read the generator's ids (other vocabulary), has no chat template, lives on other
        devices than the decode buffer (another mesh), or the longest rendered response would exceed
        its context (the text path then truncates)."""
        tokenizer = self.model.tokenizer
        if not same_vocabulary(generator.tokenizer, tokenizer):
            return None
        if self.model.mesh != generator.mesh:
            return None
        before, found, after = (self.conversation(messages, _RESPONSE) or "").partition(_RESPONSE)
        if not found:
            return None
        prefix, suffix = (encode(tokenizer, part, special_tokens=False) for part in (before, after))
        prefix_slots = bucket(len(prefix))
        width = bucket(prefix_slots + bucket(max_new_tokens) + len(suffix))
        if width > self.model.config.context or not suffix:
            return None
        padded = np.zeros(prefix_slots, np.int32)
        padded[: len(prefix)] = prefix
        consts = (jnp.asarray(padded), jnp.int32(len(prefix)), jnp.asarray(suffix, jnp.int32))

        def score(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
            self.token_forwards += tokens.shape[0] * width
            graph, params = self.model.graph, self.model.params
            tokens, lengths = place_rows(self.model.mesh, tokens, jnp.asarray(lengths, jnp.int32))
            return _score_ids(graph, params, *consts, tokens, lengths, width)

        return IdScorer(score, self, messages, (prefix, suffix))

    def score(self, candidates: Candidates) -> np.ndarray:
        return self.score_many([candidates])[0]

    def score_many(self, batches: list[Candidates]) -> list[np.ndarray]:
        """Several prompts' responses scored in shared batches, shortest first."""
        encoded = [self.render(c.messages, text) for c in batches for text in c.texts]
        scores = np.zeros(len(encoded), np.float64)
        for chunk in length_sorted_chunks([len(ids) for ids in encoded], self.batch_size):
            rows = padded_rows(fine_bucket(len(chunk)), self.model.mesh)  # splits over `data`
            length = min(fine_bucket(len(encoded[chunk[-1]]), 16), self.model.config.context)
            tokens, mask = left_pad([encoded[i] for i in chunk], rows, length)
            mask[len(chunk) :, -1] = 1  # padding rows score one pad token instead of nothing
            self.token_forwards += rows * length
            scores[chunk] = np.asarray(self.model.scores(tokens, mask))[: len(chunk)]
        return np.split(scores, np.cumsum([len(c) for c in batches])[:-1])


@dataclasses.dataclass(frozen=True)
class IdScorer:
    """A classifier's on-device scorer of one prompt's responses (a `TokenScorer`), and the test of
    which responses it reads as the text path does."""

    score: TokenScorer
    reward: ClassifierReward
    messages: Messages
    frame: tuple[list[int], list[int]]
    """The template's ids before and after the response."""

    def __call__(self, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        return self.score(tokens, lengths)

    def agrees(self, token_ids: list[list[int]], texts: list[str]) -> np.ndarray:
        """[n] bool: whether rendering and tokenizing each response's text gives the reward model the
        ids the device reads (prefix, the response's ids, suffix) — then both paths score the same."""
        prefix, suffix = self.frame
        read = [self.reward.render(self.messages, text) for text in texts]
        return np.array([r == [*prefix, *ids, *suffix] for r, ids in zip(read, token_ids, strict=True)], bool)
