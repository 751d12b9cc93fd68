"""One attention call as the executors see it: the mesh, the plan, the kernel, the scale, and how every block of
the plan becomes kernel calls (a Q chunk's unmasked blocks as one call, Note [One call per Q chunk] in
:mod:`mesh_cp.core.blocks`; masked blocks as varlen calls or cut into tiles, Note [Masked blocks] in
:mod:`mesh_cp.core.masks`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mesh_cp.core.blocks import BlockWork, ChunkCall, MaskKind, RowGroup
from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import acc_dtype, merge_, visibility
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.kernels import takes
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.runtime.mesh import CPMesh

_REFERENCE = ReferenceKernel()


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
        if not self._tiled(w) or self._one_call(w):
            return self._forward_call(w, w.q_rows, w.kv_rows, self._whole_kind(w), q, kv)
        (qa, qb), acc = w.q_rows, acc_dtype(q.dtype)
        batch, _, heads, dim = q.shape
        o_acc = torch.zeros((batch, qb - qa, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((batch, heads, qb - qa), float("-inf"), dtype=acc, device=q.device)
        for (q0, q1), kv_rows, kind in self.plan.tiles(w, runs=self._runs(w)):
            o, lse = self._forward_call(w, (q0, q1), kv_rows, kind, q, kv)
            merge_(o_acc[:, q0 - qa : q1 - qa], lse_acc[:, :, q0 - qa : q1 - qa], o, lse)
        return o_acc, lse_acc

    def backward_block(
        self, w: BlockWork, q: Tensor, do: Tensor, stats: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` of block ``w`` (shaped like its rows and columns) from whole chunks; ``stats
        (2, B, H, L)`` holds the rows' lse and delta."""
        if not self._tiled(w) or self._one_call(w):
            return self._backward_call(w, w.q_rows, w.kv_rows, self._whole_kind(w), q, do, stats, kv)
        (qa, qb), (ka, kb), acc = w.q_rows, w.kv_rows, acc_dtype(q.dtype)
        dq = torch.zeros((q.shape[0], qb - qa, *q.shape[2:]), dtype=acc, device=q.device)
        dkv = torch.zeros((2, kv.shape[1], kb - ka, *kv.shape[3:]), dtype=acc, device=q.device)
        for (q0, q1), (k0, k1), kind in self.plan.tiles(w, runs=self._runs(w)):
            dq_t, dk_t, dv_t = self._backward_call(w, (q0, q1), (k0, k1), kind, q, do, stats, kv)
            dq[:, q0 - qa : q1 - qa] += dq_t
            dkv[0, :, k0 - ka : k1 - ka] += dk_t
            dkv[1, :, k0 - ka : k1 - ka] += dv_t
        return dq, dkv[0], dkv[1]

    def units(self, rank: int) -> tuple[BlockWork | ChunkCall, ...]:
        """``rank``'s kernel calls in the collective schedule: the plan's :meth:`~AttentionPlan.calls` (the unmasked
        blocks of a Q chunk as one call, Note [One call per Q chunk]), or its single blocks when softcapped logits
        go tile by tile to the reference kernel."""
        if self.softcap is not None and not takes(self.kernel, "softcap"):
            return self.plan.blocks(rank)
        return self.plan.calls(rank)

    def kernel_calls(self, rank: int) -> int:
        """Kernel ``forward`` calls of ``rank``'s forward in the collective schedule (each phase makes as many): one
        per chunk call on a kernel that takes ``segments`` (else one per row group, its diagonal one more), and a
        single block's tiles or runs."""
        count = 0
        for u in self.units(rank):
            if isinstance(u, ChunkCall):
                count += 1 if self._by_segments() else sum(len(_group_calls(g)) for g in u.groups)
            else:
                tiled = self._tiled(u) and not self._one_call(u)
                count += len(self.plan.tiles(u, runs=self._runs(u))) if tiled else 1
        return count

    def forward_chunk(self, c: ChunkCall, q: Tensor, kv_of: Callable[[int], Tensor]) -> tuple[Tensor, Tensor]:
        """``(o, lse)`` of rows ``c.q_rows`` of the Q chunk ``q (B, L, H, D)``, ``kv_of(y)`` the stacked K, V chunk
        ``y`` ``(2, B, L, Hkv, D)``: one call on a kernel that takes it by segments (:meth:`_by_segments`), else one
        per row group (its diagonal a second call, merged in)."""
        (r0, r1), kernel, extra = c.q_rows, *self._kernel_for_chunks()
        if self._by_segments():
            kv = _keys([p for g in c.groups for p in g.keys], kv_of)
            segments = _chunk_segments(c)
            return kernel.forward(q[:, r0:r1], kv[0], kv[1], causal=False, scale=self.scale, segments=segments, **extra)
        batch, _, heads, dim = q.shape
        acc = acc_dtype(q.dtype)
        o_acc = torch.zeros((batch, r1 - r0, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((batch, heads, r1 - r0), float("-inf"), dtype=acc, device=q.device)
        for g in c.groups:
            s0, s1 = g.q_rows
            for pieces, causal in _group_calls(g):
                kv = _keys(pieces, kv_of)
                o, lse = kernel.forward(q[:, s0:s1], kv[0], kv[1], causal=causal, scale=self.scale, **extra)
                merge_(o_acc[:, s0 - r0 : s1 - r0], lse_acc[:, :, s0 - r0 : s1 - r0], o, lse)
        return o_acc, lse_acc

    def backward_chunk(
        self, c: ChunkCall, q: Tensor, do: Tensor, stats: Tensor, kv_of: Callable[[int], Tensor]
    ) -> tuple[Tensor, list[tuple[int, tuple[int, int], Tensor, Tensor]]]:
        """``dq`` of rows ``c.q_rows`` and ``(y, kv_rows, dk, dv)`` per key piece (a piece two row groups see comes
        twice: sum them) of :meth:`forward_chunk`'s call; ``stats (2, B, H, L)`` the rows' lse and delta."""
        (r0, r1), kernel, extra = c.q_rows, *self._kernel_for_chunks()
        grads: list[tuple[int, tuple[int, int], Tensor, Tensor]] = []
        common = {"scale": self.scale, "lse_grad": self.lse_grad, **extra}
        if self._by_segments():
            pieces = [p for g in c.groups for p in g.keys]
            kv = _keys(pieces, kv_of)
            st = stats[:, :, :, r0:r1]
            dq, dk, dv = kernel.backward(
                do[:, r0:r1],
                q[:, r0:r1],
                kv[0],
                kv[1],
                st[0],
                st[1],
                causal=False,
                segments=_chunk_segments(c),
                **common,
            )
            return dq, _split_keys(pieces, dk, dv, grads)
        dq = torch.zeros((q.shape[0], r1 - r0, *q.shape[2:]), dtype=acc_dtype(q.dtype), device=q.device)
        for g in c.groups:
            s0, s1 = g.q_rows
            for pieces, causal in _group_calls(g):
                kv = _keys(pieces, kv_of)
                st = stats[:, :, :, s0:s1]
                dq_g, dk, dv = kernel.backward(
                    do[:, s0:s1], q[:, s0:s1], kv[0], kv[1], st[0], st[1], causal=causal, **common
                )
                dq[:, s0 - r0 : s1 - r0] += dq_g
                _split_keys(pieces, dk, dv, grads)
        return dq, grads

    def _kernel_for_chunks(self) -> tuple[BlockKernel, dict]:
        """The kernel of a :class:`ChunkCall` and its extra arguments (the softcap when it takes one; chunk calls
        are not used otherwise, :meth:`units`)."""
        return self.kernel, ({} if self.softcap is None else {"softcap": self.softcap})

    def _by_segments(self) -> bool:
        return by_segments(self.kernel)

    def _runs(self, w: BlockWork) -> bool:
        """A ``MASKED`` block goes to a kernel that takes it by segments (:meth:`_by_segments`) as one call, or as its
        runs of consecutive global positions, uncut: the segments skip what the mask removes (Note [Masked blocks]
        in :mod:`mesh_cp.core.masks`)."""
        return w.kind is MaskKind.MASKED and self.softcap is None and self._by_segments()

    def _one_call(self, w: BlockWork) -> bool:
        """A ``MASKED`` block that a kernel taking it by segments runs as one call (Note [Block segments] in
        :mod:`mesh_cp.core.masks`)."""
        return self._runs(w) and self.plan.block_segments(w) is not None

    def _whole_kind(self, w: BlockWork) -> str:
        """The kind of the one call of a whole block: ``"block"`` (its segments), ``"causal"`` or ``"full"``."""
        return "block" if w.kind is MaskKind.MASKED else "causal" if w.causal else "full"

    def _tiled(self, w: BlockWork) -> bool:
        """Block ``w`` runs as tiles: the mask cuts it, or its logits are softcapped and the kernel cannot do that
        (the reference kernel then runs it tile by tile, in bounded memory)."""
        return w.kind is MaskKind.MASKED or (self.softcap is not None and not takes(self.kernel, "softcap"))

    def _forward_call(self, w: BlockWork, q_rows, kv_rows, kind: str, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        (q0, q1), (k0, k1) = q_rows, kv_rows
        kernel, extra = self._kernel(w, q_rows, kv_rows, kind)
        return kernel.forward(
            q[:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=kind == "causal", scale=self.scale, **extra
        )

    def _backward_call(self, w: BlockWork, q_rows, kv_rows, kind: str, q, do, stats, kv) -> tuple[Tensor, ...]:
        (q0, q1), (k0, k1) = q_rows, kv_rows
        kernel, extra = self._kernel(w, q_rows, kv_rows, kind)
        return kernel.backward(
            do[:, q0:q1],
            q[:, q0:q1],
            kv[0, :, k0:k1],
            kv[1, :, k0:k1],
            stats[0, :, :, q0:q1],
            stats[1, :, :, q0:q1],
            causal=kind == "causal",
            scale=self.scale,
            lse_grad=self.lse_grad,
            **extra,
        )

    def _kernel(self, w: BlockWork, q_rows, kv_rows, kind: str) -> tuple[BlockKernel, dict]:
        """The kernel of one call and its extra arguments. Softcapped logits go to a kernel that takes ``"softcap"``
        (else the reference kernel); a ``"masked"`` tile to one that takes ``"mask"`` (a boolean mask) or
        ``"segments"`` (flash-attn varlen sequences, Note [Tile segments] in :mod:`mesh_cp.core.masks`),
        else to the reference kernel."""
        kernel, extra = self.kernel, {}
        if self.softcap is not None:
            kernel = kernel if takes(kernel, "softcap") else _REFERENCE
            extra["softcap"] = self.softcap
        if kind == "block":
            return kernel, {**extra, "segments": self.plan.block_segments(w)}
        if kind != "masked":
            return kernel, extra
        if takes(kernel, "mask"):
            return kernel, {**extra, "mask": self._tile_mask(w, q_rows, kv_rows)}
        if takes(kernel, "segments"):
            return kernel, {**extra, "segments": self.plan.tile_segments(w, q_rows, kv_rows)}
        return _REFERENCE, {**extra, "mask": self._tile_mask(w, q_rows, kv_rows)}

    def _tile_mask(self, w: BlockWork, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> Tensor:
        q_pos, k_pos = self._global_positions(w.x, q_rows), self._global_positions(w.y, kv_rows)
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


Piece = tuple[int, tuple[int, int]]


def _keys(pieces: list[Piece] | tuple[Piece, ...], kv_of: Callable[[int], Tensor]) -> Tensor:
    """The key pieces ``(y, (k0, k1))`` laid end to end: ``(2, B, sum of k1 - k0, Hkv, D)`` (a view for one piece)."""
    parts = [kv_of(y)[:, :, k0:k1] for y, (k0, k1) in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


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
    :mod:`mesh_cp.core.masks`)."""
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
