"""The package's shape, read from its source: no import circle, one token loop and one batch set-up,
no module assigning another's fields, small functions on the decoding and search paths."""

from __future__ import annotations

import ast
from pathlib import Path

import jaxsr

PACKAGE = Path(jaxsr.__file__).parent
SMALL = ("decoding", "search")
"""Sub-packages whose functions stay small: at most MAX_LINES lines and MAX_PARAMS parameters."""
MAX_LINES, MAX_PARAMS = 60, 8


def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name, parsed."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its body (function bodies included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: strongly connected components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    trees = modules()
    graph = {name: imports(name, tree, set(trees)) for name, tree in trees.items()}
    # a package importing its own submodules is the package's face, not a circle
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the detector detects
    assert cycles(graph) == []


def test_functions_on_the_decoding_and_search_paths_are_small():
    public = set(jaxsr.__all__)
    offenders = []
    for name, tree in modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in SMALL:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name in public:
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            params = [p for p in params if p.arg not in ("self", "cls")]
            lines = node.end_lineno - node.lineno + 1
            if len(params) > MAX_PARAMS or lines > MAX_LINES:
                offenders.append(f"{name}.{node.name}: {len(params)} parameters, {lines} lines")
    assert offenders == []


def is_store(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)


def fields_of_classes(tree: ast.Module) -> set[str]:
    """Attribute names the module's classes own: class-level fields and `self.x = …` in methods."""
    owned = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                owned.add(node.target.id)
            elif is_store(node) and isinstance(node.value, ast.Name) and node.value.id == "self":
                owned.add(node.attr)
    return owned


def test_no_module_assigns_the_fields_of_another_modules_class():
    offenders = []
    for name, tree in modules().items():
        owned = fields_of_classes(tree)
        for node in ast.walk(tree):
            if not is_store(node):
                continue
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in ("self", "cls") or node.attr in owned:
                continue
            if (name, base) == ("jaxsr.cli", "args"):  # argparse's namespace: the parser's own result
                continue
            if base == "sys" and node.attr.endswith("hook"):  # Python's hooks are set by assignment
                continue
            offenders.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def calls_of(tree: ast.Module, attribute: str) -> int:
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == attribute
    )


def loop_calls(tree: ast.Module, name: str) -> int:
    """Calls of `loop.<name>(...)` (the jitted programs of `jaxsr.decoding.loop`, imported as `loop`)."""
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "loop"
    )


def test_one_token_loop_and_one_batch_set_up():
    """The token loop (`lax.while_loop`) lives in `decoding.loop` alone, and only the sampler calls the
    jitted prefill and row set-ups: every driver goes through `Sampler.prefill_prompts` and `start`
    (a batch of rows) or `insert` (rows into a batch of prompt slots)."""
    trees = modules()
    loops = {name for name, tree in trees.items() if calls_of(tree, "while_loop")}
    assert loops == {"jaxsr.decoding.loop"}
    callers = {name for name, tree in trees.items() if calls_of(tree, "init_state")}
    assert callers == {"jaxsr.decoding.driver"}
    for set_up in ("empty_slab", "insert"):  # the jitted programs, called through the sampler
        callers = {name for name, tree in trees.items() if loop_calls(tree, set_up)}
        assert callers == {"jaxsr.decoding.driver"}, set_up
    starters = {name for name, tree in trees.items() if calls_of(tree, "start")}
    assert {"jaxsr.search.scheduler", "jaxsr.training.distill"} <= starters
