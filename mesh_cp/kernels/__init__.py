"""Block-attention kernels behind one interface, chosen by name from a small registry.

Each backend lives in its own module and only that module imports its kernel library. Every
registered kernel class declares what it takes and runs as data, its class attribute ``capabilities``
(a :class:`Capabilities`: the optional keywords of :class:`BlockKernel` it takes, its devices, dtypes and
head-dim limits), and has ``not_supported_reasons(device, dtype, head_dim) -> tuple[str, ...]``, every
reason it cannot run such inputs there (empty: it can), which ``"auto"`` and named choices consult.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Literal, get_args

import torch

from mesh_cp.kernels.base import (
    NO_CAPABILITIES,
    OPTIONAL_KEYWORDS,
    BlockKernel,
    Capabilities,
    capabilities_of,
    out_for_delta,
)

logger = logging.getLogger("mesh_cp")

KernelName = Literal[
    "reference", "cpu_flash", "cuda_sdpa", "cuda_flash", "flash_attn", "cuda_cudnn", "flash_attn3", "flash_attn4"
]

# name -> (module, class); imported lazily so a missing optional library only matters when chosen.
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("mesh_cp.kernels.reference", "ReferenceKernel"),
    "cpu_flash": ("mesh_cp.kernels.cpu_flash", "CpuFlashKernel"),
    "cuda_sdpa": ("mesh_cp.kernels.cuda_sdpa", "CudaSdpaKernel"),
    "cuda_flash": ("mesh_cp.kernels.cuda_flash", "CudaFlashKernel"),
    "flash_attn": ("mesh_cp.kernels.flash_attn", "FlashAttnKernel"),
    "cuda_cudnn": ("mesh_cp.kernels.cudnn", "CudnnKernel"),
    "flash_attn3": ("mesh_cp.kernels.flash_attn3", "FlashAttn3Kernel"),
    "flash_attn4": ("mesh_cp.kernels.flash_attn4", "FlashAttn4Kernel"),
}
# Compute capabilities where "auto" puts FlashAttention 4, 3 and cuDNN first (cuDNN where PyTorch itself prefers it:
# sdp_utils.cpp, check_prefer_cudnn_attention; flash-attn 3 is built for Hopper, flash-attn 4 for Hopper and Blackwell).
_FA4_MAJORS = (9, 10)
_FA3_MAJOR = 9
_CUDNN_FIRST = ((9, 0), (10, 0), (10, 3))
KERNEL_NAMES: tuple[str, ...] = get_args(KernelName)
_CACHE: dict[str, BlockKernel] = {}
# (device, dtype, head_dim, needs, flash impl) -> (kernel name, reason), decided and logged once.
_AUTO: dict[tuple, tuple[str, str]] = {}
# (name, device, dtype, head_dim, flash impl) -> every reason that kernel cannot run such inputs (empty: it can).
_WHY: dict[tuple, tuple[str, ...]] = {}


def _flash_impl() -> str | None:
    """The flash implementation activated in PyTorch's dispatcher (``torch.nn.attention.current_flash_attention_impl``,
    ``None`` for the default): the kernel decisions are made per implementation, as ``cuda_flash`` cannot run under
    an activated one (Note [Activated flash implementations] in :mod:`mesh_cp.kernels.cuda_flash`)."""
    current = getattr(getattr(torch.nn, "attention", None), "current_flash_attention_impl", None)
    return None if current is None else current()


def _kernel_class(name: str) -> type:
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel {name!r}; choose one of {sorted(_REGISTRY)} or 'auto'")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def get_kernel(name: str) -> BlockKernel:
    """The kernel registered as ``name`` (one of :data:`KERNEL_NAMES`)."""
    if name not in _CACHE:
        _CACHE[name] = _kernel_class(name)()
    return _CACHE[name]


def not_supported_reasons(
    name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> tuple[str, ...]:
    """Every reason kernel ``name`` cannot run ``dtype`` inputs of ``head_dim`` on ``device`` (empty: it can;
    ``head_dim=None`` leaves head-dim limits unchecked). Decided once per arguments."""
    key = (name, device, dtype, head_dim, _flash_impl())
    if key not in _WHY:
        _WHY[key] = tuple(_kernel_class(name).not_supported_reasons(device, dtype, head_dim))
    return _WHY[key]


def takes(kernel: str | BlockKernel, keyword: str) -> bool:
    """Whether a kernel (by name or object) takes the optional keyword ``keyword`` of :class:`BlockKernel`:
    ``"mask"`` (a boolean mask), ``"segments"`` (flash-attn varlen sequences) or ``"softcap"``, as its
    ``capabilities`` declare (:class:`Capabilities`; a kernel without them takes none). Raises ``ValueError``
    for any other name."""
    if keyword not in OPTIONAL_KEYWORDS:
        raise ValueError(f"unknown kernel keyword {keyword!r}; one of {list(OPTIONAL_KEYWORDS)}")
    return keyword in capabilities_of(_kernel_class(kernel) if isinstance(kernel, str) else kernel).keywords


def forget_choices() -> None:
    """Forget every kernel decision and instance, so the next call looks again (for example after
    installing flash-attn in a running process, or between tests that emulate other machines)."""
    _AUTO.clear()
    _WHY.clear()
    _CACHE.clear()


def candidates(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels ``"auto"`` tries, best first.

    CUDA fp16/bf16: on compute capability 9.x and 10.x ``flash_attn4`` (FlashAttention 4, when installed) first,
    then on 9.x ``flash_attn3`` (FlashAttention 3) and, on 9.0, 10.0 and 10.3, ``cuda_cudnn`` (PyTorch's cuDNN
    attention); then ``flash_attn`` (flash-attn 2), ``cuda_flash`` (PyTorch's FlashAttention 2), ``cuda_sdpa``
    (memory-efficient), ``reference``. CUDA fp32: ``cuda_sdpa``,
    ``reference``; CUDA fp64: ``reference``. CPU: ``cpu_flash``, ``reference``; other devices: ``reference``.
    :func:`choose` takes the first whose ``not_supported_reasons`` are empty.
    """
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            return (*_hopper_first(device), "flash_attn", "cuda_flash", "cuda_sdpa", "reference")
        if dtype == torch.float32:
            return ("cuda_sdpa", "reference")
        return ("reference",)
    if device.type == "cpu":
        return ("cpu_flash", "reference")
    return ("reference",)


