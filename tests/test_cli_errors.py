"""The `jaxsr` command's own errors: a usage mistake ends in one line naming the argument, with exit code
2 (`--help` still prints argparse's usage), and Ctrl-C in one line, with exit code 130."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxsr import cli


@pytest.mark.parametrize(
    "argv, named",
    [
        ([], "arguments are required: command"),
        (["rn", "x.yaml"], "invalid choice: 'rn'"),
        (["run"], "arguments are required: config"),
        (["demo", "--prompts", "x"], "argument --prompts: invalid int value: 'x'"),
        (["demo", "--seed"], "argument --seed: expected one argument"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "c.yaml", "--nope"], "unrecognized arguments: --nope"),
        (["train"], "arguments are required: stage"),
        (["train", "sft"], "arguments are required: config"),
    ],
)
def test_cli_usage_errors_are_one_line_naming_the_argument(capsys, argv, named):
    from jaxsr.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and named in err and err.startswith("jaxsr"), err
    assert "usage:" not in err and "Traceback" not in err


@pytest.mark.slow  # starts 2 Python processes that import jaxsr's CLI
def test_cli_usage_error_from_the_command_line_and_help_unchanged():
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    bad = subprocess.run([sys.executable, "-m", "jaxsr", "demo", "--n", "two"], capture_output=True, env=env)
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr.decode() == (
        "jaxsr demo: error: argument --n: invalid int value: 'two' (see jaxsr demo --help)\n"
    )
    good = subprocess.run([sys.executable, "-m", "jaxsr", "run", "--help"], capture_output=True, env=env)
    assert (
        good.returncode == 0 and good.stdout.startswith(b"usage: jaxsr run") and b"key=value" in good.stdout
    )


def test_ctrl_c_ends_with_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("jaxsr.jobs.runner.run_job", interrupted)
    assert cli.main(["run", "configs/generate_alpaca.yaml", "--no-progress"]) == 130
    assert capsys.readouterr().err == "jaxsr: interrupted\n"


def test_parsing_and_help_import_no_jax_nor_transformers():
    """`jaxsr --help` and every subcommand's answer in well under a second: the command's modules (jax,
    transformers: seconds to import) are imported by the command itself, not by parsing."""
    import subprocess
    import sys

    code = """
import contextlib, io, sys
from jaxsr import cli
for argv in (["--help"], *([c, "--help"] for c in ("run", "report", "export", "demo", "plan")),
             ["train", "sft", "--help"], ["train", "distill", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        cli.main(argv)
    assert out.getvalue().startswith("usage: jaxsr"), argv
print(sorted(m for m in ("jax", "flax", "transformers", "torch", "numpy") if m in sys.modules))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr


def test_the_export_commands_pairs_are_the_exports():
    from jaxsr.jobs import export

    assert cli.PAIRS == export.PAIRS
