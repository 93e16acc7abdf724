"""NVIDIA GPUs a plan compiles for without owning one: each GPU's published figures, the target
description XLA's CUDA compiler takes in their place (a `GpuTargetConfigProto` in text form, written
here from those figures), and jax's CUDA plugin, found only when a GPU target is asked for.

The plugin (`jax-cuda12-plugin`, with `jax-cuda12-pjrt` and NVIDIA's `nvidia-cuda-nvcc-cu12` for the
ptxas it runs) is kept beside the environment's packages (`make setup`: `.venv/cuda-plan`): installed
among them, every jax process on a machine without a GPU would try to start it and print CUDA's
start-up errors. Registered late, once this process's own backends are up, it only describes GPUs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import jax

MIB = 2**20

JAX_MEMORY_FRACTION = 0.75
"""The share of a GPU's memory JAX's allocator takes by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`,
https://docs.jax.dev/en/latest/gpu_memory_allocation.html): what `jaxsr run` sizes its batches by there
(the devices' `bytes_limit`), so what a plan gives one program."""

SIDE_PACKAGES = Path(sys.prefix) / "cuda-plan"
"""Where `make setup` installs the plugin and ptxas, beside the environment's packages."""

PLUGIN = "jax_plugins.xla_cuda12"
INSTALL_HINT = (
    "planning for a GPU needs jax's CUDA plugin and NVIDIA's ptxas: pip install 'jaxsr[plan]' "
    f"(make setup installs them in {SIDE_PACKAGES})"
)


@dataclasses.dataclass(frozen=True)
class Capability:
    """A CUDA compute capability's limits: the CUDA C++ Programming Guide's "Technical Specifications
    per Compute Capability" table
    (https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications)."""

    major: int
    minor: int
    shared_memory_per_sm: int
    """Shared memory per multiprocessor."""
    shared_memory_per_block_optin: int
    """The most shared memory one block may ask for (opting in beyond the 48 KiB every block gets)."""
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    threads_per_warp: int = 32
    registers_per_sm: int = 64 * 1024
    registers_per_block: int = 64 * 1024
    shared_memory_per_block: int = 48 * 1024
    grid_limit: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    """The most blocks in a grid's x, y and z dimensions."""


AMPERE = Capability(8, 0, shared_memory_per_sm=164 * 1024, shared_memory_per_block_optin=163 * 1024)
HOPPER = Capability(9, 0, shared_memory_per_sm=228 * 1024, shared_memory_per_block_optin=227 * 1024)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model's figures (the SXM parts of an 8-GPU HGX board)."""

    name: str
    """As CUDA names the device (jax's `device_kind`)."""
    capability: Capability
    sms: int
    """Streaming multiprocessors."""
    fp32_lanes_per_sm: int
    """FP32 cores per multiprocessor."""
    clock_ghz: float
    """Boost clock."""
    l2_bytes: int
    memory_bytes: int
    """Device memory as CUDA reports it (nvidia-smi's total; the datasheet rounds it)."""
    memory_bytes_per_s: float
    """Peak memory bandwidth."""
    bf16_flops: float
    """Peak dense bf16 tensor-core FLOP/s (the datasheets' figures with sparsity, halved)."""


GPUS: dict[str, Gpu] = {
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # (A100 80GB SXM: bf16 312 TFLOPS, 2,039 GB/s) and the Ampere whitepaper
    # https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf
    # (108 SMs, 64 FP32 cores per SM, 1410 MHz boost, 40 MB L2); nvidia-smi shows 81920 MiB
    "a100-80": Gpu("NVIDIA A100-SXM4-80GB", AMPERE, 108, 64, 1.41, 40 * MIB, 81920 * MIB, 2039e9, 312e12),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM: bf16
    # 1,979 TFLOPS with sparsity, 3.35 TB/s) and the Hopper whitepaper
    # https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper (H100 SXM5: 132 SMs, 128
    # FP32 cores per SM, 50 MB L2); 1980 MHz its highest clock; nvidia-smi shows 81559 MiB
    "h100": Gpu("NVIDIA H100 80GB HBM3", HOPPER, 132, 128, 1.98, 50 * MIB, 81559 * MIB, 3.35e12, 989.5e12),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e, 4.8 TB/s, bf16 1,979 TFLOPS
    # with sparsity): the H100's processor with more, faster memory (L2 as the H100's: the datasheet
    # gives none); nvidia-smi shows 143771 MiB
    "h200": Gpu("NVIDIA H200", HOPPER, 132, 128, 1.98, 50 * MIB, 143771 * MIB, 4.8e12, 989.5e12),
}

DNN_VERSION = (9, 8, 0)
"""The oldest cuDNN jax-cuda12-plugin 0.10.2 runs with (its `nvidia-cudnn-cu12>=9.8` requirement)."""


def device_info(gpu: Gpu) -> dict[str, int | float]:
    """The `gpu_device_info` fields of a GPU, as XLA's CUDA compiler reads them. XLA 0.10.2 needs
    the warp size, the grid's x limit, the opt-in shared memory and the compute capability to compile
    at all; the multiprocessors, FP32 lanes, clock, shared memory per block, registers per block,
    threads per multiprocessor, L2, memory and bandwidth each change the program it compiles."""
    cc = gpu.capability
    return {
        "threads_per_block_limit": cc.threads_per_block,
        "threads_per_warp": cc.threads_per_warp,
        "shared_memory_per_block": cc.shared_memory_per_block,
        "shared_memory_per_core": cc.shared_memory_per_sm,
        "threads_per_core_limit": cc.threads_per_sm,
        "core_count": gpu.sms,
        "fpus_per_core": gpu.fp32_lanes_per_sm,
        "block_dim_limit_x": cc.grid_limit[0],
        "block_dim_limit_y": cc.grid_limit[1],
        "block_dim_limit_z": cc.grid_limit[2],
        "memory_bandwidth": int(gpu.memory_bytes_per_s),
        "l2_cache_size": gpu.l2_bytes,
        "clock_rate_ghz": gpu.clock_ghz,
        "device_memory_size": gpu.memory_bytes,
        "shared_memory_per_block_optin": cc.shared_memory_per_block_optin,
        "registers_per_core_limit": cc.registers_per_sm,
        "registers_per_block_limit": cc.registers_per_block,
    }


def target_config(gpu: Gpu) -> str:
    """The GPU as a `GpuTargetConfigProto` in protobuf text form (what jax's CUDA topology takes)."""
    cc, (major, minor, patch) = gpu.capability, DNN_VERSION
    fields = [f"  {name}: {value}" for name, value in device_info(gpu).items()]
    return "\n".join(
        [
            "gpu_device_info {",
            *fields,
            f"  cuda_compute_capability {{ major: {cc.major} minor: {cc.minor} }}",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}",
            f'device_description_str: "{gpu.name}"',
        ]
    )


def plugin_location() -> Path | None:
    """The directory holding jax's CUDA plugin package: among the environment's packages or beside
    them (`SIDE_PACKAGES`); None where neither has it."""
    if (SIDE_PACKAGES / "jax_plugins" / "xla_cuda12").is_dir():
        return SIDE_PACKAGES
    spec = importlib.util.find_spec(PLUGIN) if importlib.util.find_spec("jax_plugins") else None
    return None if spec is None or spec.origin is None else Path(spec.origin).parents[2]


def has_ptxas(packages: Path) -> bool:
    """Whether XLA will find a ptxas: NVIDIA's nvcc package beside the plugin, or one on the PATH."""
    packaged = packages / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    return packaged.is_file() or shutil.which("ptxas") is not None


def has_cuda_plan() -> bool:
    """Whether GPU targets can be compiled for here (the plugin registered or found, and a ptxas)."""
    location = plugin_location()
    return location is not None and has_ptxas(location)


def register_cuda_plugin() -> None:
    """Make jax's CUDA plugin describe GPUs in this process (raises ImportError without it): after this
    process's own backends are up, so it never becomes one of them; its check of the CUDA runtime's
    version is skipped (there is no runtime: nothing runs)."""
    from jaxlib import xla_client

    jax.devices()
    if xla_client.pjrt_plugin_loaded("cuda"):
        return
    location = plugin_location()
    if location is None or not has_ptxas(location):
        raise ImportError(INSTALL_HINT)
    if str(location) not in sys.path:
        sys.path.append(str(location))
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    importlib.import_module(PLUGIN).initialize()


def cuda_devices(gpu: Gpu, count: int) -> tuple[jax.Device, ...]:
    """`count` GPUs of one host as jax's CUDA plugin describes them from `target_config(gpu)`."""
    from jax.experimental import topologies

    register_cuda_plugin()
    # topology: partitions × hosts × GPUs per host
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(gpu), topology=f"1x1x{count}"
    )
    return tuple(topology.devices)
