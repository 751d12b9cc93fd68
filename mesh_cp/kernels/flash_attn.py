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

From 2.7 these (and the varlen pair below) are ``torch.library.custom_op`` s under torch >= 2.4 (their
parameter names live in
the op's schema, not in ``inspect.signature``), and the C++ requires ``head_dim % 8 == 0`` and
``<= 256`` in forward too (2.6.3 padded in C++ and returned ``out`` unpadded; its backward already
required padded ``q, k, v, out``). So this kernel pads q, k, v, dO and out with zeros to a multiple
of 8 itself for every version (``softmax_scale`` keeps the original head dim), cuts the results
back, and is not offered above 256; a gradient on the lse at head_dim 256 goes by parts (Note
[Gradient of the lse] in :mod:`mesh_cp.kernels.base`; not with softcap, which then raises). ``dq, dk, dv``
are written into the buffers passed in, for both forms. ``softmax_lse`` is ``(B, H, Sq)`` fp32.
``deterministic`` follows ``torch.are_deterministic_algorithms_enabled()``; no dropout (so ``rng_state`` is
``None``), no ALiBi. The form is chosen by the installed version and cross-checked against the parameter
names where they can be read; a disagreement is refused rather than guessed.

Masked tiles go through the varlen pair (read from ``flash_attn/flash_attn_interface.py`` at v2.6.3,
v2.7.0, v2.7.3, v2.7.4.post1 and v2.8.3), whose parameters up to ``max_seqlen_k`` have the same places in every
release (the window and the return tuple change as above)::

    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, <window>, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
        seqused_k[, zero_tensors])    (zero_tensors from 2.7.3; returns as _flash_attn_forward above)
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, <window>, softcap, alibi_slopes,
        deterministic, rng_state=None[, zero_tensors])

with ``q (total_q, H, D)``, ``k, v (total_k, Hkv, D)``, int32 ``cu_seqlens`` and ``softmax_lse (H, total_q)``
fp32 (Note [Varlen windows] in :mod:`mesh_cp.kernels.varlen`, which also says how windows are passed).

Softcap: ``softcap > 0`` makes the logits ``softcap * tanh(s * softmax_scale / softcap)`` in the forward
(``set_params_fprop``: ``params.softcap = softmax_scale / softcap``, ``scale_softmax = softcap``) and the
backward multiplies ``dS`` by the tanh derivative (``calculate_dtanh``). Every supported release has it in
both directions (the backward came in 2.6.2, "backwards for softcapping (#1033)"); ``0.0`` turns it off.
Builds with ``FLASHATTENTION_DISABLE_SOFTCAP`` refuse it from C++.

flash-attn 3 (the ``flash_attn_interface`` module of the ``hopper/`` build) is its own kernel,
``flash_attn3`` (:mod:`mesh_cp.kernels.flash_attn3`), which accepts only the interface forms it was read
against and calls every argument by name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType

import torch
from torch import Tensor

from mesh_cp.core.options import positive_or_none
from mesh_cp.kernels import varlen
from mesh_cp.kernels.base import (
    Capabilities,
    backward_by_parts,
    cut_head_dim,
    fused_backward_inputs,
    pad_head_dim,
    round_up,
)

MIN_VERSION = (2, 6, 3)
SPLIT_WINDOW_VERSION = (2, 7, 0)
"""From this version the private API takes ``window_size_left/right`` and returns 4 values."""
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
PRIVATE_FUNCTIONS = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)


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
    for fn_name in PRIVATE_FUNCTIONS:
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


def _softcap(softcap: float | None) -> float:
    """flash-attn's ``softcap`` argument: ``0.0`` (off) for ``None``."""
    if softcap is None:
        return 0.0
    return float(positive_or_none("softcap", softcap))


