"""Block-attention kernels behind one interface, chosen by name from a small registry.

Each backend lives in its own module and only that module imports its kernel library.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Literal, get_args

import torch

from mesh_cp.kernels.base import BlockKernel, out_for_delta

KernelName = Literal["reference", "cpu_flash", "cuda_sdpa", "flash_attn"]

# name -> (module, class); imported lazily so a missing optional library only matters when chosen.
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("mesh_cp.kernels.reference", "ReferenceKernel"),
    "cpu_flash": ("mesh_cp.kernels.cpu_flash", "CpuFlashKernel"),
    "cuda_sdpa": ("mesh_cp.kernels.cuda_sdpa", "CudaSdpaKernel"),
    "flash_attn": ("mesh_cp.kernels.flash_attn", "FlashAttnKernel"),
}
KERNEL_NAMES: tuple[str, ...] = get_args(KernelName)
_CACHE: dict[str, BlockKernel] = {}


def get_kernel(name: str) -> BlockKernel:
    """The kernel registered as ``name`` (one of :data:`KERNEL_NAMES`)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel {name!r}; choose one of {sorted(_REGISTRY)} or 'auto'")
    if name not in _CACHE:
        module, cls = _REGISTRY[name]
        _CACHE[name] = getattr(importlib.import_module(module), cls)()
    return _CACHE[name]


def _flash_attn_usable(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    return importlib.util.find_spec("flash_attn") is not None


def resolve_kernel(kernel: str | BlockKernel, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """A kernel object from a name, ``"auto"`` or an object implementing :class:`BlockKernel`.

    ``"auto"``: on CPU ``cpu_flash``; on CUDA ``flash_attn`` for fp16/bf16 when installed, otherwise
    ``cuda_sdpa``.
    """
    if isinstance(kernel, str):
        if kernel == "auto":
            if device.type == "cuda":
                kernel = "flash_attn" if _flash_attn_usable(dtype) else "cuda_sdpa"
            else:
                kernel = "cpu_flash"
        return get_kernel(kernel)
    if not isinstance(kernel, BlockKernel):
        raise ValueError(
            f"kernel must be a name in {sorted(_REGISTRY)}, 'auto', or an object with forward/backward "
            f"(mesh_cp.kernels.BlockKernel); got {type(kernel).__name__}"
        )
    return kernel


__all__ = ["KERNEL_NAMES", "BlockKernel", "KernelName", "get_kernel", "out_for_delta", "resolve_kernel"]
