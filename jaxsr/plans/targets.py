"""Accelerators a plan compiles for without owning one: TPU slices and NVIDIA GPU hosts, their chips'
datasheet figures, and their devices as descriptions (`pip install jaxsr[plan]`): libtpu's topology
descriptions for TPUs, jax's CUDA plugin given each GPU's figures for GPUs (`jaxsr.plans.gpus`).

A TPU target is named as Google Cloud names the slice (`v5e-8`: v5e and v6e count chips, v5p and v4
count TensorCores, two per chip); a GPU target by its GPU and their count on one host (`h100x8`). Its
devices are descriptions only: programs compile for them, nothing runs on them, and the process's own
backend stays what it was (e.g. `JAX_PLATFORMS=cpu`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxsr.plans import gpus
from jaxsr.sharding import make_mesh

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's figures (per chip; a v4/v5p chip's two TensorCores act as one device)."""

    kind: str
    """libtpu's topology prefix (`v5e` in `v5e:2x4`), or a GPU's key in `gpus.GPUS` (`h100`)."""
    hbm_bytes: int
    """High-bandwidth memory on the datasheet (a GPU's: as CUDA reports it)."""
    usable_bytes: int
    """What one program may use: on a TPU the capacity libtpu 0.0.42 names when it refuses a program;
    on a GPU the share of its memory JAX's allocator takes by default (`gpus.JAX_MEMORY_FRACTION`)."""
    bf16_flops: float
    """Peak dense bf16 FLOP/s."""
    hbm_bytes_per_s: float
    """Peak HBM bandwidth."""
    chip_config: str | None = None
    """libtpu's `chip_config_name` (v4: its TensorCores fused as one device, `megacore`)."""
    cores_per_chip: int = 1
    """TensorCores the slice name counts per chip."""
    platform: str = "tpu"
    """jax's platform: `tpu`, or `cuda` (whose compiler does not refuse a program too big: a plan does)."""
    host_chips: int = 4
    """Chips one host (VM) holds: a larger slice is several hosts, each a job process of its own."""


CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, "HBM2 capacity and bandwidth 16 GB, 819 GBps",
    # 8 chips per host
    "v5e": Chip("v5e", 16 * GIB, int(15.75 * GIB), 197e12, 819e9, host_chips=8),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, HBM 32 GB per chip, 1640 GBps, 8 chips per host
    "v6e": Chip("v6e", 32 * GIB, int(31.25 * GIB), 918e12, 1640e9, host_chips=8),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, HBM2e "95 GB" per chip, 2765 GBps; libtpu
    # gives one program 95.74 GiB of it, more than 95 GiB: the chip holds 96 GiB (the page rounds down)
    "v5p": Chip("v5p", 96 * GIB, int(95.74 * GIB), 459e12, 2765e9, cores_per_chip=2),
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, HBM2 32 GiB per chip, 1200 GBps
    "v4": Chip("v4", 32 * GIB, int(30.75 * GIB), 275e12, 1200e9, "megacore", cores_per_chip=2),
}
"""Datasheet figures from the Google Cloud TPU docs' system-architecture pages (URL beside each; v5p and
v4 hosts hold 4 chips); `usable_bytes` as libtpu 0.0.42's out-of-memory refusals state it."""


def gpu_chip(kind: str) -> Chip:
    """A GPU's figures (`gpus.GPUS`) as a plan's chip."""
    gpu = gpus.GPUS[kind]
    usable = int(gpu.memory_bytes * gpus.JAX_MEMORY_FRACTION)
    return Chip(
        kind, gpu.memory_bytes, usable, gpu.bf16_flops, gpu.memory_bytes_per_s, platform="cuda", host_chips=8
    )


CHIPS.update({kind: gpu_chip(kind) for kind in gpus.GPUS})
GPU_COUNTS = (1, 2, 4, 8)
"""GPUs of one host a plan describes; more are hosts of 8 (`h100x16`: two)."""

