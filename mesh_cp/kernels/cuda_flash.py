"""CUDA kernel through PyTorch's own copy of FlashAttention 2 (fp16/bf16, sm80+, native GQA).

``aten._scaled_dot_product_flash_attention`` / ``_scaled_dot_product_flash_attention_backward``
(arguments unchanged from torch 2.4 to 2.13; outputs 6 and 7 were named ``philox_seed``,
``philox_offset`` before)::

    (query, key, value, dropout_p, is_causal, return_debug_mask, *, scale)
        -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
     is_causal, philox_seed, philox_offset, *, scale) -> (grad_query, grad_key, grad_value)

Tensors are ``(B, H, S, D)``; K and V may have fewer heads (GQA). The lse is ``(B, H, Sq)`` fp32,
unpadded. The op does not pad the head dim: its C++ requires ``D % 8 == 0`` and ``D <= 256``
("this is ensured by padding", which ``F.scaled_dot_product_attention`` does before calling it), so
this kernel pads with zeros and cuts the outputs back. ``cum_seq_q/k`` are undefined (``None``) for
dense batches; the philox tensors are read only with dropout.

Masked tiles go through the varlen form of the ops underneath (``aten._flash_attention_forward`` /
``_flash_attention_backward``, which call ``mha_varlen_fwd`` / ``mha_varlen_bwd`` of PyTorch's
``cuda/flash_attn/flash_api.cpp`` when ``cum_seq_q`` is given)::

    (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
     window_size_left, window_size_right, seqused_k, alibi_slopes[, block_table, num_splits])
        -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)
    (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
     rng_state, unused, *, scale, window_size_left, window_size_right) -> (dq, dk, dv)

(read from torch 2.13's schemas and meta functions, ``torch/_meta_registrations.py``, and from PyTorch's
``flash_api.cpp`` / ``attention_backward.cu`` on main; outputs and arguments 13, 14 were ``philox_seed``,
``philox_offset`` before, and ``block_table``, ``num_splits`` are newer keywords with defaults). ``query
(total_q, H, D)``, ``key, value (total_k, Hkv, D)``, int32 ``cum_seq_*``, ``logsumexp (H, total_q)`` fp32 (the
meta function says the same); an absent window is ``-1`` (``value_or(-1)``), and windows obey Note [Varlen
windows] in :mod:`mesh_cp.kernels.varlen`. There is no softcap (the op passes ``softcap = 0``). The window
keywords are passed only for a call with a bound side, after reading the op's schema: the 2.5.1 schema has them,
but no 2.4 source was at hand, so a PyTorch without them refuses such a tile with the reason instead of
ignoring the window.

Note [Activated flash implementations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.nn.attention.activate_flash_attention_impl("FA4")`` (or ``"FA3"``) re-registers the CUDA kernels of the
flash ops this kernel calls (``_scaled_dot_product_flash_attention``, ``_flash_attention_forward`` and their
backwards) for the whole process, to flash-attn-4 (or 3) through PyTorch's shims, until
``torch.nn.attention.restore_flash_attention_impl()``. Read from torch 2.13's ``torch/nn/attention/_registry.py``
(the active implementation is the public ``current_flash_attention_impl()``, ``None`` for the default) and
``_fa4.py``: ``_fa4_run_forward`` does ``out, lse = module._flash_attn_fwd(...)``, while
``flash_attn.cute.interface._flash_attn_fwd`` returns four values since ``4.0.0b19`` (Note [flash-attn 4 API] in
:mod:`mesh_cp.kernels.flash_attn4`), so every forward of this kernel would raise there; and an FA3 or FA4 behind
these ops has other limits than FlashAttention 2's (head dims, GPUs, windows: Note [Varlen windows] in
:mod:`mesh_cp.kernels.varlen` is FlashAttention 2's), which this kernel was not built on. So while any
implementation is active this kernel is refused by name (:func:`activated_impl_reason`), in
``not_supported_reasons`` and, since a choice is made once per inputs and an implementation may be activated
later, again by each forward and backward before calling an op (a read of one module global).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from mesh_cp.kernels import varlen
from mesh_cp.kernels.base import (
    Capabilities,
    CudaOnlyKernel,
    backward_by_parts,
    cut_head_dim,
    fused_backward_inputs,
    pad_head_dim,
    round_up,
)

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


_USE_INSTEAD = {"FA4": "flash_attn4", "FA3": "flash_attn3"}


def active_flash_impl() -> str | None:
    """The flash attention implementation activated in PyTorch's dispatcher (``"FA4"``, ``"FA3"``), ``None`` for
    the default or a PyTorch without the switch (``torch.nn.attention.current_flash_attention_impl``, public in
    torch 2.13)."""
    current = getattr(getattr(torch.nn, "attention", None), "current_flash_attention_impl", None)
    return None if current is None else current()


def activated_impl_reason() -> str | None:
    """Why this kernel cannot run now that an implementation is activated (Note [Activated flash
    implementations]); ``None`` when none is."""
    active = active_flash_impl()
    if active is None:
        return None
    crash = (
        f"torch {torch.__version__}'s FA4 shim unpacks two values from flash-attn-4's forward, which returns four "
        f"since 4.0.0b19, so every forward raises; "
        if active == "FA4"
        else ""
    )
    return (
        f"flash attention implementation {active!r} is active (torch.nn.attention.activate_flash_attention_impl): "
        f"PyTorch's flash ops are then not its FlashAttention 2, which this kernel is built on; {crash}"
        f"use kernel='{_USE_INSTEAD.get(active, 'flash_attn')}', or call "
        f"torch.nn.attention.restore_flash_attention_impl()"
    )


def _refuse_activated_impl() -> None:
    reason = activated_impl_reason()
    if reason is not None:
        raise RuntimeError(f"kernel 'cuda_flash': {reason}")


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device; ``(0, 0)`` for others (``meta`` tensors in tests)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _no_backward(padded: int, capability: tuple[int, int], what: str) -> str | None:
    """Why the kernel has no backward for a padded head dim of ``padded`` on a GPU of ``capability``: PyTorch's own
    dispatch (sdp_utils: ..._gt192_constraints_on_sm86_89_or_120) refuses training with head dims in (192, 224] on
    these GPUs."""
    if capability in ((8, 6), (8, 9), (12, 0), (12, 1)) and 192 < padded <= 224:
        return f"{what} (padded to {padded}) in (192, 224] has no backward on compute capability {capability}"
    return None


def _refused_width(padded: int, capability: tuple[int, int], what: str) -> str | None:
    """Why the kernel cannot train with a padded head dim of ``padded`` on a GPU of ``capability``."""
    if padded > MAX_HEAD_DIM:
        return f"{what} > {MAX_HEAD_DIM}"
    return _no_backward(padded, capability, what)


@functools.cache
def _op_parameters() -> frozenset[str]:
    """Parameter names of ``aten._flash_attention_forward`` in this PyTorch (read once)."""
    return frozenset(a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments)


def _window(window: tuple[int, int]) -> dict:
    """The window keywords of a varlen op call: none for no bound (the op's default is ``-1``), else both sides."""
    if window == (-1, -1):
        return {}
    if "window_size_left" not in _op_parameters():
        raise NotImplementedError(
            f"torch {torch.__version__}: aten._flash_attention_forward takes no window, which a masked tile with "
            f"window {window} needs; use kernel='flash_attn' or 'reference', or a newer PyTorch"
        )
    return {"window_size_left": window[0], "window_size_right": window[1]}


@functools.lru_cache(maxsize=16)
def _no_rng(device: torch.device) -> Tensor:
    """The philox seed and offset arguments of a backward without dropout (the ops read them only with dropout): one
    tensor per device, not one allocation per call."""
    return torch.empty((), device=device, dtype=torch.int64)


def _varlen_forward(call: varlen.VarlenCall, q: Tensor, k: Tensor, v: Tensor, *, scale: float):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        call.cu_seqlens_q,
        call.cu_seqlens_k,
        call.max_seqlen_q,
        call.max_seqlen_k,
        0.0,
        False,
        False,
        scale=scale,
        **_window(call.window),
    )
    return out, lse


