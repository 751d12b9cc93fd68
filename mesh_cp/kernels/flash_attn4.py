"""The FlashAttention 4 kernel (the ``flash-attn-4`` package, module ``flash_attn.cute.interface``) on Hopper and
Blackwell GPUs: fp16/bf16, native GQA, head dims padded to a multiple of 8 (at most 256 on 9.x, 128 on 10.x), softcap,
and masked tiles as varlen sequences read in place from the tile's rows.

This is the only module that imports ``flash_attn.cute``.

Note [flash-attn 4 API]
~~~~~~~~~~~~~~~~~~~~~~~
Read from ``flash_attn/cute/interface.py`` of Dao-AILab/flash-attention at tag ``fa4-v4.0.0.beta27`` and at commit
0251105a (2026-08-15, after it); every parameter named below is in every tag from ``fa4-v4.0.0.beta5`` on::

    _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None, causal=False,
        softcap=None, window_size_left=None, window_size_right=None, ..., return_lse=False, out=None, lse=None, ...)
        -> (out, lse, p, row_max)
    _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
        window_size_right=None, ..., cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, ..., dlse=None,
        learnable_sink=None) -> (dq, dk, dv)

- Tensors: ``q (B, Sq, H, D)``, ``k, v (B, Sk, Hkv, D)`` with ``H % Hkv == 0`` (native GQA), or with ``cu_seqlens``
  ``(total, H, D)`` rows; ``cu_seqlens_*`` ``(n + 1,)`` and ``seqused_*`` ``(n,)`` int32 with stride 1; all on CUDA;
  fp16 or bf16 (fp8 forward only); inputs whose last stride is not 1 or whose pointer is not 16-byte aligned are
  copied; the ``out, lse, dq, dk, dv`` given must have exactly the shape, dtype and device it would allocate.
- The forward returns 4 values since beta19 (``p, row_max`` serve MLA: ``None`` here), 2 before, and beta19's early
  exit for empty inputs still returned 2: only ``[0]`` and ``[1]`` are read. ``lse`` (natural log, fp32) is ``None``
  unless ``return_lse=True`` (or an input requires grad): ``(B, H, Sq)``, or ``(H, total_q)`` with ``cu_seqlens_q``.
- Head dims (``_validate_head_dims``): on 9.x 8 to 256, on 10.x/11.x 8 to 128 (and (192, 128) or (256, 256), the
  latter a kernel whose backward takes no softcap, ``dlse`` or ``seqused``: not offered), all multiples of
  16 bytes / element size (8 here). The forward runs on 8.x to 12.x, the backward on 9.x to 12.x (12.x without a
  score_mod, so without softcap); offered here on 9.x and 10.x. The architecture is the *current* CUDA device's
  (``torch.cuda.get_device_capability()``, or ``FLASH_ATTENTION_ARCH``).
- Masks (``mask.py``, ``block_info.py``): per sequence, with its own ``seqlen_k`` (``seqused_k[b]`` if given, else
  the ``cu_seqlens_k`` difference) and ``seqlen_q``, causal keeps key ``j <= i + seqlen_k - seqlen_q`` (bottom-right,
  as flash-attn 2) and a window keeps ``i + sk - sq - left <= j <= i + sk - sq + right``. A side is unbounded when
  ``None``; ``_resolve_causal_local_window`` makes ``causal`` a right side of 0 and drops *both* sides when
  ``left + right < 0``, so a ``-1`` must never be passed. There is no clamping to ``max_seqlen_k`` (Note [Varlen
  windows] of :mod:`mesh_cp.kernels.varlen` is about flash-attn 2's C++); ``max_seqlen_q/k`` are upper bounds that
  size the grid (the backward takes ``total`` rows when they are ``None``).
- ``softcap``: logits ``softcap * tanh(scale * s / softcap)`` (a score_mod applied after the scale), off for ``None``
  or ``0.0`` in the forward; the backward's must be a float (``if softcap != 0.0`` builds its score_mod), and it
  takes one with ``cu_seqlens`` from beta24 on (before: "varlen + score_mod not supported in bwd yet"), which is
  why :data:`MIN_VERSION` is beta24.
- The backward's preprocess forms ``D = rowsum(out * dout) - dlse`` (``dlse`` fp32 in ``lse``'s layout, beta5 on)
  and reads ``out`` nowhere else. So it is called with ``out = 0`` and ``dlse = -delta``: ``D = delta`` exactly, in
  fp32, for any ``delta`` (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`): no rounding of a constructed
  ``out`` to fp16, no extra head-dim column and no backward by parts, with or without ``lse_grad``.
- ``seqused``: sequence ``b``'s rows start at ``cu_seqlens[b]`` and only its first ``seqused[b]`` are read or
  written (``seqlen_info.py``; the epilogues are predicated on the length or store through ragged TMA tensors bound
  to it; the backward's postprocess writes rows below it).
- ``flash_attn.cute.__version__`` reads the distribution ``fa4`` (``"0.0.0"`` for the pip package), so the version
  is read from the distribution ``flash-attn-4``.

Note [FA4 segments in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A tile whose segments are all plain (:data:`~mesh_cp.core.segments.Segment`; a laid one whose key ranges touch is
taken as the plain one of their union, if the key ranges of its row stay sorted and disjoint) has sorted, disjoint
query ranges and sorted, disjoint key ranges in every row, so over the flattened ``(B * Sq)`` queries and ``(B * Sk)`` keys each
window's segments are sequences ``cu_seqlens_q = [q0, ...]``, ``cu_seqlens_k = [k0, ...]`` (closed by the last one's
end), each of ``seqused = q1 - q0`` (``k1 - k0``) rows: FA4 reads them from the flat ``q, k, v`` themselves, nothing
is gathered or scattered back. ``seqused`` is passed only on a side whose ranges leave rows between them. The calls
of a tile (one per window) write into one ``out`` (zeros) and ``lse`` (``-inf``) and one ``dq, dk, dv`` (zeros),
each only on its own rows, so rows in no segment keep those values. A tile with any other laid segment (Note [Laid keys])
goes through :func:`mesh_cp.kernels.varlen.forward` / :func:`~mesh_cp.kernels.varlen.backward` (rows gathered per
call); its backward passes ``-delta`` as the ``out`` those gather by rows, which the call turns into ``dlse``.
The int32 ``cu_seqlens`` and ``seqused`` of a tile are built on the host once per arguments (a bounded cache) and
reach a CUDA device in one asynchronous copy from pinned memory.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from mesh_cp.core.options import positive_or_none
from mesh_cp.core.segments import LaidSegment, Segment
from mesh_cp.kernels import varlen
from mesh_cp.kernels.base import Capabilities, cut_head_dim, pad_head_dim, round_up

MODULE = "flash_attn.cute.interface"
PACKAGE = "flash-attn-4"
MIN_VERSION = "4.0.0b24"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
MAX_HEAD_DIM_SM100 = 128
MAJORS = (9, 10)
_FORWARD = frozenset(
    "q k v cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k softmax_scale causal softcap "
    "window_size_left window_size_right return_lse out lse".split()
)
_BACKWARD = frozenset(
    "q k v out dout lse softmax_scale causal softcap window_size_left window_size_right cu_seqlens_q cu_seqlens_k "
    "seqused_q seqused_k max_seqlen_q max_seqlen_k deterministic dq dk dv dlse".split()
)
_PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "rc": 2}


def version_key(version: str) -> tuple[int, ...]:
    """``"4.0.0b24"`` (or ``"4.0.0.beta24"``, ``"4.0.0b28.dev3+g..."``) as a comparable tuple; a final release ranks
    above its pre-releases. ``ValueError`` for text that is not such a version."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[.-]?(a|alpha|b|beta|rc)\.?(\d+))?", version)
    if match is None:
        raise ValueError(f"{version!r} is not a version like 4.0.0b24")
    major, minor, patch, pre, number = match.groups()
    return (int(major), int(minor), int(patch or 0), _PRE[pre] if pre else 3, int(number or 0))


