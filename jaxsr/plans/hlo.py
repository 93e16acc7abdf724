"""Collectives in a compiled program's HLO text: how often each kind runs, in the whole program and in
one step of its loop, and the shapes all-gathers assemble (a KV cache among them would be gathered
whole onto every device); and, for backends whose compiler gives no cost analysis (GPU), the work of
its dots and convolutions and the memory traffic of its kernels."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
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


_COPY = re.compile(r"= (\S.*?) copy\(")


def copied_shapes(module: dict[str, list[str]], roots: Sequence[str]) -> list[str]:
    """The result shape of every copy in `roots` and what they call: an array moved whole into another
    layout (on a TPU, an array a step reads in one layout and writes in another is copied each step)."""
    lines = (line for name in reachable(module, roots) for line in module[name])
    return [_LAYOUT.sub("", m.group(1)) for line in lines if (m := _COPY.search(line))]


def loop_step(module: dict[str, list[str]], entry: str) -> list[str]:
    """The condition and body of each while loop the entry computation runs: what one step of the
    token loop runs (the condition's test of the rows counts: it runs every step)."""
    return [name for line in module[entry] if " while(" in line for name in _LOOP.findall(line)]


# --- work and traffic, where the backend's compiler gives no cost analysis (GPU) ------------------------

_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([\d,<=]*)\]")
_BITS = re.compile(r"[a-z]+(\d+)")
_DIMS = re.compile(r"(\w+)=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")

FREE = frozenset(
    {
        "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
        "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
    }
)  # fmt: skip
"""Top-level instructions that move no data themselves (a loop's or call's computations are counted)."""
ARITHMETIC = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum"})
"""Elementwise operations counted as one FLOP per output element (on floating-point numbers)."""
SLICES = frozenset({"slice", "dynamic-slice", "gather"})
"""Instructions that read only as much of their first operand as they return."""
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
"""Instructions that update their first operand in place: they read none of it and write only their
update (a dynamic-update-slice's second operand, a scatter's last), as a decode step writes each row's
new keys into its cache."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its result type, opcode, operand names and the text after its operands."""

    name: str
    type: str
    opcode: str
    args: str
    operands: tuple[str, ...]
    attributes: str
    root: bool


