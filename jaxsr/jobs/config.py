"""Job configuration: a YAML file plus `key=value` overrides, checked against a fixed schema.

The reading, type checks and fingerprint are `jaxsr.configs`'s (shared with the fine-tuning configs of
`jaxsr.training`); this module holds the job's schema and what each method reads."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from jaxsr.checks import user_path
from jaxsr.configs import check_field_types, check_mesh_keys, content_fingerprint, load_config
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.models.config import check_kv_dtype, check_weights_dtype

METHODS = (
    "generate",
    "best_of_n",
    "speculative_rejection",
    "speculative_decode",
    "contrastive_decode",
    "speculative_contrastive_decode",
    "tree_best_of_n",
)

# the options of each two-model decoding: a pair method, or the `decoder` a search method runs over
DECODER_OPTIONS: dict[str, tuple[str, ...]] = {
    "speculative": ("gamma",),
    "contrastive": ("alpha", "beta"),
    "speculative_contrastive": ("gamma", "alpha", "beta"),
}
DECODERS = tuple(DECODER_OPTIONS)
PAIR_METHODS = {f"{kind}_decode": kind for kind in DECODERS}
"""Two-model decoding methods → their decoding kind."""
SEARCH_METHODS = ("best_of_n", "speculative_rejection", "tree_best_of_n")
CONTROL_KEYS = (
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalize_prompt",
    "forbidden_token_ids",
    "stop_token_ids",
    "stop",
)
"""The sampling controls every method reads (added after job files existed)."""
SHARED_KEYS = frozenset(
    [
        "method",
        "model",
        "data",
        "limit",
        "output",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        *CONTROL_KEYS,
        "seed",
        "dtype",
        "kv_dtype",
        "weights_dtype",
        "chat",
        "mesh_data",
        "mesh_model",
        "prompt_field",
        "messages_field",
        "system_prompt",
        "keep_token_ids",
        "keep_samples",
    ]
)
PLACEMENT_KEYS = ("output", "mesh_data", "mesh_model", "concurrent_prompts", "max_rows")
"""Where a job writes and how it uses its devices: not part of what it computes (results are the same
on any mesh and with any number of prompts searched at once), so a job may resume elsewhere."""
LATER_KEYS = (
    "min_first_segment",
    "decision_interval",
    "rule",
    "min_keep",
    "prompt_field",
    "messages_field",
    "system_prompt",
    "keep_token_ids",
    "keep_samples",
    "keep_rejected",
    "kv_dtype",
    "branch",
    "layers",
    "weights_dtype",
    *CONTROL_KEYS,
)
"""Keys added after job files existed: at their defaults they leave a job's fingerprint as it was, so
the output of a job started before them still resumes."""
SR_OPTIONS = ("min_first_segment", "decision_interval", "rule", "min_keep", "keep_rejected")
"""speculative_rejection's own options."""
GROWING_KEYS = ("limit",)
"""Keys a job may change between runs and stay the same job: how many of the data's prompts it answers
(records are keyed by prompt index, so a larger limit adds records, a smaller one is already done)."""
RULES = ("keep_fraction", "quantile")


BUILT_IN_REWARDS = ("self_likelihood", "neg_perplexity", "self_certainty", "minilm")
"""The rewards a job names without a model path (`loading.resolve.resolve_reward`): no reward model of
their own to plan (minilm's encoder is small; the others read the generator's sampling logits)."""


def _check_reward_name(reward: str | None) -> None:
    """A reward spelled like a built-in one but not exactly (`self-certainty`) is refused from the config
    alone, naming the built-in: it would be looked up as a hub id after the generator loads."""
    if reward is None or reward in BUILT_IN_REWARDS or Path(reward).expanduser().exists():
        return
    near = difflib.get_close_matches(reward.lower().replace("-", "_"), BUILT_IN_REWARDS, n=1, cutoff=0.8)
    if near:
        raise ValueError(
            f"reward: {reward!r} is no built-in reward; did you mean {near[0]}? (a reward model is named "
            "by its path or hub id)"
        )


