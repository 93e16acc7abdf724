"""Every notebook in colab/ runs top to bottom on CPU with the embedded default models; its install cell
installs jaxsr, from the wheel `make wheel` builds or from JAXSR_SOURCE, in a kernel that lacks it, and
refuses, saying what to do, when it has neither or finds an unrelated package named jaxsr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "colab").glob("*.ipynb"))
PRINTS = {  # what each notebook must print when it ran through
    "best_of_n_vs_speculative_rejection": ["Best-of-8", "SR α=0.5"],
    "speculative_contrastive_decoding": ["greedy SCD == greedy CD", "measured", "over CD"],
    "sft_on_speculative_rejection_data": ["prompts searched", "fine-tuned in", "Best-of-8 reward after"],
}
# Notebooks whose shipped size is a long run (the SFT example) or a sweep of compiles run with their
# config cell shrunk as a user trying them would; {workdir} is the test's scratch directory.
SHRUNK_CONFIG = {
    "speculative_contrastive_decoding": "PROMPTS, MAX_NEW_TOKENS, GAMMAS = 1, 16, [1, 2]",
    "sft_on_speculative_rejection_data": (
        "TRAIN_PROMPTS, EVAL_PROMPTS, MAX_NEW_TOKENS, STEPS, BATCH_SIZE = 3, 2, 16, 2, 4\n"
        'WORKDIR = "{workdir}"'
    ),
}
# The wheel test runs the fastest notebook top to bottom as shipped (the install cell is the same in
# all), in a kernel without jaxsr; test_notebook_runs_top_to_bottom runs the others.
FRESH_KERNEL_NOTEBOOK = "best_of_n_vs_speculative_rejection"
IN_THIS_KERNEL = [path for path in NOTEBOOKS if path.stem != FRESH_KERNEL_NOTEBOOK]


def execute(notebook, kernel_name: str, cwd: Path) -> str:
    """Run every cell of `notebook` in a `kernel_name` kernel started in `cwd`; the printed text."""
    nbclient = pytest.importorskip("nbclient")
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name=kernel_name, resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("path", IN_THIS_KERNEL, ids=[p.stem for p in IN_THIS_KERNEL])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    if path.stem in SHRUNK_CONFIG:
        config = next(cell for cell in notebook.cells if cell.cell_type == "code")
        config.source += "\n" + SHRUNK_CONFIG[path.stem].format(workdir=tmp_path / "work")
    text = execute(notebook, "python3", path.parent)
    for expected in PRINTS[path.stem]:
        assert expected in text


def test_every_notebook_says_what_it_must_print():
    assert NOTEBOOKS and {p.stem for p in NOTEBOOKS} == set(PRINTS)
    assert FRESH_KERNEL_NOTEBOOK in PRINTS and set(SHRUNK_CONFIG) <= set(PRINTS) - {FRESH_KERNEL_NOTEBOOK}


def code_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells."""
    cells = json.loads(path.read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]


INSTALL_CELL = code_cells(NOTEBOOKS[0])[1]  # the code cell after the config cell


def test_every_notebook_has_the_same_install_cell():
    """One install cell for all notebooks (so the tests of one cover every notebook), shipped with no
    source: no placeholder is ever installed."""
    assert {code_cells(path)[1] for path in NOTEBOOKS} == {INSTALL_CELL}
    assert len(re.findall(r'^JAXSR_SOURCE = ""', INSTALL_CELL, flags=re.M)) == 1


# What the notebooks use of jaxsr that jaxsr/__init__.py does not export (yet): the embedded models' file
# paths, the bundled prompt sets, the self-likelihood reward.
NOT_EXPORTED = {
    "jaxsr.loading.embedded",
    "jaxsr.loading.encoder",
    "jaxsr.loading.gguf",
}


def test_notebooks_use_the_public_api():
    import jaxsr

    used = {
        name
        for path in NOTEBOOKS
        for cell in code_cells(path)
        for name in re.findall(r"\bjaxsr(?:\.\w+)+", cell)
    }
    internal = {name for name in used if name.split(".")[1] not in {*jaxsr.__all__, "__file__"}}
    assert "jaxsr.load_model" in used and internal <= NOT_EXPORTED, internal - NOT_EXPORTED