def _version(interface: ModuleType) -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return getattr(interface, "__version__", None)


def load() -> ModuleType:
    """The imported ``flash_attn.cute.interface``, or ``RuntimeError`` naming why it is unusable: an import that fails
    (a missing package, or a broken CUTLASS DSL), a version below :data:`MIN_VERSION` or none to read, and functions
    without the parameters this kernel passes (Note [flash-attn 4 API])."""
    try:
        interface = importlib.import_module(MODULE)
    except Exception as err:  # the CUTLASS DSL stack fails in many ways; every one makes the kernel unusable
        raise RuntimeError(
            f"flash-attn 4 cannot be imported ({type(err).__name__}: {err}); pip install '{PACKAGE}>={MIN_VERSION}'"
        ) from err
    version = _version(interface)
    if version is None or version_key(version) < version_key(MIN_VERSION):
        found = "has no version to read" if version is None else f"is {version}"
        raise RuntimeError(f"{PACKAGE} {found}; mesh_cp needs >= {MIN_VERSION} (pip install -U '{PACKAGE}')")
    for name, wanted in (("_flash_attn_fwd", _FORWARD), ("_flash_attn_bwd", _BACKWARD)):
        fn = getattr(interface, name, None)
        missing = sorted(wanted - set(inspect.signature(fn).parameters)) if callable(fn) else [name]
        if missing:
            raise RuntimeError(
                f"{PACKAGE} {version}: {MODULE}.{name} lacks {missing}, which mesh_cp passes "
                f"(Note [flash-attn 4 API]); use kernel='flash_attn' or 'cuda_flash'"
            )
    return interface