def _hopper_first(device: torch.device) -> tuple[str, ...]:
    """The kernels ``"auto"`` puts before flash-attn 2 on this CUDA device (none on ROCm)."""
    if torch.version.hip:
        return ()
    capability = tuple(torch.cuda.get_device_capability(device))
    fa4 = ("flash_attn4",) if capability[0] in _FA4_MAJORS and _importable("flash_attn.cute.interface") else ()
    fa3 = ("flash_attn3",) if capability[0] == _FA3_MAJOR else ()
    return fa4 + fa3 + (("cuda_cudnn",) if capability in _CUDNN_FIRST else ())


def _importable(module: str) -> bool:
    """Whether ``module`` is in ``sys.modules`` or can be found (finding imports its parent packages, nothing of it);
    an install that is found but fails to import is still offered, and passed over with the reason."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a parent missing, None in sys.modules, or failing to import: not installed here
        return False


def _usable(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> list[str]:
    return [name for name in KERNEL_NAMES if not not_supported_reasons(name, device, dtype, head_dim)]


def choose(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None, *, needs: tuple[str, ...] = ()
) -> tuple[str, str]:
    """``(name, reason)`` of the kernel ``"auto"`` uses for such inputs: the first of :func:`candidates` that can run
    them and takes one of the optional keywords of every entry of ``needs`` (``"mask|segments"``: a masked call,
    whose tiles go to a kernel taking neither only through the reference kernel; ``"softcap"``); for a mask that no
    candidate but the reference kernel takes, the first that can run the inputs (only the masked tiles then go to the
    reference kernel), for a softcap the reference kernel (a kernel that does not softcap runs every block on it). Decided once per ``(device, dtype,
    head_dim, needs)`` and logged then (logger ``mesh_cp``, with every reason each better candidate was passed over:
    ``name: reason; reason``, candidates apart by `` | ``); never raises because a preferred kernel is unusable."""
    key = (device, dtype, head_dim, tuple(needs), _flash_impl())
    if key not in _AUTO:
        runnable, passed = [], []
        for name in candidates(device, dtype):
            why = not_supported_reasons(name, device, dtype, head_dim)
            lacks = [need for need in needs if not any(takes(name, k) for k in need.split("|"))]
            if not why and not lacks:
                break
            if not why:
                runnable.append(name)
                why = tuple(f"takes no {' or '.join(need.split('|'))}" for need in lacks)
            passed.append(f"{name}: {'; '.join(why)}")
        if name == "reference" and runnable and "softcap" not in needs:
            name = runnable[0]  # only the reference kernel takes masks: it runs the masked tiles, the rest runs fast
        what = f"{dtype} head_dim {head_dim} on {device}" + (f" taking {', '.join(needs)}" if needs else "")
        reason = f"kernel 'auto' chose {name!r} for {what}" + (f" ({' | '.join(passed)})" if passed else "")
        slow = device.type == "cuda" and name == "reference" and dtype != torch.float64
        (logger.warning if slow else logger.info)("mesh_cp: %s", reason)
        _AUTO[key] = (name, reason)
    return _AUTO[key]


def resolve_kernel(
    kernel: str | BlockKernel,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    *,
    needs: tuple[str, ...] = (),
) -> BlockKernel:
    """A kernel object from a name, ``"auto"`` or an object implementing :class:`BlockKernel`.

    ``"auto"``: :func:`choose` for ``(device, dtype, head_dim, needs)``. A named kernel that cannot run such
    inputs raises ``NotImplementedError`` with every reason and the kernels that can. ``head_dim=None``
    leaves head-dim limits unchecked (pass ``q.shape[-1]``).
    """
    if isinstance(kernel, str):
        if kernel == "auto":
            return get_kernel(choose(device, dtype, head_dim, needs=needs)[0])
        why = not_supported_reasons(kernel, device, dtype, head_dim)
        if why:
            raise NotImplementedError(
                f"kernel {kernel!r} cannot run {dtype} head_dim {head_dim} on {device}: {'; '.join(why)}; "
                f"kernels that can: {_usable(device, dtype, head_dim)} (or kernel='auto')"
            )
        return get_kernel(kernel)
    if not isinstance(kernel, BlockKernel):
        raise ValueError(
            f"kernel must be a name in {sorted(_REGISTRY)}, 'auto', or an object with forward/backward "
            f"(mesh_cp.kernels.BlockKernel); got {type(kernel).__name__}"
        )
    return kernel


__all__ = [
    "KERNEL_NAMES",
    "NO_CAPABILITIES",
    "OPTIONAL_KEYWORDS",
    "BlockKernel",
    "Capabilities",
    "KernelName",
    "candidates",
    "capabilities_of",
    "choose",
    "forget_choices",
    "get_kernel",
    "not_supported_reasons",
    "out_for_delta",
    "resolve_kernel",
    "takes",
]
