"""The flash-attn (Dao-AILab) kernel on CUDA: native GQA, fp16/bf16, sm80+. Needs ``flash-attn>=2.6.3``.

This is the only module that imports ``flash_attn``.

Note [flash-attn private API]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
mesh_cp calls ``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``
(the public functions do not take a global lse). Their two forms, read from the releases::

    2.6.3   _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, return_softmax)
              -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
            _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                 causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None)
              -> (dq, dk, dv, softmax_d)
    2.7.x,  _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
    2.8.x                       window_size_right, softcap, alibi_slopes, return_softmax)
              -> (out, softmax_lse, S_dmask, rng_state)
            _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                 causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                 deterministic, rng_state=None) -> softmax_d

From 2.7 both are ``torch.library.custom_op`` s under torch >= 2.4 (their parameter names live in
the op's schema, not in ``inspect.signature``), and the C++ requires ``head_dim % 8 == 0`` and
``<= 256`` in forward too (2.6.3 padded in C++ and returned ``out`` unpadded; its backward already
required padded ``q, k, v, out``). So this kernel pads q, k, v, dO and out with zeros to a multiple
of 8 itself for every version (``softmax_scale`` keeps the original head dim), cuts the results
back, and is not offered above 256; a gradient on the lse at head_dim 256 goes by parts (Note
[Gradient of the lse] in :mod:`mesh_cp.kernels.base`). ``dq, dk, dv`` are written into the buffers
passed in, for both forms. ``softmax_lse`` is ``(B, H, Sq)`` fp32. ``deterministic`` follows
``torch.are_deterministic_algorithms_enabled()``; no dropout (so ``rng_state`` is ``None``), no
window, no softcap, no ALiBi. The form is chosen by the installed version and cross-checked against
the parameter names where they can be read; a disagreement is refused rather than guessed.

flash-attn 3 (the ``flash_attn_interface`` module of the ``hopper/`` build) is not offered: it is
built from source with no release that fixes its private ``_flash_attn_forward`` (34 parameters,
renamed and reordered across commits: ``window_size`` pairs, ``attention_chunk``, ``sm_margin``,
module ``flash_attn_3_cuda`` vs ``flash_attn_3_gpu``), so no call into it can be exact by
construction. On sm90 ``"auto"`` uses flash-attn 2 or ``cuda_flash``.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import torch
from torch import Tensor

from mesh_cp.kernels.base import backward_by_parts, fused_backward_inputs, pad_head_dim, round_up

MIN_VERSION = (2, 6, 3)
SPLIT_WINDOW_VERSION = (2, 7, 0)
"""From this version the private API takes ``window_size_left/right`` and returns 4 values."""
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


def _parameter_names(fn: object) -> frozenset[str] | None:
    """Parameter names of ``fn``: its signature, or for a ``torch.library.custom_op`` (whose signature
    is ``(*args, **kwargs)``) its op schema; ``None`` when neither can be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    names = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if names:
        return names
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    return frozenset(a.name for a in schema.arguments) if schema is not None else None


def load() -> tuple[ModuleType, str, bool]:
    """``(flash_attn_interface, version, split_window)``, or ``RuntimeError`` naming why flash-attn is unusable.

    Import failures of a broken or binary-mismatched install (``ImportError``, ``OSError``,
    ``RuntimeError``), a version below :data:`MIN_VERSION`, and private functions whose parameter
    names contradict the version all raise.
    """
    try:
        flash_attn = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, OSError, RuntimeError) as err:
        raise RuntimeError(
            f"flash-attn cannot be imported ({type(err).__name__}: {err}); install a build matching this "
            f"torch and CUDA (pip install 'mesh-cp[flash]')"
        ) from err
    version = str(getattr(flash_attn, "__version__", "0"))
    if _version_tuple(version) < MIN_VERSION:
        raise RuntimeError(
            f"flash-attn {version} is too old; mesh_cp needs >= {'.'.join(map(str, MIN_VERSION))} "
            f"(pip install -U 'mesh-cp[flash]')"
        )
    split = _version_tuple(version) >= SPLIT_WINDOW_VERSION
    expected = {"window_size_left", "window_size_right"} if split else {"window_size"}
    for fn_name in ("_flash_attn_forward", "_flash_attn_backward"):
        fn = getattr(interface, fn_name, None)
        if fn is None:
            raise RuntimeError(f"flash-attn {version} has no flash_attn_interface.{fn_name}")
        names = _parameter_names(fn)
        if names is not None and not expected <= names:
            raise RuntimeError(
                f"flash-attn {version}: {fn_name} takes {sorted(names)}, not the parameters {sorted(expected)} "
                f"of its version's private API (Note [flash-attn private API]); use kernel='cuda_flash'"
            )
    return interface, version, split


class FlashAttnKernel:
    """``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` (flash-attn 2.6.3+, both
    private-API forms; Note [flash-attn private API])."""

    name = "flash_attn"

    def __init__(self, *, check_device: bool = True) -> None:
        self._fa, self.version, self._split_window = load()
        if check_device and not torch.cuda.is_available():
            raise RuntimeError("kernel 'flash_attn' needs CUDA; on CPU use kernel='cpu_flash'")

    @classmethod
    def without_device_check(cls) -> FlashAttnKernel:
        """The kernel without the CUDA-availability check, for tests that run it on emulated
        flash-attn modules with CPU tensors. flash-attn itself still needs CUDA tensors."""
        return cls(check_device=False)

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        """Why this kernel cannot run such inputs (``None``: it can)."""
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        if dtype not in DTYPES:
            return f"flash-attn supports {[str(d) for d in DTYPES]}, not {dtype}"
        if head_dim is not None and round_up(head_dim, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM:
            return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
        if torch.version.hip:
            return "flash-attn's ROCm build has another API; not offered there"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return f"flash-attn 2 needs compute capability >= 8.0 (Ampere), got {major}.{minor}"
        try:
            load()
        except RuntimeError as err:
            return str(err)
        return None

    def _window(self) -> dict:
        return {"window_size_left": -1, "window_size_right": -1} if self._split_window else {"window_size": (-1, -1)}

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        dim = q.shape[-1]
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded).contiguous() for t in (q, k, v))
        result = self._fa._flash_attn_forward(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
        )
        out, lse = (result[0], result[1]) if self._split_window else (result[0], result[5])
        return out[..., :dim], lse

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        lse_grad: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dim = q.shape[-1]
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        if lse_grad and round_up(dim + 1, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM:
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale)
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        do, q, k, v, out = (t.contiguous() for t in (do, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            do,
            q,
            k,
            v,
            out,
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            rng_state=None,
        )
        return dq[..., :dim], dk[..., :dim], dv[..., :dim]