def _softcap(softcap: float | None) -> float:
    """FA4's ``softcap``: ``0.0`` (off) for ``None``."""
    return 0.0 if softcap is None else float(positive_or_none("softcap", softcap))


def _flat(t: Tensor) -> Tensor:
    """``t (B, S, H, D)`` as ``(B * S, H, D)`` rows, contiguous (a view when ``t`` is)."""
    return t.reshape(-1, *t.shape[2:]).contiguous()


def _window(window: tuple[int, int]) -> dict:
    """A canonical varlen window (``-1``: no bound) as FA4 takes it (``None``: no bound)."""
    left, right = (None if side < 0 else side for side in window)
    return {"window_size_left": left, "window_size_right": right}


@dataclass(frozen=True)
class InPlaceCall:
    """One FA4 varlen call reading its segments from the flat tile rows (Note [FA4 segments in place])."""

    window: tuple[int, int]
    """The canonical window, ``-1`` for no bound (:func:`mesh_cp.kernels.varlen.canonical_window`)."""
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    seqused_q: Tensor | None
    seqused_k: Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int

    def arguments(self) -> dict:
        """The call's keyword arguments to ``_flash_attn_fwd`` / ``_flash_attn_bwd`` besides tensors and scale."""
        names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k")
        return {"causal": False, **{n: getattr(self, n) for n in names}, **_window(self.window)}


def in_place_calls(segments: varlen.Segments, q: Tensor, k: Tensor, causal: bool) -> tuple[InPlaceCall, ...] | None:
    """The calls of a tile of ``q (B, Sq, ...)``, ``k (B, Sk, ...)`` read in place (Note [FA4 segments in place]), or
    ``None`` when a laid segment's keys are not one run of rows (or their runs overlap): the tile's rows are gathered
    then. Built once per arguments. Raises ``ValueError`` for ``causal`` or segments that break the contract."""
    if causal:
        raise ValueError("causal=True with segments: the segments carry the whole mask; pass causal=False")
    return _in_place(segments, q.shape[0], q.shape[1], k.shape[1], q.device)


def _sequences(starts: list[int], ends: list[int]) -> tuple[list[int], list[int] | None]:
    """``cu_seqlens`` and ``seqused`` (``None`` when the ranges leave no rows between them) of sorted ranges."""
    gaps = any(end != start for end, start in zip(ends, starts[1:], strict=False))
    return [*starts, ends[-1]], [e - s for s, e in zip(starts, ends, strict=True)] if gaps else None


def _plain(segment: Segment | LaidSegment) -> Segment | None:
    """``segment`` as a plain one when its keys are one run of rows (a laid segment whose ranges touch), else
    ``None``."""
    if len(segment) == 6:
        return segment
    q0, q1, keys, left, right = segment
    if any(a[1] != b[0] for a, b in zip(keys, keys[1:], strict=False)):
        return None
    return (q0, q1, keys[0][0], keys[-1][1], left, right)


