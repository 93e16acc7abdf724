"""Test setup: 8 fake CPU devices (to test sharding) and no network for Hugging Face libraries."""

import os

# XLA:CPU compiles without LLVM's optimisations and with its older, quicker-to-compile fusion emitters:
# the suite's programs are tiny and mostly run a few times, so compiling is most of its time (half of it
# with these two). TPU and GPU plans are compiled by their own backends, which these flags do not reach.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc
from pathlib import Path

# Converted parameters, shared by the test workers and every process they start (README blocks,
# notebooks and CLI runs load SmolLM2's GGUF again and again: 21 s converted, 8 s read back here);
# tests of the cache itself set their own.
os.environ.setdefault(
    "JAXSR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "params")
)

# XLA's persistent compilation cache, shared by the test workers and every process they start (README
# blocks, notebooks, the CLI): they compile the same SmolLM2 programs again and again. Programs that
# compile in under 0.2 s are not stored. A size limit turns on JAX's file lock, so concurrent workers
# never read a half-written entry.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax
import pytest

MAPS = Path("/proc/self/maps")
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")


def _memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's limit on them), where Linux says."""
    try:
        with MAPS.open() as maps:
            return sum(1 for _ in maps), int(MAX_MAP_COUNT.read_text())
    except OSError:
        return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after a test once they hold half the kernel's memory-map
    limit. Each XLA:CPU executable keeps about a dozen mappings, and jit caches keep every executable
    of every tiny model the suite builds; past `vm.max_map_count` (65530 by default) LLVM's next
    allocation fails and the compiler segfaults. No user process compiles thousands of programs."""
    yield
    maps = _memory_maps()
    if maps is not None and maps[0] > maps[1] // 2:
        jax.clear_caches()
        gc.collect()
