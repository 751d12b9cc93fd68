"""Masked tiles as flash-attn varlen sequences ("segments"): the contract, its dense equivalent, and the gather
and scatter around the varlen calls of the fused kernels (``flash_attn`` and ``cuda_flash``).

A :data:`Segment` ``(q0, q1, k0, k1, left, right)`` makes local query rows ``[q0, q1)`` and key rows
``[k0, k1)`` of one batch row of a tile one varlen sequence (``sq = q1 - q0``, ``sk = k1 - k0``, both
``>= 1``): its query ``i`` attends its key ``j`` iff ``(left < 0 or j >= i + sk - sq - left)`` and
``(right < 0 or j <= i + sk - sq + right)``, flash-attn's ``window_size = (left, right)`` with ``-1`` for no
bound and the band anchored at the bottom-right corner (the docstring of ``flash_attn_varlen_func``). Every
query of a segment sees a key; in a batch row the segments' query ranges are sorted and disjoint, and so are
their key ranges. :data:`Segments` holds one tuple per batch row (or one tuple for every row). Queries in no
segment attend nothing in the tile (``out = 0``, ``lse = -inf``, ``dq = 0``); keys in none get ``dk = dv = 0``.

Note [Laid keys]
~~~~~~~~~~~~~~~~
A :data:`LaidSegment` ``(q0, q1, keys, left, right)`` takes as its ``sk`` keys the key ranges ``keys`` (sorted,
disjoint, non-empty) laid end to end, the band read on that order; the plain form is the laid form of one range.
Laid segments make one call of a tile whose documents' keys are not one run of rows (a split document's parts,
Note [Block segments] in :mod:`mesh_cp.core.segments`), and a key may be in several of them: its rows are gathered
once per segment, and its ``dk``, ``dv`` are the sum of theirs (in fp32, rounded once). A key of a plain segment is
still in no other plain one.

Note [Varlen windows]
~~~~~~~~~~~~~~~~~~~~~
Read from flash-attn 2.6.3, 2.7.4.post1 and 2.8.3 (``csrc/flash_attn/flash_api.cpp``: ``mha_varlen_fwd``,
``mha_varlen_bwd``, ``set_params_fprop``; ``src/mask.h``) and PyTorch's copy
(``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``), all the same here. A call's window is not
used as given:

1. ``if (is_causal) window_size_right = 0``; then ``if (window_size_left >= max_seqlen_k) window_size_left = -1``
   and the same for the right side.
2. ``set_params_fprop``: a negative side beside a non-negative one becomes ``seqlen_k``, i.e. ``max_seqlen_k``
   (both negative: no local mask at all).
3. ``mask.h`` bounds query ``i`` of a sequence by ``i + sk - sq - left <= j <= i + sk - sq + right`` with the
   sequence's own ``sk``, ``sq`` (``binfo.actual_seqlen_*``).

So a side meant to be unbounded becomes the bound ``max_seqlen_k``, which cuts a query off from keys it should see
when ``sq - 1 > max_seqlen_k`` (a right side), and a finite side ``>= max_seqlen_k`` is dropped. Every segment is
therefore called with a canonical window first: a side that bounds nothing in its segment (``left >= sk - 1``,
``right >= sq - 1``) becomes ``-1``, so every remaining bound is below ``sk - 1`` (left) or ``sq - 1`` (right).
Segments are grouped by that window (one call takes one window), and a group with a bound side is called with
``max_seqlen_k = max(max sk, max sq - 1)``: no side is dropped by step 1, and the bound step 2 gives an
unbounded side (``max_seqlen_k >= sk`` on the left, ``>= sq - 1`` on the right) cuts no key. A group with no
bound side gets its true ``max sk``. A larger ``max_seqlen_k`` is only an upper bound to the kernels: the
forward reads each sequence's length from ``cu_seqlens_k``, and the backward launches
``ceil(max_seqlen_k / kBlockN)`` key blocks of which those past a sequence's length return at once
(``flash_bwd_kernel.h``: ``if (n_block * kBlockN >= binfo.actual_seqlen_k) return;``, in all three releases);
``max_seqlen_k`` also sizes the split-KV path, taken only for ``max_seqlen_q == 1`` with GQA and no window (or
a paged KV cache), where it is not raised. Row statistics come back unpadded: ``softmax_lse`` is
``(num_heads, total_q)`` fp32 in the forward (the ``max_seqlen_q == 1`` GQA path too: ``flash_fwd_kernel.h`` writes
it as ``(h, seqlen_q, b)`` there), and the backward reads it in that layout (``unpadded_lse``; PyTorch's meta
function of ``_flash_attention_forward`` agrees). A query that sees no key would get
``lse = +inf`` (``softmax.h``), not the ``-inf`` the LSE merge takes, so segments must not have one.

The gather indices, ``cu_seqlens`` (int32) and ``max_seqlen`` of a tile are built on the host from the hashable
segments, copied to the device in one asynchronous transfer from pinned memory and cached within a byte budget
(``MESH_CP_VARLEN_CACHE_MB``, default 256 MiB: Note [Varlen plan cache] in :mod:`mesh_cp.kernels.plan_cache`);
nothing reads a device tensor back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mesh_cp.core.segments import LaidSegment, Segment, key_count, laid
from mesh_cp.kernels.plan_cache import CACHE, Built, host_empty, upload
from mesh_cp.kernels.varlen_groups import one_causal_group, with_fillers

Segments = tuple[tuple[Segment | LaidSegment, ...], ...]
"""One tuple of segments per batch row, or one tuple for every row (:data:`~mesh_cp.core.segments.Segment`: module
docstring; :data:`~mesh_cp.core.segments.LaidSegment`: Note [Laid keys])."""


@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call: every sequence of a tile with the same canonical window."""

    window: tuple[int, int]
    """``(window_size_left, window_size_right)`` as the kernel takes it (Note [Varlen windows])."""
    q_rows: Tensor
    """int64 rows of the flattened ``(B * Sq)`` queries, sequence after sequence."""
    k_rows: Tensor
    """int64 rows of the flattened ``(B * Sk)`` keys."""
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class VarlenPlan:
    """The varlen calls of a tile and where their rows go back to."""

    calls: tuple[VarlenCall, ...]
    q_back: Tensor
    """``(B * Sq)`` int64: where each query's row is in the calls' outputs laid end to end (for a query in no
    segment: their total, the row of zeros placed after them)."""
    k_back: Tensor
    """``(m, B * Sk)`` int64: the same for the keys' gradients, one row per time a key is laid (``m`` the most times
    any key is, Note [Laid keys]; a key laid fewer times points at the row of zeros in the rest)."""
    kv_back: Tensor
    """``(m, 2 B * Sk)`` int64: :attr:`k_back`, then :attr:`k_back` moved past the keys' gradients and their row of
    zeros: ``dk`` and ``dv`` gathered at once from both laid end to end."""
    q_covered: Tensor
    """``(B, 1, Sq)`` boolean: the query is in a segment."""
    whole: tuple[bool, bool] = (False, False)
    """One call takes every query (every key) in order: its rows are the flattened tensor itself, nothing is
    gathered or scattered back on that side."""


