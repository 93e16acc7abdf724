"""What every benchmark records next to its numbers: the machine, versions and the exact command."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    import jax

    versions = {}
    for package in ("jax", "jaxlib", "flax", "numpy", "transformers", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_name(),
        "cpu_count": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        "python": sys.version.split()[0],
        "versions": versions,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    tmp.replace(path)
    return path


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of `rows` (floats with 3 significant digits)."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