def repository_copy(path: Path) -> Path:
    """What `make wheel` and `pip install` need of this repository, copied to `path`, so nothing builds in
    or installs the real one."""
    shutil.copytree(REPO / "jaxsr", path / "jaxsr", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "Makefile"):
        shutil.copy2(REPO / name, path / name)
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `make wheel` builds in a copy of this repository with this interpreter's venv (`-o` takes
    the venv's setup as done) and no index to download from."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make")
    copy = repository_copy(tmp_path_factory.mktemp("wheel"))
    venv = Path(sys.prefix)
    command = [make, "-s", "-C", copy, "wheel", f"VENV={venv}", "-o", venv / "bin" / "jaxsr"]
    subprocess.run(command, check=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    (built,) = (copy / "dist").glob("jaxsr-*-py3-none-any.whl")
    return built


@pytest.mark.slow
def test_make_wheel_packs_the_package_and_its_data(wheel):
    """Every file of jaxsr/ is in the wheel: code, the shipped draft in assets/, the prompt sets, py.typed."""
    package = wheel.parents[1] / "jaxsr"
    files = {p.relative_to(package.parent).as_posix() for p in package.rglob("*") if p.is_file()}
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("jaxsr/")}
    assert packed == files
    for name in ("assets/smollm2-draft/model.safetensors", "data/alpaca_farm_100.json", "py.typed"):
        assert f"jaxsr/{name}" in packed