class FlashAttnKernel:
    """``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` and their varlen pair for masked
    tiles (flash-attn 2.6.3+, both private-API forms; Note [flash-attn private API]).

    Beyond :class:`~mesh_cp.kernels.BlockKernel`: ``segments`` (a masked tile as varlen sequences,
    :mod:`mesh_cp.kernels.varlen`; then ``causal=False``) and ``softcap`` (logits ``c * tanh(s / c)``).
    """

    name = "flash_attn"
    capabilities = Capabilities(
        keywords={"segments", "softcap"},
        devices=("cuda",),
        dtypes=DTYPES,
        head_dim_multiple=HEAD_DIM_MULTIPLE,
        max_head_dim=MAX_HEAD_DIM,
        gaps=True,  # rows between sequences read in place (Note [Sequences without queries])
        dq_in_input_dtype=True,
    )

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
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, ROCm, on a
        CUDA device a compute capability below 8.0, and a flash-attn that :func:`load` refuses (imported here)."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        if torch.version.hip:
            reasons.append("flash-attn's ROCm build has another API; not offered there")
        elif device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 0):
                reasons.append(f"flash-attn 2 needs compute capability >= 8.0 (Ampere), got {major}.{minor}")
        try:
            load()
        except RuntimeError as err:
            reasons.append(str(err))
        return tuple(reasons)

    def _window(self, left: int = -1, right: int = -1) -> dict:
        return (
            {"window_size_left": left, "window_size_right": right}
            if self._split_window
            else {"window_size": (left, right)}
        )

    def _options(self, scale: float, softcap: float, window: tuple[int, int] = (-1, -1)) -> dict:
        """The keyword arguments every call shares (no dropout, no ALiBi)."""
        return {
            "dropout_p": 0.0,
            "softmax_scale": scale,
            **self._window(*window),
            "softcap": softcap,
            "alibi_slopes": None,
        }

    def _out_lse(self, result: tuple) -> tuple[Tensor, Tensor]:
        return (result[0], result[1]) if self._split_window else (result[0], result[5])

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        segments: varlen.Segments | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        dim, cap = q.shape[-1], _softcap(softcap)
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        plan = None if segments is None else varlen.plan_for(q, k, segments, causal)
        q, k, v = (pad_head_dim(t, padded) for t in (q, k, v))
        if plan is not None:  # the varlen calls take contiguous rows gathered from q, k, v
            out, lse = varlen.forward(q, k, v, plan, functools.partial(self._varlen_forward, scale=scale, softcap=cap))
        else:
            q, k, v = (t.contiguous() for t in (q, k, v))
            result = self._fa._flash_attn_forward(
                q, k, v, causal=causal, **self._options(scale, cap), return_softmax=False
            )
            out, lse = self._out_lse(result)
        return (*cut_head_dim(out, dim=dim), lse)

    def _varlen_forward(self, call: varlen.VarlenCall, q, k, v, *, scale: float, softcap: float):
        result = self._fa._flash_attn_varlen_forward(
            q,
            k,
            v,
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            causal=False,
            **self._options(scale, softcap, call.window),
            return_softmax=False,
        )
        return self._out_lse(result)

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
        segments: varlen.Segments | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dim, cap = q.shape[-1], _softcap(softcap)
        plan = None if segments is None else varlen.plan_for(q, k, segments, causal)
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        if lse_grad and round_up(dim + 1, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM:
            if plan is not None:
                lse, delta = varlen.stats_on_segments(lse, delta, plan)
            extra = {"segments": segments, "softcap": softcap}
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale, **extra)
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        if plan is not None:  # the varlen calls take contiguous rows gathered from these
            run = functools.partial(self._varlen_backward, scale=scale, softcap=cap)
            dq, dk, dv = varlen.backward(do, q, k, v, out, lse.float(), plan, run)
        else:
            do, q, k, v, out = (t.contiguous() for t in (do, q, k, v, out))
            lse = lse.float().contiguous()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            self._fa._flash_attn_backward(
                do,
                q,
                k,
                v,
                out,
                lse,
                dq,
                dk,
                dv,
                causal=causal,
                **self._options(scale, cap),
                deterministic=torch.are_deterministic_algorithms_enabled(),
                rng_state=None,
            )
        return cut_head_dim(dq, dk, dv, dim=dim)

    def _varlen_backward(self, call: varlen.VarlenCall, do, q, k, v, out, lse, *, scale: float, softcap: float):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(
            do,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            causal=False,
            **self._options(scale, softcap, call.window),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            rng_state=None,
        )
        return dq, dk, dv