@dataclasses.dataclass
class JobConfig:
    """A dataset-generation job. Every key a YAML file or override may set is a field here."""

    method: str = "generate"
    model: str = "smollm2"
    """A checkpoint directory, a .gguf file, a hub id, or `smollm2` (the embedded default)."""
    reward: str | None = None
    """Reward for the searches: `self_likelihood`, `self_certainty` (the generator's confidence, no reward
    model), `minilm`, or a reward-model path."""
    data: str = "alpaca_farm_100"
    """A JSON list, JSONL or Parquet file of records holding a prompt (a string or a conversation), or a
    set's name (`jaxsr.data`)."""
    prompt_field: str | None = None
    """The data's column holding each prompt, a string or a conversation (None: `messages`, else `prompt`)."""
    messages_field: str | None = None
    """The data's column holding each prompt as a conversation ({"role", "content"} messages)."""
    system_prompt: str | None = None
    """A system message put first in every prompt that has none."""
    limit: int | None = None
    output: str = "out/job.jsonl"
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalize_prompt: bool = True
    """Whether `repetition_penalty` counts the prompt's tokens too (as transformers and vLLM do)."""
    forbidden_token_ids: list[int] | None = None
    """Token ids never drawn."""
    stop_token_ids: list[int] | None = None
    """Ids that end a response besides the model's EOS ids."""
    stop: str | list[str] | None = None
    """Strings that end a response where its text shows one (the stored text cut before it); one string
    is a list of one."""
    num_samples: int = 1
    max_rows: int | None = None
    """Most rows decoded together (generate, two-model methods, best_of_n; None: what a GPU's or TPU's
    free memory holds, or best_of_n's memory budget; on CPU without a budget 64 a `data` shard)."""
    n: int | None = None
    draft: str | None = None
    """The second model of speculative_decode (draft) and (speculative_)contrastive_decode (amateur),
    or of the `decoder` that best_of_n / speculative_rejection search over."""
    decoder: str | None = None
    """best_of_n / speculative_rejection over `speculative`, `contrastive` or `speculative_contrastive`
    decoding of (model, draft) instead of plain sampling."""
    gamma: int = 4
    alpha: float = 0.1
    beta: float = 0.5
    rejection_rate: float = 0.5
    memory_budget: int | str | None = None
    """KV budget of each prompt's search (token slots or bytes); None derives it from the device."""
    concurrent_prompts: int = 4
    """speculative_rejection: prompts searched at once, each in its own budget, their rows decoded
    together (with memory_budget=None the devices' free memory is split among them)."""
    min_first_segment: int = 16
    """speculative_rejection: tokens every first row gets before the first decision (a smaller one starts
    more rows in the same memory)."""
    decision_interval: int | None = None
    """speculative_rejection: decide every this many tokens too, not only when the memory is full."""
    rule: str = "keep_fraction"
    """speculative_rejection: `keep_fraction` (the reference's: the round((1-α)·pool) best) or
    `quantile` (the paper's: scores at or above the α-quantile)."""
    min_keep: int = 1
    """speculative_rejection: the fewest responses a decision keeps (0: the reference's count)."""
    keep_rejected: bool = False
    """speculative_rejection: store the partial responses each decision stopped (`rejected`)."""
    branch: int = 4
    """tree_best_of_n: children of each row a layer's end keeps (n / branch rows are kept)."""
    layers: int = 4
    """tree_best_of_n: layers the response is grown in (max_new_tokens / layers tokens each)."""
    keep_token_ids: bool = True
    """Store each sample's token ids (False: the text and their count, `num_tokens`: a smaller output)."""
    keep_samples: bool = True
    """Store every sample (False: only the best, in `best`)."""
    seed: int = 0
    dtype: str = "float32"
    kv_dtype: str | None = None
    """The KV cache of `model` and `draft`: None (in `dtype`) or `int8` (int8 keys and values with a
    float32 scale per token and KV head: a memory budget in bytes holds about 2× the rows of bfloat16,
    4× float32). Sampling is from the models with that cache; reward models keep theirs in `dtype`."""
    weights_dtype: str | None = None
    """The weights of `model` and `draft`: None (in `dtype`) or `int8` (their projection, embedding and
    output matrices as int8 with a scale per output channel: about half the parameter bytes of bfloat16,
    a quarter of float32). Sampling is from the quantized models; reward models keep `dtype`."""
    chat: bool | None = None
    mesh_data: int | None = None
    """Split each batch's rows over this many of the host's devices (-1: all left after `mesh_model`).
    None with `mesh_model=1`: no mesh, one device."""
    mesh_model: int = 1
    """Split attention heads and MLP columns (and the vocabulary) over this many devices."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        check_field_types(self)
        self.output = str(user_path("output", self.output))
        if not self.output.endswith(".jsonl"):
            raise ValueError(f"output: expected a path ending in .jsonl, got {self.output!r}")
        if self.decoder is not None and self.decoder not in DECODERS:
            raise ValueError(f"decoder: expected one of {DECODERS} or None, got {self.decoder!r}")
        for name in (
            "limit",
            "num_samples",
            "n",
            "concurrent_prompts",
            "min_first_segment",
            "decision_interval",
            "max_rows",
            "branch",
            "layers",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        if self.prompt_field is not None and self.messages_field is not None:
            raise ValueError("prompt_field, messages_field: set one of them (the column holding the prompt)")
        if self.rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {self.rule!r}")
        if self.min_keep not in (0, 1):
            raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {self.min_keep}")
        self.sampling()
        negative = [i for i in self.stop_token_ids or () if i < 0]
        if negative:
            raise ValueError(f"stop_token_ids: token ids are >= 0, got {negative[0]}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # one job, resumed alike, whichever way it is written
        if "" in (self.stop or ()):
            raise ValueError("stop: expected non-empty strings, got ''")
        check_kv_dtype(self.kv_dtype)
        check_weights_dtype(self.weights_dtype)
        check_mesh_keys(self)
        self._check_needs()
        used = self.used_keys()
        for field in dataclasses.fields(self):
            if field.name not in used and getattr(self, field.name) != field.default:
                raise ValueError(
                    f"{field.name}: method={self.method}"
                    + (f" with decoder={self.decoder}" if self.decoder else "")
                    + f" does not use it (it uses {', '.join(sorted(used - SHARED_KEYS))})"
                )

    def sampling(self) -> SamplingConfig:
        """How the job draws tokens: its keys named as `SamplingConfig`'s fields (a bad value refused
        naming its key)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(SamplingConfig)}
        return SamplingConfig(**values | {"forbidden_token_ids": tuple(self.forbidden_token_ids or ())})

    def _check_needs(self) -> None:
        """Refuse, from the config alone, a method missing what it needs: before the data is read, a
        file written or a model loaded."""
        if self.draft is None and (self.method in PAIR_METHODS or self.decoder is not None):
            needs = f"decoder={self.decoder}" if self.decoder is not None else self.method
            raise ValueError(f"draft: {needs} needs a second model (the draft or amateur)")
        if self.method in SEARCH_METHODS and self.reward is None:
            raise ValueError(f"reward: {self.method} needs a reward (self_likelihood, minilm, or a path)")
        _check_reward_name(self.reward)
        if self.method in ("best_of_n", "tree_best_of_n") and self.n is None:
            raise ValueError(f"n: {self.method} needs n (the samples per prompt)")
        if self.method == "tree_best_of_n" and self.n % self.branch:
            raise ValueError(
                f"branch: expected a divisor of n={self.n} (a layer keeps n / branch rows), got {self.branch}"
            )
        if self.chat is False and self.system_prompt is not None:
            raise ValueError(
                "system_prompt: a system message needs the chat template; chat: false sends plain text"
            )

    def used_keys(self) -> frozenset[str]:
        """The keys this job's method reads (a key it ignores must keep its default)."""
        if self.method == "generate":
            return SHARED_KEYS | {"num_samples", "max_rows"}
        if self.method in PAIR_METHODS:
            return SHARED_KEYS | {
                "num_samples",
                "max_rows",
                "draft",
                *DECODER_OPTIONS[PAIR_METHODS[self.method]],
            }
        keys = SHARED_KEYS | {"reward", "n", "decoder"}
        if self.method == "speculative_rejection":
            keys |= {"memory_budget", "rejection_rate", "concurrent_prompts", *SR_OPTIONS}
        elif self.method == "tree_best_of_n":
            keys |= {"branch", "layers", "concurrent_prompts"}
        else:
            keys |= {"memory_budget", "max_rows"}
        if self.decoder is not None:
            keys |= {"draft", *DECODER_OPTIONS[self.decoder]}
        return keys

    def fingerprint(self) -> str:
        """Identifies the job's content (everything but where it is written and run; `LATER_KEYS` only
        when set)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unset = tuple(key for key in LATER_KEYS if getattr(self, key) == defaults[key])
        return content_fingerprint(self, PLACEMENT_KEYS + unset)

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """The keys that make this a different job from the one `stored` (a job file's config) names,
        each as `key: old -> new` (placement and growing keys aside; a later key absent from `stored`
        had its default)."""
        differing = []
        for field in dataclasses.fields(self):
            if field.name in PLACEMENT_KEYS + GROWING_KEYS:
                continue
            old = stored.get(field.name, field.default if field.name in LATER_KEYS else None)
            new = getattr(self, field.name)
            if (field.name not in stored and field.name not in LATER_KEYS) or old != new:
                differing.append(f"{field.name}: {old!r} -> {new!r}")
        return differing


def load_job_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Read `path` (YAML mapping) and apply `key=value` overrides; unknown keys get a suggestion."""
    return load_config(JobConfig, path, overrides)
