"""Every code block of README.md runs as written.

Python blocks run as scripts and shell blocks line by line, in a scratch directory that sees the
repository's configs. A block that cannot run here (it downloads from the hub, needs several hosts, or is
what CI itself runs) says so in a `<!-- readme-test: ... -->` comment on the line above it, and is then
compiled (Python) or syntax-checked (bash) only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<note>[^>]*) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, note) of each fenced block, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m["lang"], m["code"], m["note"]) for m in BLOCK.finditer(text)]


def runnable(lang: str) -> list[str]:
    return [code for kind, code, note in blocks() if kind == lang and note is None]


def scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory with the configs, and an environment whose PATH starts with this venv."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return tmp_path, env


def test_every_block_is_run_or_says_why_not():
    found = blocks()
    assert {lang for lang, _, _ in found} <= {"python", "bash", "text"}  # text: what a command printed
    assert len(runnable("python")) >= 3 and len(runnable("bash")) >= 1
    for lang, code, note in found:
        if note is not None:
            assert note.startswith(("compile only", "syntax only")) and "(" in note  # a reason is given
            if lang == "python":
                compile(code, "README.md", "exec")
            elif lang == "bash":
                subprocess.run(["bash", "-n"], input=code, text=True, check=True)
    assert "DESIGN.md" not in (ROOT / "README.md").read_text()  # not part of the repository


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(runnable("python"))))
def test_python_block_runs(index, tmp_path):
    cwd, env = scratch(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(runnable("python")[index])
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()  # every block prints what it shows


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(runnable("bash"))))
def test_shell_block_runs(index, tmp_path):
    cwd, env = scratch(tmp_path)
    for line in runnable("bash")[index].splitlines():
        command = line.split("  #")[0].strip()
        if command:
            done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
            assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