def _check_segments(segments: Segments, batch: int, sq: int, sk: int) -> None:
    """Raise ``ValueError`` naming the first segment that breaks the contract (module docstring)."""
    if len(segments) not in (1, batch):
        raise ValueError(f"segments has {len(segments)} rows, the batch has {batch} (pass one tuple per row, or one)")
    for row, segs in enumerate(segments):
        q_end = k_end = 0
        for seg in segs:
            if not _well_formed(seg):
                raise ValueError(
                    f"segment {seg!r} of row {row} is not six ints (q0, q1, k0, k1, left, right) or "
                    f"(q0, q1, ((k0, k1), ...), left, right)"
                )
            q0, q1, keys, left, right = laid(seg)
            if not (q_end <= q0 < q1 <= sq and _sorted_ranges(keys, k_end if len(seg) == 6 else 0, sk)):
                raise ValueError(
                    f"segment {seg!r} of row {row}: query and key ranges must be non-empty, sorted and disjoint, "
                    f"within the tile's {sq} queries and {sk} keys (a laid segment's keys: disjoint from each other)"
                )
            if left < -1 or right < -1:
                raise ValueError(f"segment {seg!r} of row {row}: window sides are >= 0, or -1 for no bound")
            if right >= 0 and right < (q1 - q0) - key_count(seg):  # query 0 would see no key
                raise ValueError(f"segment {seg!r} of row {row}: its first query sees no key (right < sq - sk)")
            q_end, k_end = q1, keys[-1][1] if len(seg) == 6 else k_end


