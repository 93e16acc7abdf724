"""TreeBoN (Qiu et al., arXiv 2410.16033): Best-of-N as a tree search.

N rows decode the first layer of a response (`max_new_tokens / layers` tokens); at each layer's end the
unfinished rows' partial responses are scored, the best N / branch survive and each branches into
`branch` children that decode the next layer — every child from its parent's tokens and row cache (a
gather with repeats: nothing is prefilled again). The first child keeps its parent's sample index and
random stream, the others take new ones, so the tree stays N rows wide. A response that finished (EOS)
leaves the tree as a candidate; the answer is the best of those and the last layer's rows.

The paper prunes with a token-level implicit reward, log π − log π_ref of a DPO-tuned policy against its
reference (`jaxsr.rewards.ImplicitReward`), and any jaxsr reward works here as it does for Best-of-N.
With `branch=1` nothing is pruned and each row keeps its own stream: the search is Best-of-N.

It runs on the one search scheduler (`jaxsr.search.scheduler`, as Speculative Rejection does):
`concurrent_prompts` prompts' trees decode in one batch, and each prompt's result is the one it gets
searched alone. Every layer's batch has the same N rows (children fill them; rows a layer leaves
empty are dead), so a search compiles one decode program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from jaxsr.checks import check_callback, check_positive_int, check_responses_fit
from jaxsr.decoding.driver import Sampler, as_sampler
from jaxsr.decoding.inputs import Options, prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.search.candidates import check_reward
from jaxsr.search.scheduler import Batch, Decision, PromptSearch, run_searches


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """How one prompt's tree grows: `n` rows a layer, `branch` children per survivor, layers of
    `layer_tokens` tokens, row caches of `segment` slots."""

    n: int
    branch: int
    layer_tokens: int
    max_new_tokens: int
    segment: int

    @property
    def survivors(self) -> int:
        """Unfinished rows a layer's end keeps (each then branches)."""
        return self.n // self.branch


class Tree:
    """TreeBoN's `Policy` for one prompt: the candidates that left the tree and the log of its layers."""

    def __init__(self, shape: TreeShape, prompt_slots: int):
        self.shape, self.prompt_slots = shape, prompt_slots
        self.done: list[Sample] = []
        """Responses that finished before the last layer (they leave the tree as candidates)."""
        self.next_id = shape.n
        """The sample index (random stream) of the next new child."""
        self.layers: list[dict[str, int]] = []

    def first_batch(self) -> Batch:
        return Batch(self.shape.n, self.shape.segment)

    def round_end(self, generated: int, segment: int) -> int:
        """The end of the layer `generated` tokens are in."""
        layer = self.shape.layer_tokens
        return min(self.shape.max_new_tokens, (generated // layer + 1) * layer)

    def decide(self, samples: list[Sample], generated: int) -> Decision | None:
        """Finished responses leave the tree; the best unfinished rows branch."""
        shape = self.shape
        complete = [s.finished or len(s.token_ids) >= shape.max_new_tokens for s in samples]
        growing = [j for j, c in enumerate(complete) if not c]
        if not growing:
            return None
        order = sorted(growing, key=lambda j: -samples[j].score)  # stable: ties in row order
        parents = order[: shape.survivors]
        keep = [j for j in parents for _ in range(shape.branch)]
        ids = [samples[j].index if c == 0 else self._new_id() for j in parents for c in range(shape.branch)]
        self.done += [s for s, c in zip(samples, complete, strict=True) if c]
        self.layers.append({"token": generated, "growing": len(growing), "kept": len(parents)})
        return Decision(keep, Batch(shape.n, shape.segment), ids)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def final(self, samples: list[Sample]) -> list[Sample]:
        """The candidates that left the tree and the last layer's rows, by sample index."""
        return sorted([*self.done, *samples], key=lambda s: s.index)

    def stats(self) -> dict[str, Any]:
        shape = self.shape
        return {
            "n": shape.n,
            "branch": shape.branch,
            "layer_tokens": shape.layer_tokens,
            "layers": self.layers,
        }


def tree_best_of_n(
    model: Model | Sampler,
    reward: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int,
    branch: int = 4,
    layers: int = 4,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    min_prompt_bucket: int = 16,
    concurrent_prompts: int = 1,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    prompt_offset: int | Sequence[int] = 0,
    on_result: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """TreeBoN per prompt (see the module docstring): `n` rows a layer, `layers` layers of
    ⌈max_new_tokens / layers⌉ tokens, the best n / branch unfinished rows of a layer (by `reward` of
    their partial responses; `branch` must divide `n`) each branching into `branch` children. `model`
    is a language model or a two-model sampler; `concurrent_prompts`, `min_prompt_bucket` and
    `on_result` as in `speculative_rejection`. `Result.stats["layers"]` logs each layer's end: its
    token, the rows still growing and the survivors kept."""
    sampler = as_sampler(model, sampling)
    reward = as_reward(reward)
    n, branch = check_positive_int("n", n), check_positive_int("branch", branch)
    if n % branch:  # n // branch survivors of branch children each: the tree stays n rows wide
        raise ValueError(f"branch: expected a divisor of n={n} (a layer keeps n / branch rows), got {branch}")
    layers = check_positive_int("layers", layers)
    min_prompt_bucket = check_positive_int("min_prompt_bucket", min_prompt_bucket)
    concurrent_prompts = check_positive_int("concurrent_prompts", concurrent_prompts)
    check_callback("on_result", on_result)
    options = Options(max_new_tokens, sampler.sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    request = prepare(sampler.models, prompts, options)
    check_reward(reward, sampler.target, prompts, request.encoded)
    new = request.max_new_tokens
    check_responses_fit("n", len(request.encoded) * n, new)
    segment = sampler.cache_slots(bucket(new)) - sampler.headroom  # whole rows, in whole tiles
    shape = TreeShape(n, branch, math.ceil(new / layers), new, segment)
    searches = [
        PromptSearch(sampler, reward, request, i, Tree(shape, bucket(len(ids), min_prompt_bucket)))
        for i, ids in enumerate(request.encoded)
    ]
    with sampler.on_mesh():
        ended = None if on_result is None else lambda search: on_result(search.index, search.result())
        run_searches(sampler, searches, min(concurrent_prompts, len(searches)), ended)
    return [s.result() for s in searches]
