"""Chat templates rendered as transformers renders them, in a jinja sandbox that also bounds their
work: a template (untrusted code from a checkpoint) cannot loop without end nor build gigabytes of text.

Transformers' environment (options, extensions, filters, globals) is copied from the one its own
`apply_chat_template` compiles with, and the template sees the variables it passes (the messages as
plain data, `add_generation_prompt`, the tokenizer's special tokens, no tools or documents). On top:

- a line budget: the template's compiled code runs at most `LINE_BUDGET` lines (loops that never end);
- a size budget: no value the template builds (a string, a list, the rendering itself) holds more than
  `SIZE_BUDGET` characters or elements (or the conversation's length, four times over, if that is more),
  and no int more than `INT_BITS` bits. Operations that could blow up in one step (`*`, `**`, `%`,
  padding, `replace`, `join`, `indent`, `wordwrap`, `batch`, `slice`, `sum`, `tojson`'s indent) are
  checked before they run, everything else (`+`, `~`, the other filters and calls) on its result;
  jinja's sandbox already caps `range` at 100 000 items.
"""

from __future__ import annotations

import contextvars
import functools
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

LINE_BUDGET = 2_000_000
"""Lines of a template's compiled code one rendering may run (a normal template runs thousands)."""
SIZE_BUDGET = 1_000_000
"""Characters (or list elements) any one value of a rendering may hold, the rendering included."""
INT_BITS = 2**16
"""Bits an int of a rendering may hold (about 20 000 digits)."""


class TemplateOverBudget(Exception):
    """A rendering went past its line or size budget (the message says which)."""


_budget: contextvars.ContextVar[int] = contextvars.ContextVar("chat_template_budget", default=SIZE_BUDGET)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict | set | frozenset) else 0


def _refuse_size(size: int, what: str) -> None:
    if size > _budget.get():
        raise TemplateOverBudget(
            f"{what} would hold {size} characters or elements, over the budget of {_budget.get()}"
        )


def _bounded(value: Any) -> Any:
    """`value`, if it is within the size budget."""
    _refuse_size(_size(value), "a value")
    if isinstance(value, int) and value.bit_length() > INT_BITS:
        raise TemplateOverBudget(f"an int of {value.bit_length()} bits, over the budget of {INT_BITS}")
    return value


def bounded_concat(pieces: Iterable[Any]) -> str:
    """`"".join(pieces)`, refused as soon as the pieces add up past the size budget (before joining)."""
    kept, total = [], 0
    for piece in pieces:
        total += len(piece)
        _refuse_size(total, "the text")
        kept.append(piece)
    return "".join(kept)


def _str_join(pieces: Iterable[Any]) -> str:
    """`~`: the pieces as text, each sized before it is written out."""
    return bounded_concat(str(_as_text(piece)) for piece in pieces)


def _as_text(value: Any) -> Any:
    """`value` (what the template outputs or joins), once its text is known to fit the budget."""
    if not isinstance(value, str):
        _refuse_size(_text_size(value), "the text of a value")
    return value


def _materialized(value: Any) -> Any:
    """An iterator (`map`, `select`, ... give them) as a list, built only while its items' text fits
    the budget: sizing it must not consume what the filter reads."""
    if not isinstance(value, Iterator):
        return value
    items, total = [], 0
    for item in value:
        total += _text_size(item)
        _refuse_size(total, "a sequence")
        items.append(item)
    return items


