"""An mkdocs hook: the benchmark plots under benchmarks/results/ (outside docs/) go into the site.

Pages link them as `../benchmarks/results/NAME.png`, the path that holds in the repository (GitHub
renders it); the site gets each file at `benchmarks/results/NAME.png` and the links are rewritten to it."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = "benchmarks/results"


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).parent
    for path in sorted((root / RESULTS).glob("*.png")):
        files.append(File.generated(config, f"{RESULTS}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    depth = page.file.src_uri.count("/")
    return markdown.replace(f"../{RESULTS}/", "../" * depth + f"{RESULTS}/")