def _sorted_ranges(ranges: tuple[tuple[int, int], ...], start: int, stop: int) -> bool:
    """``ranges`` are non-empty, sorted and disjoint within ``[start, stop)``, and there is one at least."""
    ends = [start] + [k for r in ranges for k in r] + [stop]
    pairs = enumerate(zip(ends, ends[1:], strict=False))
    return bool(ranges) and all(a <= b if i % 2 == 0 else a < b for i, (a, b) in pairs)


def _well_formed(seg) -> bool:
    if not isinstance(seg, tuple) or len(seg) not in (5, 6):
        return False
    if len(seg) == 6:
        return all(isinstance(x, int) for x in seg)
    ints = (seg[0], seg[1], seg[3], seg[4])
    keys = seg[2]
    return (
        all(isinstance(x, int) for x in ints)
        and isinstance(keys, tuple)
        and all(isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in keys)
    )


def canonical_window(segment: Segment | LaidSegment) -> tuple[int, int]:
    """The window of ``segment`` with each side that bounds nothing in it made ``-1`` (Note [Varlen windows])."""
    q0, q1, _, left, right = laid(segment)
    return (-1 if left >= key_count(segment) - 1 else left, -1 if right >= q1 - q0 - 1 else right)


def flash_max_seqlen_k(window: tuple[int, int], max_q: int, max_k: int) -> int:
    """The ``max_seqlen_k`` of a call with canonical ``window`` whose sequences have at most ``max_q`` queries and
    ``max_k`` keys: ``max_k``, raised to ``max_q - 1`` when a side is bound (Note [Varlen windows])."""
    return max_k if window == (-1, -1) else max(max_k, max_q - 1)


def varlen_plan(segments: Segments, sq: int, sk: int, device: torch.device, batch: int | None = None) -> VarlenPlan:
    """The varlen calls of a tile of ``batch`` rows (default ``len(segments)``) of ``sq`` queries and ``sk`` keys,
    on ``device``; built once per arguments and kept while the cache's budget allows (Note [Varlen windows], Note
    [Varlen plan cache]). Raises ``ValueError`` for segments that break the contract."""
    return _plan(segments, sq, sk, torch.device(device), len(segments) if batch is None else batch)


def _plan(segments: Segments, sq: int, sk: int, device: torch.device, batch: int) -> VarlenPlan:
    return CACHE.get(("plan", segments, sq, sk, device, batch), lambda: _build_plan(segments, sq, sk, device, batch))