def instruction(line: str) -> Instruction | None:
    """The instruction a computation's line holds (None for anything else)."""
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    rest = _COMMENT.sub("", line[head.end() :])
    type_end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    opcode, _, tail = rest[type_end:].strip().partition("(")
    args_end = _closing("(" + tail, 0) - 1
    args = tail[:args_end]
    return Instruction(
        name=head.group(2),
        type=rest[:type_end],
        opcode=opcode,
        args=args,
        operands=tuple(re.findall(r"%([\w.\-]+)", args)),
        attributes=tail[args_end + 1 :],
        root=bool(head.group(1)),
    )


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start` (round brackets, nested)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


def parsed(module: dict[str, list[str]]) -> dict[str, dict[str, Instruction]]:
    """Each computation's instructions by name."""
    return {
        name: {i.name: i for i in map(instruction, lines) if i is not None} for name, lines in module.items()
    }


def arrays(type_: str) -> list[tuple[int, int]]:
    """(elements, bits per element) of each array in an HLO type (a tuple's every element)."""
    found = []
    for dtype, dims in _ARRAY.findall(type_):
        bits = 8 if dtype == "pred" else 0 if dtype == "token" else int(_BITS.match(dtype).group(1))
        found.append((math.prod(int(d) for d in dims.replace("<=", "").split(",") if d), bits))
    return found


def type_bytes(type_: str) -> int:
    """Bytes an HLO type's arrays take."""
    return sum(n * bits for n, bits in arrays(type_)) // 8


def elements(type_: str) -> int:
    """Elements of an HLO array type."""
    return sum(n for n, _ in arrays(type_))


def callees(ins: Instruction) -> list[str]:
    """The computations an instruction calls (fused computation, loop body and condition, reducer...)."""
    return [
        callee
        for name, group in _CALLED.findall(ins.attributes)
        for callee in ([name] if name else re.findall(r"%([\w.\-]+)", group))
    ]


def runs(ins: Instruction) -> list[str]:
    """The computations an instruction runs as a whole (not a reducer or comparator applied per element)."""
    if "to_apply=" in ins.attributes and ins.opcode != "call":
        return []
    return callees(ins)


def dims(type_: str) -> list[int]:
    """The dimensions of an HLO array type."""
    return [int(d) for d in _ARRAY.search(type_).group(2).replace("<=", "").split(",") if d]


def floating(type_: str) -> bool:
    """Whether an HLO type's (first) array holds floating-point numbers."""
    found = _ARRAY.search(type_)
    return found is not None and found.group(1).startswith(("f", "bf"))


def instruction_flops(ins: Instruction, table: dict[str, Instruction]) -> int:
    """FLOPs of one instruction: a dot's 2 × output elements × contracted size (a convolution's × the
    kernel's size per output feature), a floating-point reduction's input elements, a floating-point
    add, subtract, multiply, divide, maximum or minimum's output elements; 0 for anything else."""
    if ins.opcode == "dot":
        lhs = dims(table[ins.operands[0]].type)
        contracting = dict(_DIMS.findall(ins.attributes)).get("lhs_contracting_dims", "")
        return 2 * elements(ins.type) * math.prod(lhs[int(d)] for d in contracting.split(",") if d)
    if ins.opcode == "convolution":
        kernel = dims(table[ins.operands[1]].type)
        labels = _DIM_LABELS.search(ins.attributes)
        out_features = kernel[labels.group(1).index("o")] if labels else 1
        return 2 * elements(ins.type) * math.prod(kernel) // out_features
    if not floating(ins.type):
        return 0
    if ins.opcode == "reduce":
        return elements(table[ins.operands[0]].type)
    return elements(ins.type) if ins.opcode in ARITHMETIC else 0


def flops(module: dict[str, list[str]], entry: str) -> float:
    """FLOPs the entry computation runs (`instruction_flops`), through fusions and calls, a while loop's
    condition and body counted once (as XLA's cost analysis counts them). A matrix-vector product XLA
    turned into a multiply and a reduction counts as the dot would; integer and bit work (random
    numbers), conversions, comparisons, selections, transcendentals and custom calls count nothing."""
    computations = parsed(module)

    @functools.cache
    def of(name: str) -> int:
        table = computations[name]
        return sum(
            instruction_flops(ins, table) + sum(of(c) for c in runs(ins) if c in computations)
            for ins in table.values()
        )

    return float(of(entry))


def bytes_accessed(module: dict[str, list[str]], entry: str) -> float:
    """HBM traffic of the entry computation's kernels, a while loop's condition and body counted once:
    each top-level instruction or fusion reads its operands and writes its result, except that a
    slice or gather reads only what it returns and a dynamic-update-slice or scatter writes only its
    update in place (inside a fusion too); tuples, bitcasts, parameters and constants move nothing.
    Caches between kernels (L2) are not modelled: a lower bound's traffic, not a measurement."""
    computations = parsed(module)

    @functools.cache
    def of(name: str) -> int:
        table, total = computations[name], 0
        for ins in table.values():
            if ins.opcode == "fusion":
                total += fusion_bytes(ins, table, computations[callees(ins)[0]])
            elif ins.opcode in ("while", "conditional", "call"):
                total += sum(of(c) for c in callees(ins) if c in computations)
            elif ins.opcode not in FREE and not ins.opcode.endswith("-done"):
                reads = (operand_reads(ins, i, table[o].type) for i, o in enumerate(ins.operands))
                total += sum(reads) + writes(ins, table)
        return total

    return float(of(entry))


def operand_reads(ins: Instruction, position: int, operand_type: str) -> int:
    """Bytes `ins` reads of its operand at `position` (of type `operand_type`)."""
    if ins.opcode in SLICES and position == 0:
        return type_bytes(ins.type)
    if ins.opcode in IN_PLACE and position == 0:
        return 0  # updated in place
    return type_bytes(operand_type)


def writes(ins: Instruction, table: dict[str, Instruction]) -> int:
    """Bytes `ins` writes: its result, or an in-place update's update alone (a tuple: each part's)."""
    if ins.opcode in IN_PLACE:
        return type_bytes(table[ins.operands[-1 if ins.opcode == "scatter" else 1]].type)
    if ins.opcode == "tuple":
        return sum(writes(table[o], table) for o in ins.operands)
    return type_bytes(ins.type)


def fusion_bytes(fusion: Instruction, table: dict[str, Instruction], fused: dict[str, Instruction]) -> int:
    """A fusion's traffic: each operand as its fused computation reads it (a parameter only sliced is
    read as far as sliced; one only updated in place, not at all), and what its root writes."""
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for ins in fused.values():
        for position, operand in enumerate(ins.operands):
            users.setdefault(operand, []).append((ins, position))

    def reads(name: str, whole: int) -> int:
        uses = users.get(name, [])
        if not uses:
            return whole
        parts = []
        for user, position in uses:
            if user.opcode == "bitcast":
                parts.append(reads(user.name, whole))
            elif user.opcode in SLICES | IN_PLACE and position == 0:
                parts.append(operand_reads(user, position, ""))
            else:
                return whole
        return min(whole, sum(parts))

    parameters = {int(ins.args): ins.name for ins in fused.values() if ins.opcode == "parameter"}
    total = sum(reads(parameters[i], type_bytes(table[o].type)) for i, o in enumerate(fusion.operands))
    root = next(ins for ins in fused.values() if ins.root)
    return total + writes(root, fused)