def _runs(segments: list[Segment | None]) -> bool:
    """Every segment of a batch row (after :func:`_plain`) is plain and their key ranges are sorted and disjoint."""
    if any(seg is None for seg in segments):
        return False
    return all(a[3] <= b[2] for a, b in zip(segments, segments[1:], strict=False))


@functools.lru_cache(maxsize=256)
def _in_place(
    segments: varlen.Segments, batch: int, sq: int, sk: int, device: torch.device
) -> tuple[InPlaceCall, ...] | None:
    varlen._check_segments(segments, batch, sq, sk)
    rows = [[_plain(seg) for seg in segs] for segs in (segments * batch if len(segments) == 1 else segments)]
    if not all(_runs(segs) for segs in rows):
        return None
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for b, segs in enumerate(rows):
        for seg in segs:
            q0, q1, k0, k1 = seg[:4]
            groups.setdefault(varlen.canonical_window(seg), []).append(
                (b * sq + q0, b * sq + q1, b * sk + k0, b * sk + k1)
            )
    host, shapes = [], []
    for window, members in groups.items():
        cu_q, used_q = _sequences([m[0] for m in members], [m[1] for m in members])
        cu_k, used_k = _sequences([m[2] for m in members], [m[3] for m in members])
        parts = [cu_q, cu_k, used_q or [], used_k or []]
        host += [x for part in parts for x in part]
        longest = [max(m[1] - m[0] for m in members), max(m[3] - m[2] for m in members)]
        shapes.append((window, [len(p) for p in parts], used_q is not None, used_k is not None, longest))
    flat = torch.tensor(host, dtype=torch.int32)
    if device.type == "cuda":  # one asynchronous copy; the pinned block is kept until it completes
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    views, calls = iter(flat.split([n for shape in shapes for n in shape[1]])), []
    for window, _, has_q, has_k, (max_q, max_k) in shapes:
        cu_q, cu_k, used_q, used_k = (next(views) for _ in range(4))
        calls.append(
            InPlaceCall(window, cu_q, cu_k, used_q if has_q else None, used_k if has_k else None, max_q, max_k)
        )
    return tuple(calls)


