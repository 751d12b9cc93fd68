"""The Mesh-Attention plan: who computes which block and who sends what to whom, as frozen data.

Pure Python (no torch): the executors run this plan, the communication counter checks what they sent
against it, and the simulator (:mod:`mesh_cp.sim`, also the peak-memory model) reads it. The tiling is
Note [Mesh tiling] in :mod:`mesh_cp.core.tiling`; the layouts are in :mod:`mesh_cp.core.layout`.

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

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Literal

from mesh_cp.core.layout import check_layout
from mesh_cp.core.masks import NO_MASK, AttentionMask, Tile, block_tiles, rectangle_pairs, tile_segments
from mesh_cp.core.options import Backward, Layout, Phase, Schedule, check_option
from mesh_cp.core.schedule import OverlapSchedule, build_overlap_schedule
from mesh_cp.core.tiling import Tiling

# ----------------------------------------------------------------------------------------------
# Blocks


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


def mask_kind(x: int, y: int, *, causal: bool, layout: str) -> MaskKind:
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


def block_work(x: int, y: int, *, causal: bool, layout: str, seq_local: int) -> BlockWork | None:
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


# ----------------------------------------------------------------------------------------------
# Transfers


@dataclass(frozen=True)
class Transfer:
    """One collective of the collective schedule, identical (relative to the rank) on every rank.

    ``bytes_sent`` counts what one rank puts on the wire with a bandwidth-optimal algorithm:
    an all-gather sends the local piece to each of the other ``n - 1`` members, an all-to-all sends
    ``n - 1`` of its ``n`` pieces.
    """

    phase: Phase
    group: Literal["q", "kv"]
    op: Literal["all_gather", "all_to_all"]
    what: str
    group_size: int
    piece_bytes: int
    """Bytes of the piece one rank contributes per peer."""

    @property
    def bytes_sent(self) -> int:
        return (self.group_size - 1) * self.piece_bytes


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank tensor sizes of one attention call."""

    batch: int
    seq_local: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    """Bytes per element of q, k, v (2 for bf16/fp16, 4 for fp32)."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq_local", "heads", "kv_heads", "head_dim", "itemsize"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionShape.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (GQA/MQA); "
                f"use a kv_heads that divides {self.heads}"
            )

    @property
    def acc_itemsize(self) -> int:
        """Bytes per element of accumulators (o, lse, delta, dq, dk, dv): fp32, or fp64 for fp64."""
        return 8 if self.itemsize == 8 else 4

    @property
    def chunk_elems(self) -> int:
        """One ``C``: elements of a local Q chunk, ``batch * seq_local * heads * head_dim``."""
        return self.batch * self.seq_local * self.heads * self.head_dim

    @property
    def kv_ratio(self) -> float:
        """``r = kv_heads / heads``."""
        return self.kv_heads / self.heads

    @property
    def stats_elems(self) -> int:
        """Elements of one lse (or delta) chunk, ``batch * heads * seq_local``."""
        return self.batch * self.heads * self.seq_local


@dataclass(frozen=True)
class AttentionPlan:
    """Everything one attention call does, as data: blocks, transfers, bytes and buffers."""

    tiling: Tiling
    shape: AttentionShape
    causal: bool
    layout: Layout
    backward: Backward = "regather"
    """``"regather"`` gathers Q and KV again in backward (less memory); ``"reuse"`` keeps the
    chunks gathered in forward (less traffic)."""
    schedule: Schedule = "overlap"
    """``"overlap"``: p2p rings with compute overlapped (Note [Overlapped schedule]);
    ``"collective"``: all-gather, compute, all-to-all."""
    link_cost: tuple[float, float] = (1.0, 1.0)
    """Relative seconds per byte on the Q ring and on the KV ring; orders the overlapped schedule's moves."""
    buffer_budget: int | None = None
    """Most bytes of gathered Q/KV chunks the overlapped schedule may hold at once (``None``: no limit)."""
    mask: AttentionMask | None = None
    """Documents, padding and a window beyond ``causal`` (``None``: none); see Note [Masked blocks]."""

    def __post_init__(self) -> None:
        check_option("layout", self.layout)
        check_option("backward", self.backward)
        check_option("schedule", self.schedule)
        if self.layout == "zigzag" and self.shape.seq_local % 2:
            raise ValueError(
                f"seq_local {self.shape.seq_local} must be even for the zigzag layout "
                f"(global seq_len must be a multiple of 2*P = {2 * self.tiling.world}); pad the sequence"
            )
        if len(self.link_cost) != 2 or min(self.link_cost) <= 0:
            raise ValueError(f"link_cost must be two positive numbers (Q ring, KV ring), got {self.link_cost!r}")
        if self.mask is not None:
            self.mask.check(self.shape.batch, self.seq_len, self.causal)
        if self.buffer_budget is not None and self.buffer_budget < 1:
            raise ValueError(f"buffer_budget must be a positive number of bytes or None, got {self.buffer_budget!r}")

    @property
    def seq_len(self) -> int:
        return self.shape.seq_local * self.tiling.world

    def blocks(self, rank: int) -> tuple[BlockWork, ...]:
        """Kernel calls of ``rank``, in execution order (its diagonal block first)."""
        work = [self._masked(block_work(x, y, **self._work_options())) for x, y in self.tiling.blocks(rank)]
        todo = [w for w in work if w is not None]
        return tuple(sorted(todo, key=lambda w: (w.x, w.y) != (rank, rank)))

    def pairs(self, rank: int) -> int:
        """Query-key pairs ``rank`` computes (its share of the compute)."""
        return sum(w.pairs for w in self.blocks(rank))

    def transfers(self, phase: Phase) -> tuple[Transfer, ...]:
        """The collectives of ``phase``, in issue order; groups of size 1 move nothing."""
        s, a, b = self.shape, self.tiling.a, self.tiling.b
        item, acc = s.itemsize, s.acc_itemsize
        q_bytes, kv_bytes = self.chunk_bytes()
        stats_bytes = s.stats_elems * acc
        if phase == "forward":
            steps = [
                ("q", "all_gather", "q", a, q_bytes),
                ("kv", "all_gather", "k,v", b, kv_bytes),
                ("q", "all_to_all", "o,lse", a, s.chunk_elems * acc + stats_bytes),
            ]
        elif phase == "backward":
            regather = self.backward == "regather"
            steps = [
                ("q", "all_gather", "q,do" if regather else "do", a, (2 if regather else 1) * q_bytes),
                ("q", "all_gather", "lse,delta", a, 2 * stats_bytes),
                *([("kv", "all_gather", "k,v", b, kv_bytes)] if regather else []),
                ("q", "all_to_all", "dq", a, s.chunk_elems * acc),
                ("kv", "all_to_all", "dk,dv", b, kv_bytes // item * acc),
            ]
        else:
            check_option("phase", phase)
        return tuple(
            Transfer(phase=phase, group=group, op=op, what=what, group_size=n, piece_bytes=nbytes)
            for group, op, what, n, nbytes in steps
            if n > 1
        )

    def chunk_bytes(self) -> tuple[int, int]:
        """Bytes of one Q chunk and of one KV chunk (K and V), in the input dtype."""
        s = self.shape
        return s.chunk_elems * s.itemsize, 2 * s.batch * s.seq_local * s.kv_heads * s.head_dim * s.itemsize

    def step_bytes(self, phase: Phase) -> dict[tuple[str, str], int]:
        """Bytes one rank sends per step of the overlapped schedule, by ``(ring, "move" | "reduce")``."""
        s = self.shape
        q_bytes, kv_bytes = self.chunk_bytes()
        acc, stats = s.acc_itemsize, s.stats_elems * s.acc_itemsize
        if phase == "forward":
            return {("q", "move"): q_bytes, ("kv", "move"): kv_bytes, ("q", "reduce"): s.chunk_elems * acc + stats}
        check_option("phase", phase)
        regather = self.backward == "regather"
        return {
            ("q", "move"): (2 if regather else 1) * q_bytes + 2 * stats,
            ("kv", "move"): kv_bytes if regather else 0,
            ("q", "reduce"): s.chunk_elems * acc,
            ("kv", "reduce"): kv_bytes // s.itemsize * acc,
        }

    def overlap(self, phase: Phase) -> OverlapSchedule:
        """The overlapped schedule of ``phase``: greedy path and actions (Note [Overlapped schedule])."""
        nbytes = self.step_bytes(phase)
        q_bytes, kv_bytes = self.chunk_bytes()
        if phase == "backward" and self.backward == "regather":
            # A Q move carries q and dO: two chunks held per Q offset.
            q_bytes *= 2
        return build_overlap_schedule(
            self.tiling.a,
            self.tiling.b,
            t_q=nbytes[("q", "move")] * self.link_cost[0],
            t_kv=nbytes[("kv", "move")] * self.link_cost[1],
            reduce=("q",) if phase == "forward" else ("q", "kv"),
            kv_present=phase == "backward" and self.backward == "reuse",
            q_bytes=q_bytes,
            kv_bytes=kv_bytes,
            budget=self.buffer_budget,
        )

    def block_at(self, rank: int, q_offset: int, kv_offset: int) -> BlockWork | None:
        """The kernel call of ``rank``'s block at ring offsets ``(q_offset, kv_offset)`` of the
        overlapped schedule (offset ``i`` is the chunk that started ``i`` ring positions before
        ``rank``), or ``None`` when the mask leaves nothing to compute."""
        t = self.tiling
        q_members, kv_members = t.q_group(rank), t.kv_group(rank)
        x = q_members[(q_members.index(rank) - q_offset) % t.a]
        y = kv_members[(kv_members.index(rank) - kv_offset) % t.b]
        return self._masked(block_work(x, y, **self._work_options()))

    def tiles(self, w: BlockWork) -> tuple[Tile, ...]:
        """The kernel calls of block ``w`` cut into tiles (:func:`mesh_cp.core.masks.block_tiles`): a ``MASKED``
        block's, or any block's where the kernel cannot run it whole (softcapped logits)."""
        return block_tiles(self.mask or NO_MASK, (w.x, w.q_rows), (w.y, w.kv_rows), **self._mask_options())

    def tile_segments(self, w: BlockWork, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> tuple:
        """The ``"masked"`` tile ``(q_rows, kv_rows)`` of block ``w`` as flash-attn varlen sequences per batch row
        (:func:`mesh_cp.core.masks.tile_segments`)."""
        return tile_segments(self.mask or NO_MASK, (w.x, q_rows), (w.y, kv_rows), **self._mask_options())

    def _mask_options(self) -> dict:
        return {"seq_len": self.seq_len, "world": self.tiling.world, "layout": self.layout, "causal": self.causal}

    def _work_options(self) -> dict:
        return {"causal": self.causal, "layout": self.layout, "seq_local": self.shape.seq_local}

    def _masked(self, w: BlockWork | None) -> BlockWork | None:
        """``w`` under :attr:`mask`: ``None`` when no row keeps a pair, ``w`` when the mask removes none,
        else a ``MASKED`` block with its pair count (Note [Masked blocks])."""
        if w is None or self.mask is None:
            return w
        pairs = rectangle_pairs(self.mask, (w.x, w.q_rows), (w.y, w.kv_rows), **self._mask_options())
        if not any(pairs):
            return None
        if all(n == w.pairs for n in pairs):
            return w
        return dataclasses.replace(w, kind=MaskKind.MASKED, masked_pairs=sum(pairs) // len(pairs))

    def bytes_sent(self, phase: Phase, group: str | None = None) -> int:
        """Bytes one rank sends in ``phase`` (optionally only within the ``"q"`` or ``"kv"`` group).

        Both schedules send the same bytes: a ring all-gather or reduce-scatter step moves what the
        bandwidth-optimal collective moves.
        """
        if self.schedule == "collective":
            return sum(t.bytes_sent for t in self.transfers(phase) if group is None or t.group == group)
        nbytes = self.step_bytes(phase)
        return sum(
            nbytes[(step.ring, step.kind)]
            for step in self.overlap(phase).steps()
            if group is None or step.ring == group
        )

    def traffic_units(self, phase: Phase) -> float:
        """The traffic formula of docs/ALGORITHMS.md in units of ``C`` (lse/delta left out).

        It counts every transfer at the input's element size; since partial outputs and gradients
        travel in fp32, ``traffic_units * C * itemsize`` equals the bytes sent (less the statistics)
        for fp32 inputs only — :meth:`bytes_sent` is exact for every dtype.

        forward ``2(a-1) + 2r(b-1)``; backward ``3(a-1) + 4r(b-1)`` with re-gather and
        ``2(a-1) + 2r(b-1)`` when the forward's chunks are reused.
        """
        a, b, r = self.tiling.a, self.tiling.b, self.shape.kv_ratio
        if phase == "forward" or self.backward == "reuse":
            return 2 * (a - 1) + 2 * r * (b - 1)
        return 3 * (a - 1) + 4 * r * (b - 1)

    def stats_bytes_sent(self, phase: Phase) -> int:
        """Bytes of lse/delta statistics one rank sends in ``phase`` (not in the formula)."""
        per_chunk = self.shape.stats_elems * self.shape.acc_itemsize
        a = self.tiling.a
        return (a - 1) * per_chunk * (1 if phase == "forward" else 2)


@functools.lru_cache(maxsize=256)
def make_plan(
    tiling: Tiling,
    shape: AttentionShape,
    *,
    causal: bool,
    layout: Layout,
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
    link_cost: tuple[float, float] = (1.0, 1.0),
    buffer_budget: int | None = None,
    mask: AttentionMask | None = None,
) -> AttentionPlan:
    """Cached :class:`AttentionPlan` constructor (plans are immutable and reused across layers)."""
    return AttentionPlan(
        tiling=tiling,
        shape=shape,
        causal=causal,
        layout=layout,
        backward=backward,
        schedule=schedule,
        link_cost=link_cost,
        buffer_budget=buffer_budget,
        mask=mask,
    )