def _varlen_backward(call: varlen.VarlenCall, do, q, k, v, out, lse, *, scale: float):
    no_rng = _no_rng(q.device)
    return torch.ops.aten._flash_attention_backward(
        do,
        q,
        k,
        v,
        out,
        lse,
        call.cu_seqlens_q,
        call.cu_seqlens_k,
        call.max_seqlen_q,
        call.max_seqlen_k,
        0.0,
        False,
        no_rng,
        no_rng,
        scale=scale,
        **_window(call.window),
    )


class CudaFlashKernel(CudaOnlyKernel):
    """``aten._scaled_dot_product_flash_attention`` and its backward, on CUDA tensors."""

    name = "cuda_flash"
    capabilities = Capabilities(
        keywords={"segments"},
        devices=("cuda",),
        dtypes=DTYPES,
        head_dim_multiple=HEAD_DIM_MULTIPLE,
        max_head_dim=MAX_HEAD_DIM,
        gaps=True,  # rows between sequences read in place (Note [Sequences without queries])
        dq_in_input_dtype=True,
    )
    """``forward`` and ``backward`` take ``segments`` (a masked tile as varlen sequences,
    :mod:`mesh_cp.kernels.varlen`; then ``causal=False``)."""

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, a ROCm or
        flash-less PyTorch build, an activated flash implementation (Note [Activated flash implementations]), and
        on a CUDA device its compute capability (at least 8.0, and no head dim whose backward PyTorch refuses
        there)."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        activated = activated_impl_reason()
        reasons += [activated] if activated else []
        if torch.version.hip:
            reasons.append("PyTorch's flash kernel on ROCm has other limits; not offered there")
        available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if not available():
            reasons.append("this PyTorch build has no flash attention kernel")
        if device.type != "cuda" or torch.version.hip:
            return tuple(reasons)
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            reasons.append(f"FlashAttention needs compute capability >= 8.0 (Ampere), got {major}.{minor}")
        if head_dim is not None:
            width = _no_backward(round_up(head_dim, HEAD_DIM_MULTIPLE), (major, minor), f"head_dim {head_dim}")
            reasons += [width] if width else []
        return tuple(reasons)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, segments: varlen.Segments | None = None
    ) -> tuple[Tensor, Tensor]:
        _refuse_activated_impl()
        dim = q.shape[-1]
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        plan = None if segments is None else varlen.plan_for(q, k, segments, causal)
        q, k, v = (pad_head_dim(t, padded) for t in (q, k, v))
        if plan is not None:
            out, lse = varlen.forward(q, k, v, plan, functools.partial(_varlen_forward, scale=scale))
            return (*cut_head_dim(out, dim=dim), lse)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
        )
        return out.transpose(1, 2)[..., :dim], lse

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
    ) -> tuple[Tensor, Tensor, Tensor]:
        _refuse_activated_impl()
        dim = q.shape[-1]
        plan = None if segments is None else varlen.plan_for(q, k, segments, causal)
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        # The delta column must fit the kernel's head dims too (at 192 on sm86/89/120 it does not).
        if lse_grad and _refused_width(round_up(dim + 1, HEAD_DIM_MULTIPLE), _capability(q.device), "delta column"):
            if plan is None:
                return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale)
            lse, delta = varlen.stats_on_segments(lse, delta, plan)
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale, segments=segments)
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        if plan is not None:
            run = functools.partial(_varlen_backward, scale=scale)
            dq, dk, dv = varlen.backward(do, q, k, v, out, lse.float(), plan, run)
            return cut_head_dim(dq, dk, dv, dim=dim)
        no_rng = _no_rng(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.float().contiguous(),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
        return dq.transpose(1, 2)[..., :dim], dk.transpose(1, 2)[..., :dim], dv.transpose(1, 2)[..., :dim]


PAGE = 256
"""Rows of a page of a paged K/V cache: ``mha_varlen_fwd`` takes pages of a multiple of 256 rows."""


def decode_reasons(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, ...]:
    """Every reason :func:`decode_forward` cannot run a step of ``dtype`` and ``head_dim`` on ``device`` (empty: it
    can; Note [Flash decode] in :mod:`mesh_cp.runtime.decode`). Asked every layer and step: what cannot change in a
    process is looked up; only the active flash implementation (a user may switch it) is read each time."""
    reasons = _fixed_decode_reasons(device, dtype, head_dim)
    active = active_flash_impl()
    if active is not None:
        reasons += (f"flash attention implementation {active!r} is active (the paged call is FlashAttention 2's)",)
    return reasons


@functools.lru_cache(maxsize=64)
def _fixed_decode_reasons(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, ...]:
    reasons = list(CudaFlashKernel.capabilities.not_supported_reasons(device, dtype, head_dim))
    if head_dim % HEAD_DIM_MULTIPLE:
        reasons.append(f"head_dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} (the cache would be padded)")
    if torch.version.hip:
        reasons.append("PyTorch's flash kernel on ROCm has other limits; not offered there")
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if not available():
        reasons.append("this PyTorch build has no flash attention kernel")
    missing = sorted({"seqused_k", "block_table"} - _op_parameters())
    if missing:
        reasons.append(f"torch {torch.__version__}: aten._flash_attention_forward takes no {missing}")
    if device.type == "cuda" and not torch.version.hip and _capability(device) < (8, 0):
        reasons.append(f"FlashAttention needs compute capability >= 8.0 (Ampere), got {_capability(device)}")
    return tuple(reasons)


@functools.lru_cache(maxsize=16)
def _decode_tables(batch: int, slots: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``cu_seqlens_q``, ``cu_seqlens_k`` (int32) and the block table of one query per row over one page per row,
    built once per shape (no call writes them)."""
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    return cu_q, cu_q * slots, table


def decode_forward(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """One query per row over a paged cache, in place (Note [Flash decode] in :mod:`mesh_cp.runtime.decode`): ``q
    (B, Hq, D)``; ``k, v (B, C, Hkv, D)``, any strides but the last (a ``.transpose(1, 2)`` view of ``(B, Hkv, C,
    D)`` storage), ``C`` a multiple of :data:`PAGE`; ``lengths (B,)`` int32: row ``b`` attends its first
    ``lengths[b]`` entries (held to ``0 .. C``). Returns ``out (B, Hq, D)`` in ``q``'s dtype and ``lse (B, Hq)`` fp32;
    a row of length 0 gets ``0`` and ``-inf``."""
    batch, slots = k.shape[:2]
    if slots % PAGE or k.stride(-1) != 1 or v.stride(-1) != 1 or lengths.dtype != torch.int32:
        raise ValueError(
            f"a flash decode step reads pages of a multiple of {PAGE} rows with a contiguous last dim and int32 "
            f"lengths; got {slots} rows, strides {k.stride()} / {v.stride()}, lengths {lengths.dtype}"
        )
    cu_q, cu_k, table = _decode_tables(batch, slots, q.device)
    # One page per row: the kernel reads row b's keys at k[table[b, 0]], the first seqused_k[b] of them. A row of
    # none reads one (its result is replaced below): the kernel's write for an empty row lands on another row's lse.
    # Lengths are held to the page: a longer one would read past it, into the next row's page.
    used = lengths.clamp(0, slots)
    extra = {"num_splits": 1} if _splits_corrupt(batch, q.shape[1], k.shape[2]) else {}
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, 1, slots, 0.0, False, False, scale=scale, seqused_k=used.clamp_min(1),
        block_table=table, **extra,
    )  # fmt: skip
    empty = (used == 0)[:, None]
    return out.masked_fill(empty[..., None], 0.0), lse.transpose(0, 1).masked_fill(empty, float("-inf"))


def _splits_corrupt(batch: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel's own choice of splits would write wrong rows (Note [Flash decode]): PyTorch 2.13 (which
    first passes ``num_splits`` to FlashAttention 2) picks several for a paged call, whose combine then writes every
    row over the first unless the query heads were swapped in (GQA, one query per row)."""
    swapped = heads > kv_heads
    return batch > 1 and not swapped and TorchVersion(torch.__version__) >= "2.13.0.dev0"