def _build_plan(segments: Segments, sq: int, sk: int, device: torch.device, batch: int) -> Built:
    """The plan of :func:`varlen_plan`, the tensors it holds and the :class:`~mesh_cp.kernels.plan_cache.Ready` of
    its one copy."""
    _check_segments(segments, batch, sq, sk)
    rows = segments * batch if len(segments) == 1 else segments
    groups: dict[tuple[int, int], list[tuple[int, Segment | LaidSegment]]] = {}
    for b, segs in enumerate(rows):
        for seg in segs:
            groups.setdefault(canonical_window(seg), []).append((b, seg))
    groups = with_fillers(one_causal_group(groups), len(rows), sk)
    q_parts, k_parts, shapes = [], [], []
    for window, members in groups.items():
        lengths = [(s[1] - s[0], key_count(s)) for _, s in members]
        q_parts += [torch.arange(b * sq + s[0], b * sq + s[1]) for b, s in members]
        k_parts += [torch.arange(b * sk + k0, b * sk + k1) for b, s in members for k0, k1 in laid(s)[2]]
        max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
        shapes.append((window, lengths, max_q, flash_max_seqlen_k(window, max_q, max_k)))
    q_rows, k_rows = (torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for p in (q_parts, k_parts))
    q_back, k_back = _inverse(q_rows, batch * sq)[0], _inverse(k_rows, batch * sk)
    kv_back = torch.cat([k_back, k_back + len(k_rows) + 1], 1)
    whole = tuple(len(shapes) == 1 and _in_order(r, n) for r, n in ((q_rows, batch * sq), (k_rows, batch * sk)))
    cu = [torch.tensor(lengths).cumsum(0).T for _, lengths, _, _ in shapes]  # (2, n) per call
    parts = [q_rows, k_rows, q_back, kv_back.reshape(-1), *(_with_zero(c).reshape(-1) for c in cu)]
    host = torch.cat(parts, out=host_empty((sum(len(p) for p in parts),), torch.int64, device))
    dev, ready = upload(host, device)  # the one host-to-device copy, asynchronous from pinned memory on CUDA
    sizes = [len(p) for p in parts]
    views = list(dev.split(sizes))
    q_rows, k_rows, q_back = views[:3]
    kv_back = views[3].reshape(kv_back.shape)
    k_back = kv_back[:, : k_back.shape[1]]
    calls, q_at, k_at = [], 0, 0
    for (window, lengths, max_q, max_k), flat in zip(shapes, views[4:], strict=True):
        cu_q, cu_k = flat.to(torch.int32).reshape(2, -1)
        nq, nk = (sum(n[i] for n in lengths) for i in (0, 1))
        calls.append(VarlenCall(window, q_rows[q_at : q_at + nq], k_rows[k_at : k_at + nk], cu_q, cu_k, max_q, max_k))
        q_at, k_at = q_at + nq, k_at + nk
    covered = (q_back < len(q_rows)).reshape(batch, 1, sq)
    plan = VarlenPlan(tuple(calls), q_back, k_back, kv_back, covered, whole)
    return plan, [dev, covered, *(t for c in calls for t in (c.cu_seqlens_q, c.cu_seqlens_k))], ready


def _in_order(rows: Tensor, size: int) -> bool:
    """``rows`` (a host tensor) are ``0, 1, ..., size - 1``."""
    return len(rows) == size and torch.equal(rows, torch.arange(size))


def _with_zero(cumsum: Tensor) -> Tensor:
    """``(2, n)`` cumulative lengths with a leading zero column: ``cu_seqlens_q`` and ``cu_seqlens_k``."""
    return torch.cat([torch.zeros(2, 1, dtype=cumsum.dtype), cumsum], 1)


def _inverse(rows: Tensor, size: int) -> Tensor:
    """``(m, size)`` int64: row ``i`` holds the position of each of ``range(size)`` in ``rows`` at its ``i``-th
    occurrence there, ``len(rows)`` past its last (``m``: the most occurrences of any, at least 1)."""
    order = torch.sort(rows, stable=True).indices
    counts = torch.bincount(rows, minlength=size)
    starts = torch.cumsum(counts, 0) - counts  # where each row's occurrences begin in the sorted order
    occurrence = torch.arange(len(rows)) - starts[rows[order]]
    back = torch.full((max(1, int(counts.max()) if len(rows) else 1), size), len(rows), dtype=torch.int64)
    back[occurrence, rows[order]] = order
    return back


def segments_mask(segments: Segments, sq: int, sk: int, device: torch.device | str | None = None) -> Tensor:
    """``(len(segments), 1, sq, sk)`` boolean: query ``i`` of the tile attends key ``j`` (the dense equivalent of
    ``segments``, for the reference kernel and for tests; a query is in one segment, which lays a key at most once,
    so laid keys have one too). Raises ``ValueError`` for segments that break the contract. Built once per
    arguments on ``device`` and kept while the cache's budget allows (every layer calls with the same segments: no
    copy per call; Note [Varlen plan cache]); do not write to it."""
    key = ("mask", segments, sq, sk, None if device is None else torch.device(device))
    return CACHE.get(key, lambda: _segments_mask(*key[1:]))


