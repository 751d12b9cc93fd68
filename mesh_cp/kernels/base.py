"""The block-attention kernel interface every backend implements, and what the fused backends share.

Note [Gradient of the lse]
~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``p_ij = exp(s_ij - lse_i)``, ``O_i = sum_j p_ij v_j`` and ``lse_i = log sum_j exp(s_ij)``, a loss
that reads both ``O`` and ``lse`` has ``d lse_i / d s_ij = p_ij``, so::

    ds_ij = p_ij * (dp_ij - rowsum(dO_i * O_i)) + p_ij * dlse_i = p_ij * (dp_ij - delta_i)
    delta_i = rowsum(dO_i * O_i) - dlse_i          (dp = dO v^T)

Every block of a row takes the row's *global* ``lse`` and ``delta`` (``O`` is the row's final output).
Fused flash backward kernels do not take ``delta``: they take ``out`` and form ``rowsum(dO * out)``
themselves. Two constructions give them an ``out`` whose row sum with ``dO`` is the wanted ``delta``:

1. :func:`out_for_delta`, ``o = dO * delta / |dO|^2``: exact when no gradient reaches the lse
   (``delta = rowsum(dO * O)``): a row with ``dO = 0`` has ``delta = 0`` and gets ``o = 0``, and
   ``|o| = |delta| / |dO| <= |O|`` (Cauchy-Schwarz), so ``o`` fits wherever ``O`` does (each row is
   scaled by its largest ``|dO|`` first, so ``|dO|^2`` does not underflow for tiny rows). With a
   gradient on the lse it fails: a row with ``dO = 0`` and ``delta = -dlse != 0`` has no such ``o``,
   and a tiny ``|dO|`` overflows fp16. Such rows get ``nan`` (``dO = 0``) or ``inf`` (overflow),
   never a silently wrong gradient.
2. :func:`with_delta_column`, used when the lse receives a gradient (``lse_grad=True``): one more
   head-dim column, ``0`` in ``q, k, v`` (scores and ``dp = dO v^T`` are unchanged: the added terms
   are ``0 * x``), ``s`` in ``dO`` and ``delta / s`` in ``out``, whose other columns are ``0``; the
   kernel's ``rowsum(dO * out)`` is then ``s * (delta / s) = delta`` (``s`` is a power of two near
   ``sqrt|delta|``, so both factors stay in fp16's range and the product is exact up to one rounding
   of ``delta / s`` to the input dtype). The extra columns of ``dq, dk, dv`` are dropped. Kernels
   that need ``head_dim % 8 == 0`` pad to the next multiple of 8 instead of by one. It costs a padded
   copy of ``q, k, v, dO``, so it is used only when the lse may receive a gradient: when
   :func:`~mesh_cp.runtime.attention.mesh_attn_func` was asked for it (``return_lse=True``), which
   is known without a host sync and equal on every rank of the mesh (its call check compares it).

Where one more column exceeds a kernel's head-dim limit (flash kernels at ``head_dim == 256``),
:func:`backward_by_parts` splits ``ds = p * dp - p * delta`` over three calls of the kernel itself.

Every rank of a mesh must pass the same ``lse_grad``, since the blocks of one row are computed on
several ranks; :class:`~mesh_cp.runtime.attention.MeshAttnFunc` derives it from ``return_lse``. A
block called with ``lse_grad=False`` for a row whose lse has a gradient would meet
``dO = 0, delta != 0`` in construction 1, which returns ``nan`` there rather than a silently
dropped gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.nn import functional as F

from mesh_cp.core.numerics import acc_dtype, widened
from mesh_cp.kernels.fused import Fused

if TYPE_CHECKING:
    from mesh_cp.kernels.varlen import Segments

OPTIONAL_KEYWORDS: tuple[str, ...] = ("mask", "segments", "softcap")
"""The optional keywords of :class:`BlockKernel` ``forward`` and ``backward`` (:attr:`Capabilities.keywords`)."""


@dataclass(frozen=True)
class Capabilities:
    """What a block kernel takes and runs, as data. Every registered kernel class declares one as its class
    attribute ``capabilities``; :func:`~mesh_cp.kernels.takes` reads its ``keywords``, and the class's
    ``not_supported_reasons`` starts from :meth:`not_supported_reasons` (then adds what is not data: a library
    that must import, the GPU's compute capability, ...).

    A kernel object without ``capabilities`` (a user's own :class:`BlockKernel`) is taken as declaring
    :data:`NO_CAPABILITIES`: no optional keyword, and no limit checked before it runs.
    """

    keywords: frozenset[str] = frozenset()
    """The optional keywords its ``forward`` and ``backward`` take, of :data:`OPTIONAL_KEYWORDS`: ``"mask"`` (a
    boolean mask broadcastable to ``(B, Hq, Sq, Sk)``, ``True`` where a query attends a key), ``"segments"`` (a
    masked tile as flash-attn varlen sequences, :mod:`mesh_cp.kernels.varlen`; then ``causal=False``) and
    ``"softcap"`` (logits ``c * tanh(s / c)``). Any iterable of names is stored as a ``frozenset``."""
    devices: tuple[str, ...] | None = None
    """The device types (``torch.device.type``) it runs on; ``None``: any."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """The input dtypes it runs; ``None``: any."""
    head_dim_multiple: int = 1
    """It pads the head dim with zeros to a multiple of this (exact: zero columns change no score)."""
    max_head_dim: int | None = None
    """The largest head dim it runs, after that padding; ``None``: no limit."""
    dq_in_input_dtype: bool = False
    """Its ``backward`` returns ``dq`` in ``q.dtype`` (``lse_grad=False``), as the flash kernels do: a Q chunk's ``dq``
    of one call may then travel as it is (Note [Partials as computed] in :mod:`mesh_cp.core.row_partials`)."""
    gaps: bool = False
    """Its ``segments`` may leave key rows between sequences that no sequence reads, and it reads them in place
    (flash-attn's ``seqused_k``) rather than gathering the rows it reads: a chunk call's row groups then read the
    keys from one section of the layout each (Note [Keys in global order] in :mod:`mesh_cp.core.key_layout`)."""

    def __post_init__(self) -> None:
        keywords = frozenset(self.keywords)
        if not keywords <= set(OPTIONAL_KEYWORDS):
            raise ValueError(
                f"unknown keywords {sorted(keywords - set(OPTIONAL_KEYWORDS))}; of {list(OPTIONAL_KEYWORDS)}"
            )
        if self.head_dim_multiple < 1:
            raise ValueError(f"head_dim_multiple must be >= 1, got {self.head_dim_multiple}")
        object.__setattr__(self, "keywords", keywords)

    def not_supported_reasons(self, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason these limits refuse ``dtype`` inputs of ``head_dim`` on ``device`` (empty: they allow them;
        ``head_dim=None`` leaves head-dim limits unchecked)."""
        reasons = []
        if self.devices is not None and device.type not in self.devices:
            reasons.append(f"needs {' or '.join(d.upper() for d in self.devices)} tensors, got {device.type}")
        if self.dtypes is not None and dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} is not one of {[str(d) for d in self.dtypes]}")
        if head_dim is not None and self.max_head_dim is not None:
            padded = round_up(head_dim, self.head_dim_multiple)
            if padded > self.max_head_dim:
                width = f"head_dim {head_dim}" + ("" if padded == head_dim else f" (padded to {padded})")
                reasons.append(f"{width} > {self.max_head_dim}")
        return tuple(reasons)


NO_CAPABILITIES = Capabilities()
"""What a kernel object without ``capabilities`` declares: no optional keyword, no limit."""


def capabilities_of(kernel: object) -> Capabilities:
    """The :class:`Capabilities` a kernel class or object declares (:data:`NO_CAPABILITIES` without any)."""
    caps = getattr(kernel, "capabilities", NO_CAPABILITIES)
    if not isinstance(caps, Capabilities):
        raise TypeError(
            f"kernel {getattr(kernel, 'name', kernel)!r}: capabilities must be a mesh_cp.kernels.Capabilities, "
            f"got {type(caps).__name__}"
        )
    return caps


@runtime_checkable
class BlockKernel(Protocol):
    """Attention of one Q block against one KV block, returning the softmax statistics.

    Shapes (flash-attn layout): ``q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hkv, D)`` with ``Hq % Hkv == 0``;
    GQA/MQA heads are expanded, if at all, inside the kernel. ``causal`` is only ever asked for
    square blocks (``Sq == Sk``) and is top-left aligned. ``scale`` multiplies ``q k^T`` (kernels that
    pad the head dim keep it).

    The optional keywords ``mask``, ``segments`` and ``softcap`` (:attr:`Capabilities.keywords`) are passed only
    to a kernel whose class attribute ``capabilities`` (a :class:`Capabilities`) says it takes them, so a kernel
    declares in its signatures exactly the keywords its capabilities name. A kernel without ``capabilities`` is
    taken as declaring none (:data:`NO_CAPABILITIES`): it gets none of them, and masked tiles and softcapped
    logits go to the reference kernel instead.
    """

    name: str

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Tensor | None = None,
        segments: Segments | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Return ``out (B, Sq, Hq, D)`` in ``q.dtype`` and ``lse (B, Hq, Sq)`` in fp32 (fp64 for fp64).

        ``mask``: boolean, broadcastable to ``(B, Hq, Sq, Sk)``, ``True`` where a query attends a key;
        ``segments``: a masked tile as flash-attn varlen sequences (:mod:`mesh_cp.kernels.varlen`, with
        ``causal=False``); ``softcap``: logits ``softcap * tanh(s / softcap)``. Each only when the kernel's
        capabilities take it. A row that attends nothing gets ``out = 0`` and ``lse = -inf``.
        """
        ...

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
        mask: Tensor | None = None,
        segments: Segments | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one block given the row's *global* ``lse`` and ``delta``.

        ``delta = rowsum(dO * O) - dlse`` for the row's final output ``O`` and the gradient ``dlse`` that
        reaches the row's lse (Note [Gradient of the lse]). ``lse_grad=False`` promises that no gradient
        reaches the lse (``delta = rowsum(dO * O)`` exactly, so ``delta = 0`` wherever ``dO = 0``);
        ``lse_grad=True`` allows any ``delta``. ``lse`` and ``delta`` are ``(B, Hq, Sq)`` fp32 (fp64 for
        fp64). ``mask``, ``segments`` and ``softcap`` as in :meth:`forward`, only when the kernel takes them.
        Returns ``dq (B, Sq, Hq, D)`` and ``dk, dv (B, Sk, Hkv, D)`` (in ``q.dtype`` or wider).
        """
        ...


class CudaOnlyKernel:
    """Base of the kernels that run ATen's CUDA ops: constructing one without CUDA raises, naming the
    kernel; :meth:`without_device_check` skips that check for tests that run the kernel on ``meta``
    tensors (shape and dtype checks against the ops' meta functions) or under an emulation of the ops.
    The ops themselves still need CUDA (or meta) tensors."""

    name: str

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"kernel {self.name!r} needs CUDA; on CPU use kernel='cpu_flash'")

    @classmethod
    def without_device_check(cls):
        return cls.__new__(cls)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_head_dim(x: Tensor, dim: int) -> Tensor:
    """``x (..., D)`` padded with zeros to ``(..., dim)`` (``x`` itself when ``D == dim``)."""
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def cut_head_dim(*xs: Tensor, dim: int) -> tuple[Tensor, ...]:
    """Each ``x (..., D')`` cut back to ``(..., dim)`` (``x`` itself when ``D' == dim``, not a new view)."""
    return tuple(x if x.shape[-1] == dim else x[..., :dim] for x in xs)


def out_for_delta(do: Tensor, delta: Tensor) -> Tensor:
    """A tensor ``o`` with ``rowsum(do * o) == delta`` when ``delta = rowsum(dO * O)`` (no lse gradient).

    Construction 1 of Note [Gradient of the lse]: ``o = do * delta / |do|^2``, bounded by ``|O|``.
    Rows with ``do = 0`` get ``o = 0`` when ``delta = 0`` there and ``nan`` otherwise (a gradient on
    the lse that this construction cannot carry; use :func:`with_delta_column`).
    ``do (B, S, H, D)``, ``delta (B, H, S)``; the result is ``do.dtype``.
    """
    # o = u * (delta / m) / |u|^2 with u = do / m, m = max|do| of the row: |u|^2 is in [1, D], so
    # neither it nor the quotient underflows however small do is. |do| and its maximum are exact in do's dtype, and
    # do enters the division in delta's dtype (widened); the last product is rounded to do's dtype as it is stored.
    # A row of zeros takes m = 1 and |u|^2 = 1 by adding the boolean `zero` (exact: x + 0 and 0 + 1).
    acc = delta.dtype
    top = do.abs().amax(-1, keepdim=True).to(acc)
    zero = top == 0
    m = top + zero
    u = widened(do, acc, acc) / m
    delta_t = delta.transpose(1, 2).unsqueeze(-1)
    coef = torch.where(zero, torch.where(delta_t == 0, 0, math.nan), delta_t / m)
    coef = coef / (u * u).sum(-1, keepdim=True).add_(zero)
    if torch.compiler.is_compiling():  # one pass: the product is rounded to do's dtype as it is stored
        return (u * coef).to(do.dtype)
    return torch.mul(u, coef, out=torch.empty_like(do))


_out_for_delta = Fused(out_for_delta)
""":func:`out_for_delta` in one pass where it compiles (Note [Fused passes] in :mod:`mesh_cp.kernels.fused`)."""


def _exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """Exponents ``e`` whose ``2**e`` is a normal number of ``dtype``."""
    info = torch.finfo(dtype)
    return math.frexp(info.tiny)[1] - 1, math.frexp(info.max)[1] - 1


def with_delta_column(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, delta: Tensor, *, multiple: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(do, q, k, v, out)`` padded for a fused backward that forms ``rowsum(do * out)`` itself.

    Construction 2 of Note [Gradient of the lse]: the head dim grows from ``D`` to
    ``round_up(D + 1, multiple)``; the kernel's ``dq, dk, dv`` of the padded inputs, cut back to
    ``[..., :D]``, are exact for any ``delta``. ``do, q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hkv, D)`` and
    ``delta (B, Hq, Sq)`` (fp32/fp64); all results are contiguous, in ``q.dtype``.
    """
    dim = q.shape[-1]
    padded = round_up(dim + 1, multiple)
    lo, hi = _exponent_range(do.dtype)
    # delta = s * r with s = 2**ceil(e / 2) for delta = m * 2**e: both factors near sqrt|delta|.
    _, exponent = torch.frexp(delta)
    s = torch.ldexp(torch.ones_like(delta), torch.div(exponent + 1, 2, rounding_mode="floor").clamp(lo, hi))
    r = delta / s
    do_p = F.pad(do, (0, padded - dim))
    do_p[..., dim] = s.transpose(1, 2).to(do.dtype)
    out_p = torch.zeros_like(do_p)
    out_p[..., dim] = r.transpose(1, 2).to(do.dtype)
    return do_p, *(F.pad(t, (0, padded - dim)) for t in (q, k, v)), out_p


def fused_backward_inputs(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, delta: Tensor, *, lse_grad: bool, multiple: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(do, q, k, v, out)`` for a fused backward that forms ``rowsum(do * out)`` itself, head dim padded
    to a multiple of ``multiple``: construction 2 of Note [Gradient of the lse] (:func:`with_delta_column`)
    when ``lse_grad``, else construction 1 (:func:`out_for_delta`). Cut the kernel's ``dq, dk, dv`` back
    to ``[..., :D]``."""
    if lse_grad:
        return with_delta_column(do, q, k, v, delta, multiple=multiple)
    padded = round_up(q.shape[-1], multiple)
    return tuple(pad_head_dim(t, padded) for t in (do, q, k, v, _out_for_delta(do, delta)))


def backward_by_parts(
    kernel: BlockKernel,
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    causal: bool,
    scale: float,
    **extra,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact block gradients for any ``delta`` from ``kernel``'s forward and its ``lse_grad=False`` backward.

    For kernels whose head-dim limit leaves no room for :func:`with_delta_column`. With
    ``ds = p * dp - p * delta``: one backward with ``delta = 0`` (``o = 0`` is exact there) gives
    ``dv`` and the ``p * dp`` part of ``dq, dk``; the ``-p * delta`` part is
    ``dq -= scale * delta * (P K)`` with ``P K`` from a forward with ``v = k`` (renormalised from the
    block's lse to the row's), and ``dk -= scale * P^T (delta * Q)``, the ``dv`` of a backward with
    ``dO = delta * Q``. Three kernel calls instead of one; results in the accumulator dtype.

    ``extra`` goes to every call: ``segments`` (:mod:`mesh_cp.kernels.varlen`) keep the derivation, since a
    masked ``p`` is ``0`` in all three; softcapped logits do not (``ds`` also carries the tanh derivative), so
    a ``softcap`` raises ``NotImplementedError``. Rows in no segment need finite ``lse`` and ``delta``
    (:func:`~mesh_cp.kernels.varlen.stats_on_segments`).
    """
    if extra.get("softcap") is not None:
        raise NotImplementedError(
            f"kernel {kernel.name!r}: a gradient on the lse (return_lse=True) at head_dim {q.shape[-1]} goes by parts "
            f"(Note [Gradient of the lse]), which does not hold for softcapped logits; use kernel='reference'"
        )
    acc = acc_dtype(q.dtype)
    zero = torch.zeros_like(delta)
    dq, dk, dv = kernel.backward(do, q, k, v, lse, zero, causal=causal, scale=scale, **extra)
    pk, lse_pk = kernel.forward(q, k, k, causal=causal, scale=scale, **extra)
    weight = (delta.to(acc) * torch.exp(lse_pk.to(acc) - lse.to(acc))).transpose(1, 2).unsqueeze(-1)
    dq = dq.to(acc) - scale * weight * pk.to(acc)
    # dO = delta * Q / m, m a per-batch power of two >= max|delta|, keeps dO within q's range.
    batch = delta.shape[0]
    top = delta.abs().reshape(batch, -1).amax(1)
    _, exponent = torch.frexp(torch.where(top > 0, top, 1))
    m = torch.ldexp(torch.ones_like(top), exponent).reshape(batch, 1, 1, 1)
    do_q = (delta.to(acc).transpose(1, 2).unsqueeze(-1) * q.to(acc) / m).to(q.dtype)
    _, _, pt_q = kernel.backward(do_q, q, k, v, lse, zero, causal=causal, scale=scale, **extra)
    dk = dk.to(acc) - scale * m * pt_q.to(acc)
    return dq, dk, dv.to(acc)