TOPOLOGIES: dict[str, dict[int, str]] = {
    "v5e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v6e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v5p": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
    "v4": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
}
"""Chips of each slice libtpu describes → its topology (a 2D torus for v5e/v6e, 3D for v5p/v4)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice of `chips` chips of one kind, e.g. `v5e-8`, or GPUs on hosts of 8 (`h100x16`)."""

    name: str
    chip: Chip
    chips: int

    @property
    def hosts(self) -> int:
        """Hosts the chips are on: a job runs a process on each, on that host's chips alone (its mesh
        of `jax.local_devices()`), with its share of the prompts."""
        return -(-self.chips // self.chip.host_chips)

    @property
    def host(self) -> Target:
        """One host's chips: what every program of a plan is compiled for."""
        return dataclasses.replace(self, chips=min(self.chips, self.chip.host_chips))

    @property
    def topology(self) -> str:
        """libtpu's topology name of one host's chips, e.g. `v5e:2x4` (a TPU slice's)."""
        return f"{self.chip.kind}:{TOPOLOGIES[self.chip.kind][self.host.chips]}"


def target_names() -> str:
    """The names `target` takes, for its errors."""
    tpus = ", ".join(f"{kind}-N" for kind in TOPOLOGIES)
    counts = "/".join(map(str, GPU_COUNTS))
    gpu_names = ", ".join(f"{kind}xN" for kind in gpus.GPUS)
    return f"TPU slices {tpus}; GPUs {gpu_names} (N = {counts}, or a multiple of 8: hosts of 8)"


def _count(text: str) -> int | None:
    """The count a target name ends in: ASCII digits only (`str.isdigit` takes "²", which int() refuses)."""
    return int(text) if text.isascii() and text.isdigit() else None


def target(name: str) -> Target:
    """The slice a Cloud TPU name (`v5e-8`, `v6e-16`, `v5p-8`, `v4-8`) stands for, or the GPUs a GPU
    name (`h100x8`, `h200x4`, `a100-80x8`; `h100x16`: two hosts of 8) does."""
    kind, x, count = str(name).rpartition("x")
    if x and kind in gpus.GPUS:
        gpus_ = _count(count)
        if gpus_ is None or not (gpus_ in GPU_COUNTS or gpus_ % 8 == 0 < gpus_):
            raise ValueError(
                f"target: {name} is no {kind} host this plan describes; GPUs: {GPU_COUNTS} on one host, "
                "or a multiple of 8 on hosts of 8"
            )
        return Target(str(name), CHIPS[kind], gpus_)
    kind, _, count = str(name).partition("-")
    chip, cores = CHIPS.get(kind), _count(count)
    if kind not in TOPOLOGIES or cores is None or cores % chip.cores_per_chip:
        raise ValueError(f"target: expected a name like v5e-8 or h100x8 ({target_names()}), got {name!r}")
    chips = cores // chip.cores_per_chip
    if chips not in TOPOLOGIES[kind]:
        sizes = [n * chip.cores_per_chip for n in TOPOLOGIES[kind]]
        raise ValueError(f"target: {name} is no {kind} slice this plan describes; sizes: {sizes}")
    return Target(str(name), chip, chips)


LIBRARY_ENV = "TPU_LIBRARY_PATH"
"""jax's variable naming a libtpu.so: libtpu kept out of the environment's packages (where every jax
process on a machine without TPUs would try, and fail noisily, to start it) still describes slices."""
SIDE_LIBTPU = Path(sys.prefix) / "libtpu" / "libtpu" / "libtpu.so"
"""Where `make setup` installs libtpu (`pip install --target .venv/libtpu`): beside the environment's
packages, found by `side_libtpu`, as `gpus.SIDE_PACKAGES` is for GPU plans."""


def side_libtpu() -> Path | None:
    """`SIDE_LIBTPU` where jax would find no libtpu of its own (TPU_LIBRARY_PATH unset, no `libtpu`
    package), else None."""
    if LIBRARY_ENV in os.environ or importlib.util.find_spec("libtpu") is not None:
        return None
    return SIDE_LIBTPU if SIDE_LIBTPU.is_file() else None


def has_libtpu() -> bool:
    """Whether libtpu can be found: the file `TPU_LIBRARY_PATH` names, the `libtpu` package, or the one
    `make setup` installed (`side_libtpu`)."""
    named = os.environ.get(LIBRARY_ENV)
    found = (named is not None and Path(named).is_file()) or importlib.util.find_spec("libtpu") is not None
    return found or side_libtpu() is not None


@contextlib.contextmanager
def naming_side_libtpu() -> Iterator[None]:
    """TPU_LIBRARY_PATH names `side_libtpu()`, if any, while jax loads libtpu: set once this process's
    own backends are up (so jax never starts libtpu as one of them: it only describes slices), unset
    after (so a process this one starts does not try it either)."""
    side = side_libtpu()
    if side is None:
        yield
        return
    jax.devices()
    os.environ[LIBRARY_ENV] = str(side)
    try:
        yield
    finally:
        os.environ.pop(LIBRARY_ENV, None)


@functools.cache
def target_devices(slice_: Target) -> tuple[jax.Device, ...]:
    """One host's devices of the target (all of them on one host) as libtpu or jax's CUDA plugin
    describes them (raises ImportError without the one it needs)."""
    from jax.experimental import topologies

    if slice_.chip.platform == "cuda":
        return gpus.cuda_devices(gpus.GPUS[slice_.chip.kind], slice_.host.chips)
    if not has_libtpu():  # a clear error here rather than an opaque one from the backend
        raise ImportError(
            f"planning for a TPU needs libtpu: pip install 'jaxsr[plan]', or set {LIBRARY_ENV} to a "
            f"libtpu.so (make setup installs one at {SIDE_LIBTPU})"
        )
    # a plan compiles, never runs: several processes may describe slices at once (libtpu's lock file
    # otherwise refuses a second process)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # libtpu looks for the host's TPU at start-up and prints a page of warnings when there is none;
    # any value here stops the search (a description needs no host)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", slice_.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    config = {} if slice_.chip.chip_config is None else {"chip_config_name": slice_.chip.chip_config}
    with naming_side_libtpu():
        topology = topologies.get_topology_desc(topology_name=slice_.topology, platform="tpu", **config)
    return tuple(topology.devices)


def target_mesh(slice_: Target, data: int = -1, model: int = 1) -> Mesh:
    """A ('data', 'model') mesh of one host's devices of the slice (`jaxsr.sharding.make_mesh`), as
    each of its job processes makes."""
    return make_mesh(data, model, target_devices(slice_))