def _segments_mask(segments: Segments, sq: int, sk: int, device: torch.device | None) -> Built:
    _check_segments(segments, len(segments), sq, sk)
    mask = host_empty((len(segments), 1, sq, sk), torch.bool, device or torch.device("cpu")).zero_()
    for b, segs in enumerate(segments):
        for seg in segs:
            q0, q1, keys, left, right = laid(seg)
            n = key_count(seg)
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(n)[None, :]
            offset = i + n - (q1 - q0)  # bottom-right anchored diagonal
            seen = torch.ones(q1 - q0, n, dtype=torch.bool)
            if left >= 0:
                seen &= j >= offset - left
            if right >= 0:
                seen &= j <= offset + right
            mask[b, 0, q0:q1, torch.cat([torch.arange(k0, k1) for k0, k1 in keys])] = seen
    mask, ready = (mask, None) if device is None else upload(mask, device)
    return mask, [mask], ready


def plan_for(q: Tensor, k: Tensor, segments: Segments, causal: bool) -> VarlenPlan:
    """The plan of a kernel call with ``q (B, Sq, ...)``, ``k (B, Sk, ...)`` and ``segments``; raises
    ``ValueError`` when ``causal`` is asked too (the segments carry the whole mask)."""
    if causal:
        raise ValueError("causal=True with segments: the segments carry the whole mask; pass causal=False")
    return _plan(segments, q.shape[1], k.shape[1], q.device, q.shape[0])


def stats_on_segments(lse: Tensor, delta: Tensor, plan: VarlenPlan) -> tuple[Tensor, Tensor]:
    """``lse`` and ``delta`` ``(B, H, Sq)`` with ``0`` on queries in no segment, whose values are never read but
    must stay finite in :func:`~mesh_cp.kernels.base.backward_by_parts` (it scales by a maximum over every row). The
    other constructions of Note [Gradient of the lse] work row by row, and the varlen calls read only the rows of
    their segments, so they take the statistics as they are."""
    return tuple(torch.where(plan.q_covered, t, 0.0) for t in (lse, delta))


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of ``t (B, S, H, D)`` flattened to ``(B * S, H, D)``: contiguous ``(len(index), H, D)``."""
    return t.reshape(-1, *t.shape[2:]).index_select(0, index)


def _key_rows(k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_rows` of ``k`` and of ``v``: one gather when they are the two halves of one stacked K, V tensor (the
    executors' ``(2, B, S, Hkv, D)``), else one each."""
    kv = _stacked(k, v)
    if kv is None:
        return _rows(k, index), _rows(v, index)
    rows = kv.index_select(1, index)
    return rows[0], rows[1]


def _stacked(k: Tensor, v: Tensor) -> Tensor | None:
    """``k`` and ``v (B, S, H, D)`` as one ``(2, B * S, H, D)`` view when they are views of one tensor alike in all
    but a storage offset (``None`` otherwise)."""
    batch, seq = k.shape[:2]
    alike = v._base is not None and v._base is k._base and k.dtype == v.dtype and k.shape == v.shape
    if not (alike and k.stride() == v.stride() and (batch == 1 or k.stride(0) == seq * k.stride(1))):
        return None
    step = v.storage_offset() - k.storage_offset()
    return k.as_strided((2, batch * seq, *k.shape[2:]), (step, *k.stride()[1:])) if step > 0 else None


def _flat(t: Tensor) -> Tensor:
    """``t (B, S, H, D)`` as its ``(B * S, H, D)`` rows, contiguous (a view when ``t`` is contiguous)."""
    return t.reshape(-1, *t.shape[2:]).contiguous()


