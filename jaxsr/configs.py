"""Config dataclasses read from YAML: a file plus `key=value` overrides, checked against the dataclass's
fields (unknown keys get a suggestion, values must be of their field's type), and identified by a
content fingerprint. Every config (a job's, a fine-tuning run's) reads, refuses and identifies alike."""

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

from jaxsr.checks import check_number, check_unicode, is_int, is_real
from jaxsr.loading.files import MissingFileError, read_small

C = TypeVar("C")


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
            names = " or ".join(_type_name(t) for t in allowed)
            raise ValueError(f"{field.name}: expected {names}, got {value!r}")
        for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            if isinstance(text, str):  # written to the job file and every record's provenance as UTF-8
                check_unicode(field.name, text)
    if not 0 <= config.seed < 2**32:
        raise ValueError(f"seed: expected an int in [0, 2**32), got {config.seed}")


def check_mesh_keys(config: Any) -> None:
    """`mesh_data` is -1 (all devices), None or >= 1; `mesh_model` >= 1."""
    if config.mesh_model < 1:
        raise ValueError(f"mesh_model: expected an int >= 1, got {config.mesh_model}")
    if config.mesh_data is not None and not (config.mesh_data == -1 or config.mesh_data >= 1):
        raise ValueError(f"mesh_data: expected -1 (all devices) or an int >= 1, got {config.mesh_data}")


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "None"
    if typing.get_origin(kind) is list:
        return f"a list of {typing.get_args(kind)[0].__name__}s"
    return kind.__name__


def _is_instance(value: Any, kind: Any) -> bool:
    """`isinstance`, where a bool is no int and `list[int]` means a list of ints."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_is_instance(v, item) for v in value)
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


def load_config(kind: type[C], path: str | Path | None, overrides: Sequence[str] = ()) -> C:
    """The config dataclass `kind` from `path` (a YAML mapping of its fields, None: the defaults) with
    `key=value` overrides applied; unknown keys get a suggestion."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.load(read_small(Path(path)).decode("utf-8"), Loader=_PlainLoader) or {}
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
