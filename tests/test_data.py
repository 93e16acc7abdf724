"""Prompt sets ship inside the package and are found by name from anywhere; $JAXSR_DATA_DIR adds more;
a prompt file that is empty, malformed or not UTF-8 is named (with its line)."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from repository import ROOT, repository_files

from jaxsr.data import BUNDLED_DIR, bundled_sets, find_dataset, read_prompts


def test_bundled_sets_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JAXSR_DATA_DIR", raising=False)
    assert bundled_sets() == ["alpaca_farm_100", "alpaca_farm_eval", "alpaca_farm_rest", "hh_rlhf_100"]
    sizes = {name: len(read_prompts(name)) for name in bundled_sets()}
    assert sizes == {
        "alpaca_farm_100": 100,
        "alpaca_farm_eval": 805,
        "alpaca_farm_rest": 704,
        "hh_rlhf_100": 100,
    }
    assert find_dataset("hh_rlhf_100").parent == BUNDLED_DIR
    assert read_prompts("alpaca_farm_eval", limit=2)[0].startswith("What are the names of some famous actors")
    # the 100-prompt subset is drawn from the 805: every prompt is in the full set
    assert set(read_prompts("alpaca_farm_100")) <= set(read_prompts("alpaca_farm_eval"))
    # the rest is the full set less the subset (one prompt appears twice in the 805): nothing shared
    held_out, rest = set(read_prompts("alpaca_farm_100")), read_prompts("alpaca_farm_rest")
    assert not held_out & set(rest) and set(rest) | held_out == set(read_prompts("alpaca_farm_eval"))


def test_the_data_folder_adds_and_shadows_sets(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    (first / "mine.jsonl").write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps("two") + "\n")
    (second / "hh_rlhf_100.json").write_text(json.dumps([{"prompt": "shadowed"}]))
    monkeypatch.setenv("JAXSR_DATA_DIR", f"{first}:{second}")
    assert read_prompts("mine") == ["one", "two"]
    assert read_prompts("hh_rlhf_100") == ["shadowed"]
    assert len(read_prompts("alpaca_farm_100")) == 100  # the rest still come from the package


def test_unknown_sets_and_bad_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'nope'.*alpaca_farm_100") as error:
        find_dataset("nope")
    assert isinstance(error.value, ValueError)
    with pytest.raises(ValueError, match="directory"):
        find_dataset(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ValueError, match=f"{bad}.*not valid JSON"):
        read_prompts(str(bad))


@pytest.mark.parametrize(
    ("name", "content", "named"),
    [
        ("empty.jsonl", "", "holds no prompts"),
        ("empty.json", "[]", "holds no prompts"),
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n', "at line 3"),
        ("bad.json", '[\n{"prompt": "a"},\n}', "at line 3"),
        ("blank.json", '[{"prompt": "  "}]', "record 0"),
    ],
    ids=["empty-jsonl", "empty-json", "jsonl-line", "json-line", "blank-prompt"],
)
def test_a_bad_data_file_is_named_with_its_line(tmp_path, name, content, named):
    file = tmp_path / name
    file.write_text(content)
    with pytest.raises(ValueError, match=named) as info:
        read_prompts(str(file))
    assert str(file) in str(info.value)


def test_a_data_file_that_is_not_utf8_is_named(tmp_path):
    file = tmp_path / "latin1.jsonl"
    file.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompts(str(file))


def test_every_bundled_file_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in patterns["jaxsr"] for p in (ROOT / "jaxsr").glob(pattern)}
    data_files = {p for p in BUNDLED_DIR.iterdir() if p.suffix in (".json", ".md")}
    assert data_files and data_files <= shipped


def test_no_file_of_the_repository_reaches_outside_it():
    """A user's machine has only the repository: nothing may read the workspace folder beside it."""
    # the workspace folder by a relative path, as text or as Path parts (not matching this line)
    outside = re.compile(r"\.\./shared|shared['\"]?\s*/\s*['\"]?data")
    small = [p for p in repository_files() if p.stat().st_size < 2e6]
    offenders = [p for p in small if outside.search(p.read_bytes().decode(errors="replace"))]
    assert offenders == []
