"""Every code block of README.md and docs/**/*.md runs as written.

Blocks run in this test process, in a scratch directory that sees the repository's configs: a Python
block is executed as a script (`__name__ == "__main__"`) and must print what it shows; a shell block runs
line by line, `jaxsr ...` lines through `jaxsr.cli.main` (in process: no re-import of jax and
transformers, and programs compiled by an earlier block are reused) and other lines (`python -c`, `head`)
in a shell whose PATH starts with this venv's bin.

A note on the line above a block, `<!-- docs-test: ... -->`, says how it is tested otherwise:

- `compile only (reason)` / `syntax only (reason)`: a block that cannot run here (it downloads from the
  hub, needs several hosts, is what CI itself runs, or takes many minutes) is compiled (Python) or
  syntax-checked (`bash -n`) only; the reason is required.
- `file NAME`: the block is the content of a file (a job config, a chat JSONL) that the page's later
  blocks read; it is written to NAME in the scratch directory before each of them runs.

`text` blocks are what a command printed and are not run; `yaml` and `json` blocks must parse."""

from __future__ import annotations

import json
import linecache
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(
    r"^(?:<!-- docs-test: (?P<note>[^>]*) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.S | re.M
)
RUNS = ("python", "bash")
SKIPS = ("compile only", "syntax only")

SLOW = {
    # (page, text in the block): why the block takes more than about 5 s (seconds measured with the
    # compilation cache warm, on 2 busy cores)
    ("README.md", "best_of_n(lm, reward"): "Best-of-8 and SR's rungs compile for the draft: 11 s",
    ("README.md", "jaxsr run my_job.yaml"): "a 2-prompt SR job, its report and export: 5 s",
    ("docs/getting-started.md", "load_encoder(minilm_path())"): "SR with SmolLM2-135M and MiniLM: 17 s",
    ("docs/jobs.md", "limit=3"): "three runs of a job and the datasets import: 6 s",
    ("docs/jobs.md", "chat.parquet"): "a chat job, its report, export and the datasets import: 6 s",
    ("docs/methods.md", "speculative_contrastive_decoder"): "SmolLM2 and the draft, SD and SR over SCD: 19 s",
    ("docs/training.md", "output_dir=out/sft_draft"): "a job, two training steps, a checkpoint: 14 s",
    ("docs/training.md", "output_dir=out/distill_try"): "samples, trains and measures a draft: 36 s",
    ("docs/accelerators.md", "--target h100x1 --layers 2"): "a 2-layer SmolLM2 job planned for an H100: 18 s",
}


class Block(NamedTuple):
    page: str
    number: int
    """1-based, over the page's fenced blocks."""
    lang: str
    code: str
    note: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.number}:{self.lang}"

    @property
    def file(self) -> str | None:
        """The scratch file this block is the content of (`file NAME` note), else None."""
        return self.note[5:].strip() if self.note and self.note.startswith("file ") else None

    @property
    def runs(self) -> bool:
        return self.lang in RUNS and self.note is None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = FENCE.finditer(text)
    return [Block(page, i, m["lang"], m["code"], m["note"]) for i, m in enumerate(found, 1)]


ALL = [block for page in PAGES for block in blocks(page)]


def slow_reason(block: Block) -> str | None:
    found = (why for (page, text), why in SLOW.items() if page == block.page and text in block.code)
    return next(found, None)


def cases(lang: str) -> list:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if slow_reason(b) else [])
        for b in ALL
        if b.runs and b.lang == lang
    ]


@pytest.fixture
def scratch(tmp_path, monkeypatch, request) -> Path:
    """A working directory with the configs and the files the page's earlier `file` blocks hold; PATH
    starts with this venv's bin (for the shell lines)."""
    block: Block = request.node.callspec.params["block"]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for earlier in blocks(block.page)[: block.number - 1]:
        if earlier.file:
            (tmp_path / earlier.file).write_text(earlier.code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_every_block_runs_or_says_why_not():
    assert {b.lang for b in ALL} <= {"python", "bash", "text", "yaml", "json"}, {b.lang for b in ALL}
    assert "README.md" in PAGES and len(PAGES) >= 10
    assert sum(b.runs for b in ALL if b.page == "README.md") >= 2
    for block in ALL:
        where = block.id
        if block.lang in RUNS and block.note is not None:
            assert block.note.startswith(SKIPS) and re.search(r"\(.+\)", block.note), where  # a reason
            if block.lang == "python":
                compile(block.code, where, "exec")
            else:
                subprocess.run(["bash", "-n"], input=block.code, text=True, check=True)
        elif block.lang in ("yaml", "json"):
            assert block.file, f"{where}: a {block.lang} block is a file a later block reads"
            if block.lang == "yaml":
                yaml.safe_load(block.code)
            else:
                for line in block.code.splitlines():
                    json.loads(line)
        elif block.lang == "text":
            assert block.note is None or block.file, where
    for (page, text), _ in SLOW.items():  # every slow mark still names one block
        assert sum(b.page == page and text in b.code for b in ALL) == 1, (page, text)


def test_no_internal_references():
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert "DESIGN.md" not in text, page  # not part of the repository
        assert not re.search(r"(?<![\w.])/(work|tmp|home|root)/", text), page  # no machine paths
        assert not re.search(r"(?<![\w.-])shared/", text), page


@pytest.mark.parametrize("block", cases("python"))
def test_python_block_runs(block, scratch, capsys):
    name = f"{block.page}:block{block.number}"
    linecache.cache[name] = (len(block.code), None, block.code.splitlines(True), name)  # tracebacks
    exec(compile(block.code, name, "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip()  # every block prints what it shows


@pytest.mark.parametrize("block", cases("bash"))
def test_shell_block_runs(block, scratch):
    from jaxsr.cli import main

    for command in commands(block.code):
        if command.startswith("jaxsr "):
            try:
                code = main(shlex.split(command)[1:])
            except SystemExit as e:  # `--help` exits 0
                code = e.code or 0
            assert code == 0, command
        else:
            done = subprocess.run(command, shell=True, capture_output=True, text=True)
            assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"


def commands(code: str) -> list[str]:
    """A shell block's commands: lines joined at a trailing backslash, comments and blank lines left out."""
    lines = re.sub(r"\\\n\s*", " ", code).splitlines()
    return [c for line in lines if (c := line.split("  #")[0].strip()) and not c.startswith("#")]
