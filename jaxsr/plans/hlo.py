"""Collectives in a compiled program's HLO text: how often each kind runs, in the whole program and in
one step of its loop, and the shapes all-gathers assemble (a KV cache among them would be gathered
whole onto every device)."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter", "all-to-all")

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_CALLED = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)|computations=\{([^}]*)\}")
_OP = re.compile(r"= (\S.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_LOOP = re.compile(r"\b(?:condition|body)=%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The module's computations (name → instruction lines) and the entry computation's name."""
    found: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = found.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return found, entry


def reachable(module: dict[str, list[str]], roots: Sequence[str]) -> list[str]:
    """`roots` and every computation they call, directly or not (fusions, loops, reductions)."""
    seen, todo = set(roots), list(roots)
    while todo:
        for line in module[todo.pop()]:
            for name, group in _CALLED.findall(line):
                for callee in [name] if name else re.findall(r"%([\w.\-]+)", group):
                    if callee in module and callee not in seen:
                        seen.add(callee)
                        todo.append(callee)
    return sorted(seen)


def _collective_ops(module: dict[str, list[str]], roots: Sequence[str]) -> list[tuple[str, str]]:
    """(kind, result shape without layout) of each collective in `roots` and what they call; an async
    collective once, at its start."""
    lines = (line for name in reachable(module, roots) for line in module[name])
    return [(m.group(2), _LAYOUT.sub("", m.group(1))) for line in lines if (m := _OP.search(line))]


def collectives(module: dict[str, list[str]], roots: Sequence[str]) -> dict[str, int]:
    """How many collectives of each kind `roots` and what they call hold."""
    counts = collections.Counter(kind for kind, _ in _collective_ops(module, roots))
    return {kind: counts[kind] for kind in COLLECTIVES}


def gathered_shapes(module: dict[str, list[str]], roots: Sequence[str]) -> list[str]:
    """The result shape of every all-gather in `roots` and what they call."""
    return [shape for kind, shape in _collective_ops(module, roots) if kind == "all-gather"]


def loop_step(module: dict[str, list[str]], entry: str) -> list[str]:
    """The condition and body of each while loop the entry computation runs: what one step of the
    token loop runs (the condition's test of the rows counts: it runs every step)."""
    return [name for line in module[entry] if " while(" in line for name in _LOOP.findall(line)]