class FlashAttn4Kernel:
    """``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (Note [flash-attn 4 API]).

    Beyond :class:`~mesh_cp.kernels.BlockKernel`: ``segments`` (a masked tile as varlen sequences,
    :mod:`mesh_cp.kernels.varlen`; then ``causal=False``; Note [FA4 segments in place]) and ``softcap``.
    """

    name = "flash_attn4"
    capabilities = Capabilities(
        keywords={"segments", "softcap"},
        devices=("cuda",),
        dtypes=DTYPES,
        head_dim_multiple=HEAD_DIM_MULTIPLE,
        max_head_dim=MAX_HEAD_DIM,
        gaps=True,
        dq_in_input_dtype=True,
    )
    """Plain segments with rows between them are read in place (``gaps``; Note [FA4 segments in place])."""

    def __init__(self, *, check_device: bool = True) -> None:
        self._fa = load()
        if check_device and not torch.cuda.is_available():
            raise RuntimeError("kernel 'flash_attn4' needs CUDA; on CPU use kernel='cpu_flash'")

    @classmethod
    def without_device_check(cls) -> FlashAttn4Kernel:
        """The kernel without the CUDA-availability check, for tests that run it on an emulation of
        ``flash_attn.cute.interface`` (:mod:`mesh_cp.testing.fa4_emulation`) with CPU tensors."""
        return cls(check_device=False)

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, ROCm, on a CUDA
        device a compute capability other than 9.x and 10.x or a head dim above 128 on 10.x, and an install that
        :func:`load` refuses (imported here)."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        if torch.version.hip:
            reasons.append("flash-attn 4 is built for NVIDIA GPUs; not offered on ROCm")
        elif device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if major not in MAJORS:
                reasons.append(f"flash-attn 4 is offered on compute capability 9.x and 10.x only, got {major}.{minor}")
            elif major == 10 and head_dim is not None and round_up(head_dim, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM_SM100:
                reasons.append(f"head_dim {head_dim} > {MAX_HEAD_DIM_SM100} on compute capability 10.x")
        try:
            load()
        except RuntimeError as err:
            reasons.append(str(err))
        return tuple(reasons)

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
        calls = None if segments is None else in_place_calls(segments, q, k, causal)
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded) for t in (q, k, v))
        options = {"softmax_scale": scale, "softcap": cap, "return_lse": True}
        if calls is not None:
            batch, rows, heads, _ = q.shape
            out = torch.zeros(batch * rows, heads, padded, dtype=q.dtype, device=q.device)
            lse = torch.full((heads, batch * rows), float("-inf"), dtype=torch.float32, device=q.device)
            qf, kf, vf = _flat(q), _flat(k), _flat(v)
            for call in calls:
                self._fa._flash_attn_fwd(q=qf, k=kf, v=vf, **call.arguments(), **options, out=out, lse=lse)
            out, lse = out.reshape(q.shape), lse.reshape(heads, batch, rows).transpose(0, 1).contiguous()
        elif segments is not None:
            plan = varlen.plan_for(q, k, segments, causal)
            out, lse = varlen.forward(q, k, v, plan, functools.partial(self._gathered_forward, options=options))
        else:
            q, k, v = (t.contiguous() for t in (q, k, v))
            result = self._fa._flash_attn_fwd(q=q, k=k, v=v, causal=causal, **options)
            out, lse = result[0], result[1]
        return (*cut_head_dim(out, dim=dim), lse)

    def _gathered_forward(self, call: varlen.VarlenCall, q: Tensor, k: Tensor, v: Tensor, *, options: dict):
        result = self._fa._flash_attn_fwd(
            q=q, k=k, v=v, causal=False, **_window(call.window), cu_seqlens_q=call.cu_seqlens_q,
            cu_seqlens_k=call.cu_seqlens_k, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, **options,
        )  # fmt: skip
        return result[0], result[1]

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
        """Exact for any ``delta`` (``lse_grad`` changes nothing): FA4 takes ``dlse`` (Note [flash-attn 4 API])."""
        dim, cap = q.shape[-1], _softcap(softcap)
        calls = None if segments is None else in_place_calls(segments, q, k, causal)
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        do, q, k, v = (pad_head_dim(t, padded) for t in (do, q, k, v))
        options = {
            "softmax_scale": scale, "softcap": cap, "deterministic": torch.are_deterministic_algorithms_enabled()
        }  # fmt: skip
        if segments is not None and calls is None:
            plan = varlen.plan_for(q, k, segments, causal)
            carrier = (-delta.float()).transpose(1, 2).unsqueeze(-1)  # (B, Sq, H, 1): gathered by rows like out
            run = functools.partial(self._gathered_backward, options=options)
            return cut_head_dim(*varlen.backward(do, q, k, v, carrier, lse, plan, run), dim=dim)
        if calls is None:
            do, q, k, v = (t.contiguous() for t in (do, q, k, v))
            stats = {"lse": lse.float().contiguous(), "dlse": (-delta.float()).contiguous()}
            grads = self._fa._flash_attn_bwd(q=q, k=k, v=v, out=torch.zeros_like(do), dout=do, causal=causal,
                                             **stats, **options)  # fmt: skip
            return cut_head_dim(*grads[:3], dim=dim)
        batch, rows, heads, _ = q.shape
        flat = [_flat(t) for t in (do, q, k, v)]
        grads, out = [torch.zeros_like(t) for t in flat[1:]], torch.zeros_like(flat[0])
        stats = {
            name: t.float().transpose(0, 1).reshape(heads, batch * rows).contiguous()
            for name, t in (("lse", lse), ("dlse", -delta))
        }
        for call in calls:
            self._fa._flash_attn_bwd(
                q=flat[1], k=flat[2], v=flat[3], out=out, dout=flat[0], **stats,
                dq=grads[0], dk=grads[1], dv=grads[2], **call.arguments(), **options,
            )  # fmt: skip
        return cut_head_dim(grads[0].reshape(q.shape), *(g.reshape(k.shape) for g in grads[1:]), dim=dim)

    def _gathered_backward(self, call: varlen.VarlenCall, do, q, k, v, carrier, lse, *, options: dict):
        grads = self._fa._flash_attn_bwd(
            q=q, k=k, v=v, out=torch.zeros_like(do), dout=do, lse=lse, dlse=carrier[..., 0].t().contiguous(),
            causal=False, **_window(call.window), cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
            max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, **options,
        )  # fmt: skip
        return grads[:3]
