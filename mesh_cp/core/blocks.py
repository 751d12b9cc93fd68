"""The blocks of the attention block matrix: what part of block ``(x, y)`` is computed (pure Python).

Note [Zig-zag causal balance]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For causal attention the sequence is cut into ``2P`` half-chunks and rank ``g`` holds the pair
``(g, 2P-1-g)``, in that order. Every off-diagonal block then costs exactly half a dense block::

    y < x : KV_FIRST_HALF   both Q halves attend the first KV half, no mask
    y > x : Q_SECOND_HALF   only the second Q half attends, to both KV halves, no mask
    y = x : CAUSAL          ordinary causal attention over the rank's own chunk

(The local order of a zig-zag chunk is increasing in global position, so the diagonal block is the
usual top-left causal mask.) Every rank owns exactly one diagonal block, so every ``a x b`` tile is
perfectly balanced. With the contiguous layout a causal block is FULL below the diagonal and SKIP
above it, which leaves the first ranks idle.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from mesh_cp.core.layout import check_layout
from mesh_cp.core.options import Layout


class MaskKind(enum.Enum):
    """What part of block ``(x, y)`` is computed; see Note [Zig-zag causal balance]."""

    FULL = "full"
    CAUSAL = "causal"
    KV_FIRST_HALF = "kv_first_half"
    Q_SECOND_HALF = "q_second_half"
    SKIP = "skip"
    MASKED = "masked"
    """An :class:`~mesh_cp.core.masks.AttentionMask` removes some pairs: one call with an explicit mask
    (Note [Masked blocks] in :mod:`mesh_cp.core.masks`)."""


def mask_kind(x: int, y: int, *, causal: bool, layout: Layout) -> MaskKind:
    if not causal:
        return MaskKind.FULL
    if x == y:
        return MaskKind.CAUSAL
    if layout == "zigzag":
        return MaskKind.KV_FIRST_HALF if y < x else MaskKind.Q_SECOND_HALF
    check_layout(layout)
    return MaskKind.FULL if y < x else MaskKind.SKIP


@dataclass(frozen=True)
class BlockWork:
    """One kernel call: Q rows ``q_rows`` of chunk ``x`` against KV rows ``kv_rows`` of chunk ``y``."""

    x: int
    y: int
    kind: MaskKind
    q_rows: tuple[int, int]
    """Local row range ``[start, stop)`` of Q chunk ``x`` that takes part."""
    kv_rows: tuple[int, int]
    """Local row range ``[start, stop)`` of KV chunk ``y`` that takes part."""
    masked_pairs: int | None = None
    """For a ``MASKED`` block, the pairs the mask leaves, averaged over the batch rows."""

    @property
    def causal(self) -> bool:
        return self.kind is MaskKind.CAUSAL

    @property
    def pairs(self) -> int:
        """Query-key pairs computed (the block's compute cost)."""
        if self.masked_pairs is not None:
            return self.masked_pairs
        nq = self.q_rows[1] - self.q_rows[0]
        nk = self.kv_rows[1] - self.kv_rows[0]
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def block_work(x: int, y: int, *, causal: bool, layout: Layout, seq_local: int) -> BlockWork | None:
    """The kernel call for block ``(x, y)``, or ``None`` when the mask leaves nothing to compute."""
    kind = mask_kind(x, y, causal=causal, layout=layout)
    half = seq_local // 2
    rows = {
        MaskKind.FULL: ((0, seq_local), (0, seq_local)),
        MaskKind.CAUSAL: ((0, seq_local), (0, seq_local)),
        MaskKind.KV_FIRST_HALF: ((0, seq_local), (0, half)),
        MaskKind.Q_SECOND_HALF: ((half, seq_local), (0, seq_local)),
    }
    if kind is MaskKind.SKIP:
        return None
    q_rows, kv_rows = rows[kind]
    return BlockWork(x=x, y=y, kind=kind, q_rows=q_rows, kv_rows=kv_rows)


@dataclass(frozen=True)
class RowGroup:
    """Rows ``q_rows`` of a Q chunk that see the same keys: the pieces ``keys`` (``(y, kv_rows)`` of KV chunks),
    laid end to end in that order. With ``causal_tail`` the last piece is the chunk's own diagonal, ending at
    ``q_rows[1]``: causal anchored at the bottom-right corner (query ``i`` of the group sees every key of the
    other pieces and the tail's keys up to its own position)."""

    q_rows: tuple[int, int]
    keys: tuple[tuple[int, tuple[int, int]], ...]
    causal_tail: bool

    @property
    def key_count(self) -> int:
        return sum(k1 - k0 for _, (k0, k1) in self.keys)


@dataclass(frozen=True)
class ChunkCall:
    """The unmasked blocks of one Q chunk run as one kernel call over their keys laid end to end (Note [One call
    per Q chunk])."""

    x: int
    groups: tuple[RowGroup, ...]
    """Disjoint, sorted row ranges of the Q chunk with their keys."""
    blocks: tuple[BlockWork, ...]
    """The blocks the call computes."""

    @property
    def q_rows(self) -> tuple[int, int]:
        """The rows from the first group's start to the last one's end (rows in no group attend nothing)."""
        return self.groups[0].q_rows[0], self.groups[-1].q_rows[1]

    @property
    def key_count(self) -> int:
        """Rows of the keys laid end to end (a piece seen by two groups counts twice)."""
        return sum(g.key_count for g in self.groups)


def chunk_calls(blocks: tuple[BlockWork, ...]) -> tuple[BlockWork | ChunkCall, ...]:
    """``blocks`` (one rank's) with the unmasked blocks of every Q chunk that has two or more as one
    :class:`ChunkCall`, in the order of the chunk's first block; ``MASKED`` blocks stay single.

    Note [One call per Q chunk]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The blocks of a Q chunk that the collective schedule holds together are one call over their keys laid end
    to end, so the kernel merges them in its own loop and the outputs need no LSE merge and the backward's
    ``rowsum(dO * O)`` construction runs once per chunk. The rows are cut where a block's row range starts or
    stops (a zig-zag chunk: its two halves); each cut is a :class:`RowGroup` with the keys of every block that
    covers it. A causal diagonal restricted to rows ``[s0, s1)`` is the keys ``[k0, s1)`` causal from the
    bottom-right corner (flash-attn's alignment when ``Sq < Sk``), so it goes last: in a zig-zag chunk the first
    half sees the earlier chunks' first halves then its own first half causally, the second half sees those,
    the later chunks and then its own chunk, causally at the end. A kernel that takes ``segments`` runs the
    groups as varlen sequences of one call (a segment with window ``(-1, 0)`` is that bottom-right causal);
    another runs each group as one call, its diagonal as a second call merged in.
    """
    by_x: dict[int, list[BlockWork]] = {}
    for w in blocks:
        if w.kind is not MaskKind.MASKED:
            by_x.setdefault(w.x, []).append(w)
    out: list[BlockWork | ChunkCall] = []
    done: set[int] = set()
    for w in blocks:
        group = by_x.get(w.x, [])
        if w.kind is MaskKind.MASKED or len(group) < 2:
            out.append(w)
        elif w.x not in done:
            done.add(w.x)
            out.append(ChunkCall(x=w.x, groups=_row_groups(group), blocks=tuple(group)))
    return tuple(out)


def _row_groups(blocks: list[BlockWork]) -> tuple[RowGroup, ...]:
    cuts = sorted({r for w in blocks for r in w.q_rows})
    groups = []
    for s0, s1 in zip(cuts, cuts[1:], strict=False):
        pieces, tail = [], None
        for w in sorted(blocks, key=lambda b: b.y):
            if w.q_rows[0] <= s0 and s1 <= w.q_rows[1]:
                if w.causal:
                    tail = (w.y, (w.kv_rows[0], s1))
                else:
                    pieces.append((w.y, w.kv_rows))
        if tail is not None:
            pieces.append(tail)
        if pieces:
            groups.append(RowGroup(q_rows=(s0, s1), keys=tuple(pieces), causal_tail=tail is not None))
    return tuple(groups)


def first_writes(writes: Sequence[tuple[int, tuple[int, int]]], slots: int) -> tuple[bool, ...]:
    """For every write ``(slot, (start, stop))`` of ``writes`` into an accumulator of ``slots`` slots, in order:
    whether no earlier write touched any of its rows (a first write).

    Note [First writes]
    ~~~~~~~~~~~~~~~~~~~
    Partial results are accumulated into buffers that start as the identity of their reduction (``0`` for a sum,
    ``(0, -inf)`` for the LSE merge of Note [LSE merge]). A write into rows that nothing has written yet is a copy:
    ``0 + x`` is ``x``, and the merge of ``(o, lse)`` into ``(0, -inf)`` is ``(o, lse)`` (``logaddexp(-inf, lse) =
    lse``, weights ``0`` and ``1``; a row that attends nothing has ``(0, -inf)`` either way). So the buffer is allocated
    without values (``torch.empty``), only the rows no first write covers are filled with the identity
    (:func:`unwritten`), and first writes are copies. The writes of a plan's calls are fixed by the plan, so this is
    decided on the host once per plan.
    """
    touched: list[list[tuple[int, int]]] = [[] for _ in range(slots)]
    first = []
    for slot, (start, stop) in writes:
        spans = touched[slot]
        first.append(all(stop <= s0 or s1 <= start for s0, s1 in spans))
        spans.append((start, stop))  # written either way: a later write over these rows is no first write
    return tuple(first)


def unwritten(
    writes: Sequence[tuple[int, tuple[int, int]]], first: Sequence[bool], slots: int, size: int
) -> tuple[tuple[int, int, int], ...]:
    """The rows ``(slot, start, stop)`` of an accumulator of ``slots`` slots of ``size`` rows that no first write of
    ``writes`` covers (``first`` as :func:`first_writes` returns it): the only rows that need the identity before the
    writes run (Note [First writes]). A row a first write covers is written by it before any other write reaches it:
    a write touching that row earlier would have made it no first write."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(slots)]
    for (slot, rows), fresh in zip(writes, first, strict=True):
        if fresh:
            spans[slot].append(rows)
    return tuple((slot, a, b) for slot, written in enumerate(spans) for a, b in uncovered(written, 0, size))


def uncovered(spans: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The runs of ``[start, stop)`` that none of ``spans`` (overlapping or not) covers, in order."""
    gaps, at = [], start
    for s0, s1 in sorted(spans):
        if s1 <= at or s0 >= stop:
            continue
        if s0 > at:
            gaps.append((at, s0))
        at = max(at, s1)
    if at < stop:
        gaps.append((at, stop))
    return gaps
