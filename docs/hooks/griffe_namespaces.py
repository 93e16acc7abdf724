"""A Griffe extension for the API reference: load jaxsr's subpackages that have no `__init__.py`.

`jaxsr.decoding`, `jaxsr.search` and `jaxsr.jobs` are folders of modules without an `__init__.py`
(Python imports them as namespace subpackages). Griffe skips such folders inside a regular package,
so `jaxsr.generate` (from `jaxsr.decoding.api`) and `jaxsr.best_of_n` (from `jaxsr.search.best_of_n`)
would be missing. This extension visits their modules and attaches them to the package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe


class NamespaceSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "jaxsr":
            return
        root = Path(pkg.filepath).parent
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and not (p / "__init__.py").exists()):
            files = sorted(folder.glob("*.py"))
            if not files or folder.name in pkg.members:
                continue
            package = griffe.Module(folder.name, filepath=[folder], parent=pkg)
            pkg.set_member(folder.name, package)
            for path in files:
                module = griffe.visit(
                    path.stem,
                    path,
                    path.read_text(),
                    parent=package,
                    extensions=loader.extensions,
                    docstring_parser=loader.docstring_parser,
                    docstring_options=loader.docstring_options,
                    lines_collection=loader.lines_collection,
                    modules_collection=loader.modules_collection,
                )
                package.set_member(path.stem, module)