def _back(parts: list[Tensor], fill: Tensor, back: Tensor, dim: int) -> Tensor:
    """The calls' outputs laid end to end along ``dim`` with ``fill`` after them, gathered by ``back``; a ``(m, n)``
    ``back`` sums its ``m`` gathers (Note [Laid keys]), in fp32 (fp64 for fp64) when ``m > 1``."""
    rows = torch.cat([*parts, fill], dim)
    if back.dim() == 1 or back.shape[0] == 1:
        return rows.index_select(dim, back.reshape(-1))
    total = rows.index_select(dim, back[0]).to(torch.promote_types(rows.dtype, torch.float32))
    for index in back[1:]:
        total += rows.index_select(dim, index)
    return total.to(rows.dtype)


@functools.lru_cache(maxsize=64)
def _filled(value: float, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The row of ``value`` that :func:`_back` places after the calls' outputs, built once per shape (every call of
    every layer reads it; none writes it)."""
    return torch.full(shape, value, dtype=dtype, device=device)


def forward(q: Tensor, k: Tensor, v: Tensor, plan: VarlenPlan, run: Callable) -> tuple[Tensor, Tensor]:
    """``(out (B, Sq, H, D), lse (B, H, Sq) fp32)`` of a tile from ``run(call, q, k, v) -> (out, lse)`` per call
    (``(total_q, H, D)`` rows and ``(H, total_q)`` fp32 statistics); queries in no segment get ``0`` and ``-inf``."""
    batch, sq, heads, dim = q.shape
    (whole_q, whole_k), outs, lses = plan.whole, [], []
    for call in plan.calls:
        qs = _flat(q) if whole_q else _rows(q, call.q_rows)
        ks, vs = (_flat(k), _flat(v)) if whole_k else _key_rows(k, v, call.k_rows)
        out, lse = run(call, qs, ks, vs)
        outs.append(out)
        lses.append(lse)
    if whole_q:
        return outs[0].reshape(batch, sq, heads, dim), lses[0].reshape(heads, batch, sq).transpose(0, 1).contiguous()
    out = _back(outs, _filled(0.0, (1, heads, dim), q.dtype, q.device), plan.q_back, 0).reshape(batch, sq, heads, dim)
    none = _filled(float("-inf"), (heads, 1), torch.float32, q.device)
    lse = _back(lses, none, plan.q_back, 1).reshape(heads, batch, sq).transpose(0, 1).contiguous()
    return out, lse


def backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: VarlenPlan, run: Callable
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq (B, Sq, H, D)``, ``dk, dv (B, Sk, Hkv, D)`` of a tile from ``run(call, do, q, k, v, out, lse) -> (dq,
    dk, dv)`` per call on its rows (``lse (H, total_q)`` fp32, contiguous); rows in no segment get ``0``. The
    inputs are the padded ones of :func:`~mesh_cp.kernels.base.fused_backward_inputs`."""
    batch, sq, heads, dim = q.shape
    lse_rows = lse.float().transpose(0, 1).reshape(heads, batch * sq)
    parts: tuple[list[Tensor], ...] = ([], [], [])
    (whole_q, whole_k) = plan.whole
    for call in plan.calls:
        inputs = [_flat(t) if whole_q else _rows(t, call.q_rows) for t in (do, q)]
        inputs += (_flat(k), _flat(v)) if whole_k else _key_rows(k, v, call.k_rows)
        if whole_q:
            inputs += [_flat(out), lse_rows.contiguous()]
        else:
            inputs += [_rows(out, call.q_rows), lse_rows.index_select(1, call.q_rows)]
        grads = run(call, *inputs)
        for part, grad in zip(parts, grads, strict=True):
            part.append(grad)
    if whole_q:
        dq = parts[0][0].reshape(q.shape)
    else:
        dq = _back(parts[0], _filled(0.0, (1, heads, dim), q.dtype, q.device), plan.q_back, 0).reshape(q.shape)
    if whole_k:
        return dq, parts[1][0].reshape(k.shape), parts[2][0].reshape(k.shape)
    zero_kv = _filled(0.0, (1, *k.shape[2:]), k.dtype, k.device)
    dkv = _back([*parts[1], zero_kv, *parts[2]], zero_kv, plan.kv_back, 0).reshape(2, *k.shape)
    return dq, dkv[0], dkv[1]
