"""Job configuration: a YAML file plus `key=value` overrides, checked against a fixed schema.

`load_config`, `check_field_types` and `content_fingerprint` serve any config dataclass (the
fine-tuning config of `jaxsr.training` too), so every config reads, refuses and identifies alike."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from jaxsr.checks import check_number, is_int, is_real
from jaxsr.loading.files import MissingFileError

C = TypeVar("C")

METHODS = (
    "generate",
    "best_of_n",
    "speculative_rejection",
    "speculative_decode",
    "contrastive_decode",
    "speculative_contrastive_decode",
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
        "seed",
        "dtype",
        "chat",
        "mesh_data",
        "mesh_model",
    ]
)
PLACEMENT_KEYS = ("output", "mesh_data", "mesh_model", "concurrent_prompts")
"""Where a job writes and how it uses its devices: not part of what it computes (results are the same
on any mesh and with any number of prompts searched at once), so a job may resume elsewhere."""
LATER_KEYS = ("min_first_segment", "decision_interval", "rule", "min_keep")
"""Keys added after job files existed: at their defaults they leave a job's fingerprint as it was, so
the output of a job started before them still resumes."""
RULES = ("keep_fraction", "quantile")


@dataclasses.dataclass
class JobConfig:
    """A dataset-generation job. Every key a YAML file or override may set is a field here."""

    method: str = "generate"
    model: str = "smollm2"
    """A checkpoint directory, a .gguf file, a hub id, or `smollm2` (the embedded default)."""
    reward: str | None = None
    """Reward for best_of_n / speculative_rejection: `self_likelihood`, `minilm`, or a reward-model path."""
    data: str = "alpaca_farm_100"
    """A JSON list / JSONL file of records with a `prompt` field, or a bundled set's name."""
    limit: int | None = None
    output: str = "out/job.jsonl"
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    num_samples: int = 1
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
    together (with memory_budget=None the device's free memory is split among them)."""
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
    seed: int = 0
    dtype: str = "float32"
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
        if not self.output.endswith(".jsonl"):
            raise ValueError(f"output: expected a path ending in .jsonl, got {self.output!r}")
        if self.decoder is not None and self.decoder not in DECODERS:
            raise ValueError(f"decoder: expected one of {DECODERS} or None, got {self.decoder!r}")
        for name in ("limit", "n", "concurrent_prompts", "min_first_segment", "decision_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        if self.rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {self.rule!r}")
        if self.min_keep not in (0, 1):
            raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {self.min_keep}")
        check_mesh_keys(self)
        used = self.used_keys()
        for field in dataclasses.fields(self):
            if field.name not in used and getattr(self, field.name) != field.default:
                raise ValueError(
                    f"{field.name}: method={self.method}"
                    + (f" with decoder={self.decoder}" if self.decoder else "")
                    + f" does not use it (it uses {', '.join(sorted(used - SHARED_KEYS))})"
                )

    def used_keys(self) -> frozenset[str]:
        """The keys this job's method reads (a key it ignores must keep its default)."""
        if self.method == "generate":
            return SHARED_KEYS | {"num_samples"}
        if self.method in PAIR_METHODS:
            return SHARED_KEYS | {"num_samples", "draft", *DECODER_OPTIONS[PAIR_METHODS[self.method]]}
        keys = SHARED_KEYS | {"reward", "n", "memory_budget", "decoder"}
        if self.method == "speculative_rejection":
            keys |= {"rejection_rate", "concurrent_prompts", *LATER_KEYS}
        if self.decoder is not None:
            keys |= {"draft", *DECODER_OPTIONS[self.decoder]}
        return keys

    def fingerprint(self) -> str:
        """Identifies the job's content (everything but where it is written and run; `LATER_KEYS` only
        when set)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unset = tuple(key for key in LATER_KEYS if getattr(self, key) == defaults[key])
        return content_fingerprint(self, PLACEMENT_KEYS + unset)


def content_fingerprint(config: Any, placement_keys: tuple[str, ...]) -> str:
    """A short hash of a config dataclass's fields, those in `placement_keys` left out."""
    content = {k: v for k, v in dataclasses.asdict(config).items() if k not in placement_keys}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def check_field_types(config: Any) -> None:
    """Refuse (ValueError naming the key) a field of the config dataclass whose value is not of its
    annotated type; NumPy numbers become Python ones, ints given for float fields floats (see
    `jaxsr.checks.is_real`), and a float field must be finite. Checks the seed's range too, which every
    config has."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        allowed = typing.get_args(hints[field.name]) or (hints[field.name],)
        if float in allowed and is_real(value):
            setattr(config, field.name, check_number(field.name, value))  # no field means NaN or inf
            continue
        if int in allowed and is_int(value):
            setattr(config, field.name, int(value))
            continue
        if not any(_is_instance(value, t) for t in allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{field.name}: expected {names}, got {value!r}")
    if not 0 <= config.seed < 2**32:
        raise ValueError(f"seed: expected an int in [0, 2**32), got {config.seed}")


def check_mesh_keys(config: Any) -> None:
    """`mesh_data` is -1 (all devices), None or >= 1; `mesh_model` >= 1."""
    if config.mesh_model < 1:
        raise ValueError(f"mesh_model: expected an int >= 1, got {config.mesh_model}")
    if config.mesh_data is not None and not (config.mesh_data == -1 or config.mesh_data >= 1):
        raise ValueError(f"mesh_data: expected -1 (all devices) or an int >= 1, got {config.mesh_data}")


def _is_instance(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


class _PlainLoader(yaml.SafeLoader):
    """YAML without aliases (`*name`): a config has no use for them, and nested aliases expand
    exponentially (a few lines can ask for gigabytes). A key given twice is refused (YAML would keep
    the last value silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # an unhashable key: the base class refuses it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a config", event.start_mark
            )
        return super().compose_node(parent, index)


def _parse_value(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_PlainLoader) if text != "" else ""
    except yaml.YAMLError:
        return text  # not YAML (e.g. `output=[a`): the text itself, which the field's check judges


def load_job_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Read `path` (YAML mapping) and apply `key=value` overrides; unknown keys get a suggestion."""
    return load_config(JobConfig, path, overrides)


def load_config(kind: type[C], path: str | Path | None, overrides: Sequence[str] = ()) -> C:
    """The config dataclass `kind` from `path` (a YAML mapping of its fields, None: the defaults) with
    `key=value` overrides applied; unknown keys get a suggestion."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.load(Path(path).read_bytes().decode("utf-8"), Loader=_PlainLoader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"{path}{where}: not valid YAML ({problem})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply to be a config") from None
        except FileNotFoundError:
            raise MissingFileError(f"{path}: the config does not exist") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot read the config ({e.strerror or e})") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        values.update(loaded)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, _, text = item.partition("=")
        values[key.strip()] = _parse_value(text)
    known = [f.name for f in dataclasses.fields(kind)]
    for key in values:
        if not isinstance(key, str):
            raise ValueError(f"config key {key!r}: expected a name (one of {', '.join(known)})")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            raise ValueError(f"config key {key!r} does not exist{hint}")
    return kind(**values)
