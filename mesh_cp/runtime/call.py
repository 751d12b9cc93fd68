"""One attention call as the executors see it: the mesh, the plan, the kernel, the scale, and how every block of
the plan becomes kernel calls (a Q chunk's unmasked blocks as one call, Note [One call per Q chunk] in
:mod:`mesh_cp.core.blocks`; masked blocks as varlen calls or cut into tiles, Note [Masked blocks] in
:mod:`mesh_cp.core.masks`).

Note [Host work per plan]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every layer calls the attention with the same plan (cached by :func:`~mesh_cp.core.plan.make_plan`) and makes the
same kernel calls: the tiles of a block, their segments, kernel and keywords, the keys of a chunk call, and which
writes of partial results are first writes (Note [First writes] in :mod:`mesh_cp.core.blocks`). They are decided on
the host once per plan, unit (block or chunk call) and what the kernel takes, as a :class:`Route` kept in
:func:`plan_cache`; a layer runs only the tensor ops of its calls.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mesh_cp.core.blocks import BlockWork, ChunkCall, MaskKind, RowGroup, first_writes
from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import acc_dtype, visibility
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.kernels import capabilities_of, takes
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.kernels.fused import merge_
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.runtime.mesh import CPMesh

_REFERENCE = ReferenceKernel()
Piece = tuple[int, tuple[int, int]]
"""``(y, (k0, k1))``: rows ``[k0, k1)`` of KV chunk ``y``."""


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One kernel call of a unit, as decided on the host (Note [Host work per plan])."""

    q_rows: tuple[int, int]
    keys: tuple[Piece, ...]
    """The key pieces, laid end to end (one for a block's call)."""
    causal: bool
    reference: bool
    """It goes to the reference kernel (softcapped logits or a masked tile the kernel cannot take)."""
    extra: dict
    """Its keywords but a mask: ``softcap``, ``segments`` (do not change the dict)."""
    mask: bool
    """It takes a ``mask`` built on the device from :attr:`AttentionCall.doc_ids` (a masked tile)."""
    first: bool = True
    """The first write of its query rows in the unit's accumulators (Note [First writes])."""
    first_kv: bool = True
    """The same for its key rows (a block's tiles)."""


@dataclass(frozen=True, eq=False)
class Route:
    """The kernel calls of one unit (a block or a chunk call) and how their results make the unit's."""

    calls: tuple[KernelCall, ...]
    whole: bool
    """One call whose results are the unit's (no accumulators)."""
    complete: bool
    """The first writes cover the unit's query rows: its accumulators need no fill (Note [First writes])."""
    complete_kv: bool
    """The same for a block's key rows."""
    pieces: tuple[Piece, ...]
    """Every call's key pieces in call order: the ``dk, dv`` pieces :meth:`AttentionCall.backward_chunk` returns."""


_PLAN_CACHES: dict[int, dict] = {}


