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