def jaxsr_location(python: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Where `python` started in `cwd` imports jaxsr from (stdout), or why it cannot (stderr)."""
    code = "import jaxsr; print(jaxsr.__file__)"
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True)


@pytest.fixture
def fresh_python(tmp_path, monkeypatch) -> Path:
    """The python of a new venv that sees this interpreter's packages but not jaxsr.

    A plain path line in a .pth puts our site-packages on sys.path without running the .pth files in it,
    so the editable jaxsr install's finder stays off. The venv has no pip of its own: ours and our
    setuptools serve."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(site_packages) / "dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    before = jaxsr_location(python, tmp_path)
    assert before.returncode != 0 and "No module named 'jaxsr'" in before.stderr, before
    return python


# pip in the tests builds offline (PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation) and
# may download nothing (PIP_NO_INDEX): the tests check the install cell, not the network.
PIP_OFFLINE = {"PIP_NO_BUILD_ISOLATION": "0", "PIP_NO_INDEX": "1"}


@pytest.fixture
def fresh_kernel(fresh_python, tmp_path, monkeypatch) -> Path:
    """`fresh_python`, registered as the kernel `fresh-venv`."""
    pytest.importorskip("ipykernel")
    spec = tmp_path / "jupyter" / "kernels" / "fresh-venv"
    spec.mkdir(parents=True)
    argv = [str(fresh_python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "fresh venv", "language": "python", "env": PIP_OFFLINE}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return fresh_python


def with_source(install_cell: str, source: str) -> str:
    """The install cell with JAXSR_SOURCE = `source`."""
    cell, found = re.subn(r'^JAXSR_SOURCE = ""', f"JAXSR_SOURCE = {source!r}", install_cell, flags=re.M)
    assert found == 1
    return cell


def run_install_cell(python: Path, cwd: Path, source: str, path: Path | None = None):
    """The install cell run by `python` in `cwd` with JAXSR_SOURCE = `source` (and `path` on sys.path)."""
    code = with_source(INSTALL_CELL, source)
    env = {**os.environ, **PIP_OFFLINE, **({"PYTHONPATH": str(path)} if path else {})}
    return subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_install_cell_refuses_without_a_source_or_a_wheel(fresh_python, tmp_path):
    """No JAXSR_SOURCE and no uploaded wheel: the cell says what to set or upload, and where."""
    content = tmp_path / "content"  # like Colab's /content
    content.mkdir()
    result = run_install_cell(fresh_python, content, source="")
    assert result.returncode != 0
    assert "RuntimeError: jaxsr is not installed: set JAXSR_SOURCE" in result.stderr, result.stderr
    wheel_name = "the wheel `make wheel` builds (dist/jaxsr-<version>-py3-none-any.whl)"
    assert f"upload {wheel_name} to {content.resolve()}" in result.stderr
    assert "No module named 'jaxsr'" in jaxsr_location(fresh_python, tmp_path).stderr


def test_install_cell_refuses_an_unrelated_jaxsr(fresh_python, tmp_path):
    """A package named jaxsr that is not this library (PyPI's is symbolic regression) is neither kept
    nor installed over: the cell refuses, saying how to remove it, whatever JAXSR_SOURCE says."""
    other = tmp_path / "other" / "jaxsr"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('"""Symbolic regression: stands in for the jaxsr on PyPI."""\n')
    result = run_install_cell(fresh_python, tmp_path, source=str(tmp_path / "missing"), path=other.parent)
    assert result.returncode != 0
    assert f"RuntimeError: {other / '__init__.py'} is not this jaxsr" in result.stderr, result.stderr
    assert "run `pip uninstall -y jaxsr`" in result.stderr


def printed_location(text: str) -> Path:
    """The path the check cell appended by the tests printed for jaxsr in the kernel."""
    return Path(text.split("jaxsr imported from ", 1)[1].splitlines()[0]).resolve()


CHECK_CELL = "import jaxsr\nprint('jaxsr imported from', jaxsr.__file__)"


def assert_installed_in_venv(python: Path, text: str, cwd: Path) -> None:
    """The kernel printed (`text`) a jaxsr installed into `python`'s venv, which imports it afterwards."""
    venv = python.parents[1].resolve()
    assert printed_location(text).is_relative_to(venv), text
    after = jaxsr_location(python, cwd)
    assert after.returncode == 0 and Path(after.stdout.strip()).resolve().is_relative_to(venv), after


@pytest.mark.slow
def test_install_cell_installs_an_uploaded_wheel_in_a_fresh_kernel(fresh_kernel, wheel, tmp_path):
    """With the wheel `make wheel` builds uploaded to the notebook's folder (Colab: /content) and no
    JAXSR_SOURCE, one notebook runs top to bottom as shipped in a kernel without jaxsr, installing the
    wheel."""
    nbformat = pytest.importorskip("nbformat")
    content = tmp_path / "content"
    content.mkdir()
    shutil.copy2(wheel, content)
    notebook = nbformat.read(REPO / "colab" / f"{FRESH_KERNEL_NOTEBOOK}.ipynb", as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    text = execute(notebook, "fresh-venv", content)
    for expected in PRINTS[FRESH_KERNEL_NOTEBOOK]:
        assert expected in text
    assert_installed_in_venv(fresh_kernel, text, tmp_path)


@pytest.mark.slow
def test_install_cell_installs_jaxsr_source_in_a_fresh_kernel(fresh_kernel, tmp_path):
    """JAXSR_SOURCE = "git+<url>" of a clone: the install cell installs it, here from a local git
    repository made of a copy; only the cells up to the install run (the notebook runs in the test above)."""
    nbformat = pytest.importorskip("nbformat")
    git = shutil.which("git")
    if git is None:
        pytest.skip("needs git for a git+file:// JAXSR_SOURCE")
    origin = repository_copy(tmp_path / "origin")
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"],
    ):
        subprocess.run([git, *args], cwd=origin, check=True)
    notebook = nbformat.read(REPO / "colab" / f"{FRESH_KERNEL_NOTEBOOK}.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    install = code[1]
    install.source = with_source(install.source, f"git+{origin.as_uri()}")
    notebook.cells = [code[0], install, nbformat.v4.new_code_cell(CHECK_CELL)]
    content = tmp_path / "content"
    content.mkdir()
    text = execute(notebook, "fresh-venv", content)
    assert_installed_in_venv(fresh_kernel, text, tmp_path)