def plan_cache(plan: AttentionPlan) -> dict:
    """A dict that lives as long as ``plan``, for what is derived from it on the host once (Note [Host work per
    plan]). Keyed by the plan's identity: a plan's hash reads its whole mask."""
    cache = _PLAN_CACHES.get(id(plan))
    if cache is None:
        cache = _PLAN_CACHES[id(plan)] = {}
        weakref.finalize(plan, _PLAN_CACHES.pop, id(plan), None)
    return cache


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What one attention call runs with, the same in forward and backward (kept on the autograd ``ctx``): the
    mesh, the plan of the whole call (head exchange and blocks), the kernel and the scale. The executor of the
    blocks is chosen by the plan's ``schedule`` (:data:`mesh_cp.runtime.executors.EXECUTORS`)."""

    mesh: CPMesh
    plan: AttentionPlan
    kernel: BlockKernel
    scale: float
    lse_grad: bool = False
    """The lse may receive a gradient (``return_lse``): the block kernels take the exact path for any
    ``dlse`` (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`). Equal on every rank."""
    softcap: float | None = None
    """Logits ``softcap * tanh(s / softcap)``: blocks go to the kernel when it takes ``"softcap"``, else tile by tile
    to the reference kernel."""
    doc_ids: Tensor | None = None
    """``(B, S)`` document of every global position (``-1``: padding) when the plan has a mask and the kernel builds dense
    masks (``None`` for a kernel that takes every masked block as segments)."""

    def forward_block(self, w: BlockWork, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(o, lse)`` of block ``w`` (rows ``w.q_rows``) from the whole Q chunk ``q (B, L, H, D)`` and the
        stacked K, V chunk ``kv (2, B, L, Hkv, D)``."""
        return self._forward(w, q, lambda y: kv)

    def backward_block(
        self, w: BlockWork, q: Tensor, do: Tensor, stats: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` of block ``w`` (shaped like its rows and columns) from whole chunks; ``stats
        (2, B, H, L)`` holds the rows' lse and delta."""
        route = self.route(w)
        if route.whole:
            return self._backward_call(w.x, route.calls[0], q, do, stats, lambda y: kv)
        (qa, qb), (ka, kb), acc = w.q_rows, w.kv_rows, acc_dtype(q.dtype)
        dq = accumulator((q.shape[0], qb - qa, *q.shape[2:]), acc, q.device, route.complete)
        dkv = accumulator((2, kv.shape[1], kb - ka, *kv.shape[3:]), acc, q.device, route.complete_kv)
        for c in route.calls:
            dq_t, dk_t, dv_t = self._backward_call(w.x, c, q, do, stats, lambda y: kv)
            (q0, q1), ((_, (k0, k1)),) = c.q_rows, c.keys
            accumulate(dq[:, q0 - qa : q1 - qa], dq_t, c.first)
            accumulate(dkv[0, :, k0 - ka : k1 - ka], dk_t, c.first_kv)
            accumulate(dkv[1, :, k0 - ka : k1 - ka], dv_t, c.first_kv)
        return dq, dkv[0], dkv[1]

    def units(self, rank: int) -> tuple[BlockWork | ChunkCall, ...]:
        """``rank``'s kernel calls in the collective schedule: the plan's :meth:`~AttentionPlan.calls` (the unmasked
        blocks of a Q chunk as one call, Note [One call per Q chunk]), or its single blocks when softcapped logits
        go tile by tile to the reference kernel."""
        if self.softcap is not None and "softcap" not in self._keywords:
            return self.plan.blocks(rank)
        return self.plan.calls(rank)

    def kernel_calls(self, rank: int) -> int:
        """Kernel ``forward`` calls of ``rank``'s forward in the collective schedule (each phase makes as many): one
        per chunk call on a kernel that takes ``segments`` (else one per row group, its diagonal one more), and a
        single block's tiles or runs."""
        return sum(len(self.route(u).calls) for u in self.units(rank))

    def forward_chunk(self, c: ChunkCall, q: Tensor, kv_of: Callable[[int], Tensor]) -> tuple[Tensor, Tensor]:
        """``(o, lse)`` of rows ``c.q_rows`` of the Q chunk ``q (B, L, H, D)``, ``kv_of(y)`` the stacked K, V chunk
        ``y`` ``(2, B, L, Hkv, D)``: one call on a kernel that takes it by segments (:func:`by_segments`), else one
        per row group (its diagonal a second call, merged in)."""
        return self._forward(c, q, kv_of)

    def backward_chunk(
        self, c: ChunkCall, q: Tensor, do: Tensor, stats: Tensor, kv_of: Callable[[int], Tensor]
    ) -> tuple[Tensor, list[tuple[int, tuple[int, int], Tensor, Tensor]]]:
        """``dq`` of rows ``c.q_rows`` and ``(y, kv_rows, dk, dv)`` per key piece (a piece two row groups see comes
        twice: sum them; in the order of :attr:`Route.pieces`) of :meth:`forward_chunk`'s call; ``stats (2, B, H,
        L)`` the rows' lse and delta."""
        route, grads = self.route(c), []
        if route.whole:
            dq, dk, dv = self._backward_call(c.x, route.calls[0], q, do, stats, kv_of)
            return dq, _split_keys(route.pieces, dk, dv, grads)
        (r0, r1) = c.q_rows
        dq = accumulator((q.shape[0], r1 - r0, *q.shape[2:]), acc_dtype(q.dtype), q.device, route.complete)
        for call in route.calls:
            dq_g, dk, dv = self._backward_call(c.x, call, q, do, stats, kv_of)
            (s0, s1) = call.q_rows
            accumulate(dq[:, s0 - r0 : s1 - r0], dq_g, call.first)
            _split_keys(call.keys, dk, dv, grads)
        return dq, grads

    def route(self, u: BlockWork | ChunkCall) -> Route:
        """The kernel calls of ``u`` on this call's kernel, built once per plan (Note [Host work per plan])."""
        cache, key = plan_cache(self.plan), (id(u), self.route_mode)
        hit = cache.get(key)
        if hit is None or hit[0] is not u:  # the unit is held with its route, so its id names it
            hit = cache[key] = (u, self._chunk_route(u) if isinstance(u, ChunkCall) else self._block_route(u))
        return hit[1]

    @functools.cached_property
    def _keywords(self) -> frozenset[str]:
        return capabilities_of(self.kernel).keywords

    @functools.cached_property
    def _by_segments(self) -> bool:
        return by_segments(self.kernel)

    @functools.cached_property
    def route_mode(self) -> tuple:
        """What the routes depend on beside the plan and the unit: the softcap and the kernel's keywords."""
        return self.softcap, self._keywords

    def _forward(self, u: BlockWork | ChunkCall, q: Tensor, kv_of: Callable[[int], Tensor]) -> tuple[Tensor, Tensor]:
        """``(o, lse)`` of the rows ``u.q_rows`` of ``q``: its one call's, or its calls' written or merged in."""
        route = self.route(u)
        if route.whole:
            return self._forward_call(u.x, route.calls[0], q, kv_of)
        (r0, r1), acc = u.q_rows, acc_dtype(q.dtype)
        batch, _, heads, dim = q.shape
        o_acc = accumulator((batch, r1 - r0, heads, dim), acc, q.device, route.complete)
        lse_acc = accumulator((batch, heads, r1 - r0), acc, q.device, route.complete, float("-inf"))
        for c in route.calls:
            o, lse = self._forward_call(u.x, c, q, kv_of)
            (q0, q1) = c.q_rows
            write_rows(o_acc[:, q0 - r0 : q1 - r0], lse_acc[:, :, q0 - r0 : q1 - r0], o, lse, c.first)
        return o_acc, lse_acc

    def _forward_call(self, x: int, c: KernelCall, q: Tensor, kv_of: Callable[[int], Tensor]) -> tuple[Tensor, Tensor]:
        (q0, q1), kv, kernel = c.q_rows, _keys(c.keys, kv_of), _REFERENCE if c.reference else self.kernel
        return kernel.forward(q[:, q0:q1], kv[0], kv[1], causal=c.causal, scale=self.scale, **self._extra(x, c))

    def _backward_call(self, x: int, c: KernelCall, q, do, stats, kv_of) -> tuple[Tensor, Tensor, Tensor]:
        (q0, q1), kv, kernel = c.q_rows, _keys(c.keys, kv_of), _REFERENCE if c.reference else self.kernel
        st, options = stats[:, :, :, q0:q1], {"causal": c.causal, "scale": self.scale, "lse_grad": self.lse_grad}
        return kernel.backward(do[:, q0:q1], q[:, q0:q1], kv[0], kv[1], st[0], st[1], **options, **self._extra(x, c))

    def _extra(self, x: int, c: KernelCall) -> dict:
        """The keywords of call ``c`` of Q chunk ``x``: its route's, and a tile's mask, built now from the document
        ids."""
        if not c.mask:
            return c.extra
        ((y, kv_rows),) = c.keys
        return {**c.extra, "mask": self._tile_mask(x, y, c.q_rows, kv_rows)}

    def _block_route(self, w: BlockWork) -> Route:
        """Block ``w`` as one call, or as tiles when the mask cuts it or its logits are softcapped and the kernel cannot
        do that (the reference kernel then runs it tile by tile, in bounded memory). A ``MASKED`` block goes to a
        kernel that takes it by segments as one call (Note [Block segments] in :mod:`mesh_cp.core.segments`), or as
        its runs of consecutive global positions, uncut: the segments skip what the mask removes (Note [Masked
        blocks] in :mod:`mesh_cp.core.masks`)."""
        masked = w.kind is MaskKind.MASKED
        tiled = masked or (self.softcap is not None and "softcap" not in self._keywords)
        runs = masked and self.softcap is None and self._by_segments
        if not tiled or (runs and self.plan.block_segments(w) is not None):
            kind = "block" if masked else "causal" if w.causal else "full"
            call = self._kernel_call(w, w.q_rows, w.kv_rows, kind)
            return Route((call,), True, True, True, call.keys)
        tiles = self.plan.tiles(w, runs=runs)
        (qa, qb), (ka, kb) = w.q_rows, w.kv_rows
        first_q, complete = first_writes([(0, (q0 - qa, q1 - qa)) for (q0, q1), _, _ in tiles], 1, qb - qa)
        first_k, complete_kv = first_writes([(0, (k0 - ka, k1 - ka)) for _, (k0, k1), _ in tiles], 1, kb - ka)
        calls = tuple(
            self._kernel_call(w, q_rows, kv_rows, kind, first=fq, first_kv=fk)
            for (q_rows, kv_rows, kind), fq, fk in zip(tiles, first_q, first_k, strict=True)
        )
        whole = len(tiles) == 1 and tiles[0][:2] == (w.q_rows, w.kv_rows)
        return Route(calls, whole, complete, complete_kv, tuple(p for c in calls for p in c.keys))

    def _kernel_call(self, w: BlockWork, q_rows, kv_rows, kind: str, **first: bool) -> KernelCall:
        """One call of block ``w``. Softcapped logits go to a kernel that takes ``"softcap"`` (else the reference
        kernel); a ``"masked"`` tile to one that takes ``"mask"`` (a boolean mask) or ``"segments"`` (flash-attn
        varlen sequences, Note [Tile segments] in :mod:`mesh_cp.core.segments`), else to the reference kernel."""
        keywords, extra, reference = self._keywords, {}, False
        if self.softcap is not None:
            reference = "softcap" not in keywords
            extra["softcap"] = self.softcap
        taken = _REFERENCE.capabilities.keywords if reference else keywords
        mask = kind == "masked" and ("mask" in taken or "segments" not in taken)
        reference = reference or (mask and "mask" not in taken)
        if kind == "block":
            extra["segments"] = self.plan.block_segments(w)
        elif kind == "masked" and not mask:
            extra["segments"] = self.plan.tile_segments(w, q_rows, kv_rows)
        return KernelCall(q_rows, ((w.y, kv_rows),), kind == "causal", reference, extra, mask, **first)

    def _chunk_route(self, c: ChunkCall) -> Route:
        """Chunk call ``c`` as one call on a kernel that takes it by segments, else as one call per row group (its
        diagonal a second call)."""
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        if self._by_segments:
            pieces = tuple(p for g in c.groups for p in g.keys)
            call = KernelCall(c.q_rows, pieces, False, False, {**extra, "segments": _chunk_segments(c)}, False)
            return Route((call,), True, True, True, pieces)
        groups = [(g.q_rows, tuple(pieces), causal) for g in c.groups for pieces, causal in _group_calls(g)]
        (r0, r1) = c.q_rows
        first, complete = first_writes([(0, (s0 - r0, s1 - r0)) for (s0, s1), _, _ in groups], 1, r1 - r0)
        calls = tuple(
            KernelCall(rows, pieces, causal, False, extra, False, first=f)
            for (rows, pieces, causal), f in zip(groups, first, strict=True)
        )
        return Route(calls, False, complete, True, tuple(p for call in calls for p in call.keys))

    def _tile_mask(self, x: int, y: int, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> Tensor:
        q_pos, k_pos = self._global_positions(x, q_rows), self._global_positions(y, kv_rows)
        return visibility(self.doc_ids, q_pos, k_pos, causal=self.plan.causal, window=self.plan.mask.window)

    def _global_positions(self, chunk: int, rows: tuple[int, int]) -> Tensor:
        """Global positions of the local rows ``rows`` of ``chunk``, on the device of :attr:`doc_ids`."""
        plan = self.plan
        positions = _chunk_positions(plan.seq_len, plan.tiling.world, chunk, plan.layout, self.doc_ids.device)
        return positions[rows[0] : rows[1]]


@functools.lru_cache(maxsize=256)
def _chunk_positions(seq_len: int, world: int, chunk: int, layout: str, device: torch.device) -> Tensor:
    """The global positions of ``chunk``'s rows on ``device``, built once: they depend on the call shape, not on the
    mask, so a new packing on every step (a new :class:`AttentionCall` in every layer) copies none to the device. Do
    not write to it."""
    return torch.tensor(local_positions(seq_len, world, chunk, layout), dtype=torch.int64, device=device)


def by_segments(kernel: BlockKernel) -> bool:
    """The kernel takes ``segments`` and no dense ``mask``, as the flash kernels do: a chunk call is one varlen call
    and a masked block one call of its documents or its runs. A kernel that also takes masks (the reference kernel)
    runs chunk calls group by group with its own causal flag and masked tiles with masks it builds on the device from
    :attr:`AttentionCall.doc_ids`, so no dense mask is built from segments on the host."""
    return takes(kernel, "segments") and not takes(kernel, "mask")


def write_rows(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor, first: bool) -> None:
    """Write a partial ``(o, lse)`` into accumulator rows: a copy for a first write (Note [First writes]), else the
    LSE merge."""
    if first:
        o_acc.copy_(o)
        lse_acc.copy_(lse)
    else:
        merge_(o_acc, lse_acc, o, lse)


def accumulate(acc: Tensor, x: Tensor, first: bool) -> None:
    """Add a partial gradient into accumulator rows in place: a copy for a first write (Note [First writes])."""
    if first:
        acc.copy_(x)
    else:
        acc.add_(x)


def accumulator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, complete: bool, fill: float = 0.0):
    """An accumulator: without values when its first writes cover it (``complete``), else filled with ``fill``."""
    if complete:
        return torch.empty(shape, dtype=dtype, device=device)
    return (
        torch.zeros(shape, dtype=dtype, device=device)
        if fill == 0
        else torch.full(shape, fill, dtype=dtype, device=device)
    )


def _keys(pieces: tuple[Piece, ...], kv_of: Callable[[int], Tensor]) -> Tensor:
    """The key pieces ``(y, (k0, k1))`` laid end to end: ``(2, B, sum of k1 - k0, Hkv, D)`` (a view for one piece)."""
    if len(pieces) == 1:
        ((y, (k0, k1)),) = pieces
        return kv_of(y)[:, :, k0:k1]
    return torch.cat([kv_of(y)[:, :, k0:k1] for y, (k0, k1) in pieces], dim=2)


def _split_keys(pieces, dk: Tensor, dv: Tensor, out: list) -> list:
    """Append ``(y, kv_rows, dk, dv)`` of every piece of keys laid end to end (:func:`_keys`) to ``out``."""
    at = 0
    for y, (k0, k1) in pieces:
        out.append((y, (k0, k1), dk[:, at : at + k1 - k0], dv[:, at : at + k1 - k0]))
        at += k1 - k0
    return out


def _group_calls(g: RowGroup) -> list[tuple[list[Piece], bool]]:
    """A row group as calls of a kernel without ``segments``: its keys with no causal bound in one call (the
    diagonal's columns before the group's first row included), then the diagonal's square causally."""
    if not g.causal_tail:
        return [(list(g.keys), False)]
    *before, (x, (k0, _)) = g.keys
    s0, s1 = g.q_rows
    full = before + ([(x, (k0, s0))] if s0 > k0 else [])
    return ([(full, False)] if full else []) + [([(x, (s0, s1))], True)]


def _chunk_segments(c: ChunkCall) -> tuple[tuple[tuple[int, int, int, int, int, int], ...]]:
    """The row groups of ``c`` as varlen sequences over its keys laid end to end, the same for every batch row: a
    causal tail is the band ``(-1, 0)`` anchored at the bottom-right corner (Note [Tile segments] in
    :mod:`mesh_cp.core.segments`)."""
    (r0, _), at, segments = c.q_rows, 0, []
    for g in c.groups:
        n = g.key_count
        segments.append((g.q_rows[0] - r0, g.q_rows[1] - r0, at, at + n, -1, 0 if g.causal_tail else -1))
        at += n
    return (tuple(segments),)


@dataclass(frozen=True)
class Saved:
    """What forward keeps for backward."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    """This rank's output in the input dtype."""
    lse: Tensor
    """This rank's lse in the accumulator dtype."""
    gathered: tuple[Tensor, ...] = ()
    """``backward="reuse"``: the Q chunks ``(a, ...)`` and stacked K, V chunks ``(b, 2, ...)`` gathered in forward."""
