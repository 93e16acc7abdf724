"""Every notebook in colab/ runs top to bottom on CPU with the embedded default models."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "colab").glob("*.ipynb"))
PRINTS = {  # what each notebook must print when it ran through
    "best_of_n_vs_speculative_rejection": ["Best-of-8", "SR α=0.5"],
    "speculative_contrastive_decoding": ["greedy SCD == greedy CD", "measured", "over CD"],
}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    for expected in PRINTS[path.stem]:
        assert expected in text


def test_every_notebook_says_what_it_must_print():
    assert NOTEBOOKS and {p.stem for p in NOTEBOOKS} == set(PRINTS)
