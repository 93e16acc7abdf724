"""Every notebook in colab/ runs top to bottom on CPU with the embedded default models, and its install
cell makes jaxsr importable in a kernel that lacks it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "colab").glob("*.ipynb"))
PRINTS = {  # what each notebook must print when it ran through
    "best_of_n_vs_speculative_rejection": ["Best-of-8", "SR α=0.5"],
    "speculative_contrastive_decoding": ["greedy SCD == greedy CD", "measured", "over CD"],
    "sft_on_speculative_rejection_data": ["prompts searched", "fine-tuned in", "Best-of-8 reward after"],
}
# Notebooks whose shipped size is a long run (the README's worked example: 38 min on 2 cores) run with
# their config cell shrunk as a user trying them would; {workdir} is the test's scratch directory.
SHRUNK_CONFIG = {
    "sft_on_speculative_rejection_data": (
        "TRAIN_PROMPTS, EVAL_PROMPTS, MAX_NEW_TOKENS, STEPS, BATCH_SIZE = 3, 2, 16, 2, 4\n"
        'WORKDIR = "{workdir}"'
    ),
}
# The fresh-kernel test runs the faster notebook (the install cell is the same in all), its config cell
# shrunk as a user would change it: the test is about installing jaxsr, the full run is tested above.
FRESH_KERNEL_NOTEBOOK = "best_of_n_vs_speculative_rejection"
FRESH_KERNEL_CONFIG = "PROMPTS, MAX_NEW_TOKENS = 1, 16"


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
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
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
    assert FRESH_KERNEL_NOTEBOOK in PRINTS and set(SHRUNK_CONFIG) <= set(PRINTS)


def install_cell(path: Path) -> str:
    """The source of a notebook's install cell: the code cell after the config cell."""
    cells = json.loads(path.read_text())["cells"]
    return "".join([cell["source"] for cell in cells if cell["cell_type"] == "code"][1])


def test_every_notebook_has_the_same_install_cell():
    """One install cell for all notebooks (so the fresh-kernel tests of one cover every notebook), naming
    its repository once."""
    cells = {install_cell(path) for path in NOTEBOOKS}
    assert len(cells) == 1
    assert len(re.findall(r"^JAXSR_REPO = ", cells.pop(), flags=re.M)) == 1


def repository_copy(path: Path) -> Path:
    """What `pip install` needs of this repository, copied to `path`, so nothing installs the real one."""
    for name in ("jaxsr", "colab"):
        shutil.copytree(REPO / name, path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, path / name)
    return path


def jaxsr_location(python: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Where `python` started in `cwd` imports jaxsr from (stdout), or why it cannot (stderr)."""
    code = "import jaxsr; print(jaxsr.__file__)"
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True)


@pytest.fixture
def fresh_kernel(tmp_path, monkeypatch) -> Path:
    """The python of a new venv that sees this interpreter's packages but not jaxsr, registered as the
    kernel `fresh-venv`.

    A plain path line in a .pth puts our site-packages on sys.path without running the .pth files in it,
    so the editable jaxsr install's finder stays off. The venv has no pip of its own: ours and our
    setuptools serve. pip builds offline (PIP_NO_BUILD_ISOLATION=0 is pip's spelling of
    --no-build-isolation) and may download nothing (PIP_NO_INDEX): the tests check the install cell, not
    the network."""
    pytest.importorskip("ipykernel")
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

    spec = tmp_path / "jupyter" / "kernels" / "fresh-venv"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    env = {"PIP_NO_BUILD_ISOLATION": "0", "PIP_NO_INDEX": "1"}
    kernel = {"argv": argv, "display_name": "fresh venv", "language": "python", "env": env}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return python


def printed_location(text: str) -> Path:
    """The path the check cell appended by the tests printed for jaxsr in the kernel."""
    return Path(text.split("jaxsr imported from ", 1)[1].splitlines()[0]).resolve()


CHECK_CELL = "import jaxsr\nprint('jaxsr imported from', jaxsr.__file__)"


@pytest.mark.slow
def test_install_cell_installs_the_checkout_in_a_fresh_kernel(fresh_kernel, tmp_path):
    """From a checkout the first cells install it (editable): one notebook runs from a copy of the
    repository in a kernel without jaxsr, and afterwards that venv imports jaxsr from the copy."""
    nbformat = pytest.importorskip("nbformat")
    copy = repository_copy(tmp_path / "repo")
    notebook = nbformat.read(copy / "colab" / f"{FRESH_KERNEL_NOTEBOOK}.ipynb", as_version=4)
    config = next(cell for cell in notebook.cells if cell.cell_type == "code")
    config.source += f"\n{FRESH_KERNEL_CONFIG}"
    notebook.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    text = execute(notebook, "fresh-venv", copy / "colab")
    for expected in PRINTS[FRESH_KERNEL_NOTEBOOK]:
        assert expected in text
    installed = (copy / "jaxsr" / "__init__.py").resolve()
    assert printed_location(text) == installed
    after = jaxsr_location(fresh_kernel, tmp_path)
    assert after.returncode == 0 and Path(after.stdout.strip()).resolve() == installed, after


@pytest.mark.slow
def test_install_cell_installs_jaxsr_repo_outside_a_checkout(fresh_kernel, tmp_path):
    """Outside a checkout (Colab) the install cell installs `git+JAXSR_REPO`, here pointed at a local git
    repository made of a copy; only the cells up to the install run (the notebook itself is tested above)."""
    nbformat = pytest.importorskip("nbformat")
    git = shutil.which("git")
    if git is None:
        pytest.skip("needs git for a git+file:// JAXSR_REPO")
    origin = repository_copy(tmp_path / "origin")
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"],
    ):
        subprocess.run([git, *args], cwd=origin, check=True)
    notebook = nbformat.read(origin / "colab" / f"{FRESH_KERNEL_NOTEBOOK}.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    install = code[1]
    install.source, found = re.subn(
        r'^JAXSR_REPO = ".*"', f'JAXSR_REPO = "{origin.as_uri()}"', install.source, flags=re.M
    )
    assert found == 1, "the install cell names its repository in one JAXSR_REPO constant"
    notebook.cells = [code[0], install, nbformat.v4.new_code_cell(CHECK_CELL)]
    content = tmp_path / "content"  # like Colab's /content: no pyproject.toml above it
    content.mkdir()
    text = execute(notebook, "fresh-venv", content)
    venv = fresh_kernel.parents[1].resolve()  # installed into the venv, not imported from the clone
    assert printed_location(text).is_relative_to(venv), text
    after = jaxsr_location(fresh_kernel, tmp_path)
    assert after.returncode == 0 and Path(after.stdout.strip()).resolve().is_relative_to(venv), after