def _text_size(value: Any, indent: int = 0, depth: int = 0, memo: dict[int, int] | None = None) -> int:
    """About how many characters `str(value)` or its JSON (with `indent`) takes, within a constant
    factor (escapes), without building it; refused as soon as it is past the budget. Values met again
    (a list of one string many times over) are sized once."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, str):
        size = len(value) + 2
    elif isinstance(value, Namespace):
        size = _text_size(value._Namespace__attrs, indent, depth, memo)  # type: ignore[attr-defined]
    elif isinstance(value, dict):
        items = [x for kv in value.items() for x in kv]
        size = sum(_text_size(x, indent, depth + 1, memo) for x in items) + len(items) * (2 + depth * indent)
    elif isinstance(value, list | tuple | set | frozenset):
        size = sum(_text_size(x, indent, depth + 1, memo) + 2 + depth * indent for x in value)
    else:
        size = value.bit_length() // 3 + 2 if isinstance(value, int) else len(repr(value))
    _refuse_size(size, "the text of a value")
    memo[id(value)] = size
    return size


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _widest(template: str, args: tuple[Any, ...]) -> int:
    """The largest width or precision a `%` or `str.format` string could pad to: its largest number,
    or (for widths taken from the arguments, `*` or `{}`) the largest int among them."""
    numbers = [int(n) for n in re.findall(r"\d+", template)]
    numbers += [abs(n) for n in map(_int, args) if n is not None]
    return max(numbers, default=0)


def _estimate(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """An upper bound on the size of what the amplifying operation `name` would build, before it runs
    (None: not an amplifier, or arguments it will refuse itself)."""
    arg = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):  # the filter takes any value, as its text
        width = _int(arg if args else kwargs.get("width", 80))
        return max(_text_size(value), width or 0)
    if name == "expandtabs" and isinstance(value, str):
        return len(value) * (1 + max(_int(arg if args else kwargs.get("tabsize", 8)) or 0, 0))
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            return len(value) + value.count(old) * max(len(new) - len(old), 0)
    if name == "format" or name == "%":
        return _widest(value, (*args, *kwargs.values())) + len(value) if isinstance(value, str) else None
    if name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else _int(width) or 0
        return len(value) * (1 + width)
    if name == "wordwrap" and isinstance(value, str):
        width = _int(arg if args else kwargs.get("width", 79)) or 1
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
        return len(value) + (len(value) // max(width, 1) + 1) * (len(wrap) if isinstance(wrap, str) else 1)
    if name in ("batch", "slice"):
        return _int(arg if args else kwargs.get("linecount", kwargs.get("slices")))
    if name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        width = len(indent) if isinstance(indent, str) else _int(indent) or 0
        _refuse_size(width, "an indentation")  # one level's is built whole before anything is written
        return _text_size(value, width)
    if name in ("string", "pprint"):
        return _text_size(value)
    if name == "join" and isinstance(value, Iterable) and not isinstance(value, str | dict):
        if "attribute" in kwargs:
            return None
        items = list(value)
        separator = arg if args else kwargs.get("d", "")
        return sum(_text_size(x) for x in items) + _text_size(separator) * len(items)
    if name == "sum":
        start = kwargs.get("start", args[1] if len(args) > 1 else 0)
        if isinstance(start, str | list | tuple) and "attribute" not in kwargs and not (args and args[0]):
            return _size(start) + sum(_size(x) for x in value)
    return None


def _check(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    estimate = _estimate(name, value, args, kwargs)
    if estimate is not None:
        _refuse_size(estimate, f"{name!r}")


def _bounded_filter(name: str, filter: Callable[..., Any]) -> Callable[..., Any]:
    """`filter`, its amplifying calls refused before they run and its results checked."""
    passes = 1 if hasattr(filter, "jinja_pass_arg") else 0

    @functools.wraps(filter)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        args = tuple(map(_materialized, args))
        if len(args) > passes:
            _check(name, args[passes], args[passes + 1 :], kwargs)
        return _bounded(filter(*args, **kwargs))

    return bounded


class _CodeGenerator(CodeGenerator):
    """Jinja's compiler, the joins of the compiled module (`~`, blocks, macros, `set` blocks) bounded."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        super().visit_Template(node, frame)
        self.writeline("concat = environment.concat")
        self.writeline("str_join = environment.str_join")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every value a template builds held within the size budget."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+", "-", "//", "/"})
    concat = staticmethod(bounded_concat)
    str_join = staticmethod(_str_join)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _size(seq) and _int(times) is not None:
                    _refuse_size(len(seq) * times, "'*'")
        elif operator == "**" and _int(left) is not None and _int(right) is not None and abs(left) > 1:
            if right * left.bit_length() > INT_BITS:
                raise TemplateOverBudget(f"'**' would build an int of about {right * left.bit_length()} bits")
        elif operator == "%":
            _check("%", left, right if isinstance(right, tuple) else (right,), {})
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(map(_materialized, args))
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format and format_map
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name == "join":
                _check("join", args[0] if args else (), (owner,), {})
            else:
                _check("format" if name == "format_map" else name, owner, args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))


@functools.cache
def environment() -> BoundedEnvironment:
    """A bounded environment configured as transformers configures its own."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs = _compile_jinja_template("").environment
    ours = BoundedEnvironment(
        trim_blocks=theirs.trim_blocks,
        lstrip_blocks=theirs.lstrip_blocks,
        finalize=_as_text,  # what `{{ value }}` outputs, sized before it becomes text
        extensions=[type(e) for e in theirs.extensions.values()],
    )
    ours.globals.update(theirs.globals)
    ours.tests.update(theirs.tests)
    ours.filters.update({name: _bounded_filter(name, f) for name, f in theirs.filters.items()})
    return ours


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    return environment().from_string(template)


class _LineBudget:
    """A trace function that counts the lines compiled template code runs and stops it past a budget.
    Only template frames are traced line by line; every other frame runs untraced."""

    def __init__(self, lines: int):
        self.left = lines

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise TemplateOverBudget(
                    f"still rendering after {LINE_BUDGET} template lines (it loops without end)"
                )
        return self.line


def render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`, rendered
    within the budgets (TemplateOverBudget past them; the template's own errors as they come)."""
    from transformers.utils import chat_template_utils as ctu

    template = _compiled(tokenizer.get_chat_template())
    chat = ctu._alias_reasoning_fields(ctu._plain_template_data(ctu._normalize_chat_messages(messages)))
    variables = ctu._plain_template_data(dict(tokenizer.special_tokens_map))
    text_size = sum(len(str(m.get("content", ""))) for m in chat)
    budget = _budget.set(max(SIZE_BUDGET, 4 * text_size))
    previous = sys.gettrace()
    sys.settrace(_LineBudget(LINE_BUDGET))
    try:
        return template.render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    finally:
        sys.settrace(previous)
        _budget.reset(budget)
