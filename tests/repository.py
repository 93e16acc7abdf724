"""The repository as a user's clone holds it: its files (tracked, or new and not ignored) and copies."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def repository_files() -> list[Path]:
    """Every file of the checkout that a commit would carry; skips the test outside a git checkout."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def copy_repository(destination: Path) -> Path:
    """The repository's files copied into `destination` (a clone, without its history)."""
    for path in repository_files():
        target = destination / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return destination
