"""The Mesh-Attention plan: who computes which block and who sends what to whom, as frozen data.

Pure Python (no torch): the executor runs this plan, the communication counter checks what the
executor sent against it, and the simulator reads it.

Note [Mesh tiling]
~~~~~~~~~~~~~~~~~~
The sequence is cut into ``P`` chunks; rank ``g`` starts with chunk ``g`` of Q, K and V. Block
``(x, y)`` is Q chunk ``x`` attending to KV chunk ``y``. The ``P x P`` block matrix is covered by
``P`` tiles of ``a x b`` blocks (``a * b = P``)::

    owner(x, y) = (x // a) * a + (y % a)
    Qgroup(g)   = {(g // a) * a + i : i < a}     rows rank g computes (a consecutive ranks)
    KVgroup(g)  = {(g % a) + j * a : j < b}      columns rank g computes

    P = 4, tile 2 x 2 (entries are owners)      P = 4, tile 1 x 4 (ring)
            y=0 y=1 y=2 y=3                           y=0 y=1 y=2 y=3
      x=0 [  0   1   0   1 ]                    x=0 [  0   0   0   0 ]
      x=1 [  0   1   0   1 ]                    x=1 [  1   1   1   1 ]
      x=2 [  2   3   2   3 ]                    x=2 [  2   2   2   2 ]
      x=3 [  2   3   2   3 ]                    x=3 [  3   3   3   3 ]

Rank ``g`` computes exactly ``Qgroup(g) x KVgroup(g)``: it gathers the ``a`` Q chunks of its
Q-group and the ``b`` KV chunks of its KV-group, and owns its own diagonal block ``(g, g)``.
``a = 1`` is Ring-Attention, ``a = P`` passes Q around instead of KV, ``a = b`` is the square tile
(ATTENTION2D). Partial outputs of a row are merged with their log-sum-exp and reduced to the rank
that owns the row's chunk; in backward ``dq`` is summed over the Q-group and ``dk, dv`` over the
KV-group.

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
import functools
import re
from dataclasses import dataclass
from typing import Literal

from mesh_cp.core.schedule import OverlapSchedule, build_overlap_schedule

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
Phase = Literal["forward", "backward"]
BackwardMode = Literal["regather", "reuse"]
BACKWARD_MODES: tuple[str, ...] = ("regather", "reuse")
SCHEDULE_NAMES: tuple[str, ...] = ("overlap", "collective")


def factorizations(world: int) -> tuple[tuple[int, int], ...]:
    """Every tile ``(a, b)`` with ``a * b == world``, ``a`` ascending (``(1, world)`` is the ring)."""
    return tuple((a, world // a) for a in range(1, world + 1) if world % a == 0)


def most_square_tile(world: int) -> tuple[int, int]:
    """The tile of ``world`` with ``|a - b|`` smallest; on a tie the larger ``a`` (8 -> 4x2), which
    sends less for MHA since ``a`` weighs ``2(a-1)`` and ``b`` weighs ``2r(b-1)`` forward and
    ``3(a-1)`` against ``4r(b-1)`` backward."""
    return min(factorizations(world), key=lambda ab: (abs(ab[0] - ab[1]), -ab[0]))


@dataclass(frozen=True)
class Tiling:
    """The ``a x b`` tiling of a CP group of ``world = a * b`` ranks. See Note [Mesh tiling]."""

    world: int
    """Number of ranks ``P`` in the context-parallel group."""
    a: int
    """Q chunks per tile (size of a Q-group); ``a = 1`` is Ring-Attention."""
    b: int
    """KV chunks per tile (size of a KV-group)."""

    def __post_init__(self) -> None:
        for name in ("world", "a", "b"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Tiling.{name} must be a positive int, got {value!r}")
        if self.a * self.b != self.world:
            options = ", ".join(f"{a}x{b}" for a, b in factorizations(self.world))
            raise ValueError(
                f"tile {self.a}x{self.b} does not factor the CP group size {self.world} "
                f"({self.a}*{self.b}={self.a * self.b}); choose one of: {options}"
            )

    @classmethod
    def parse(cls, tile: object, world: int) -> Tiling:
        """Build from ``(a, b)`` or ``"axb"``; the error lists the valid tiles of ``world``."""
        if isinstance(tile, str):
            match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", tile)
            if match is None:
                raise ValueError(f"tile {tile!r} is not of the form 'AxB' (for example '2x2')")
            a, b = int(match.group(1)), int(match.group(2))
        elif isinstance(tile, (tuple, list)) and len(tile) == 2:
            a, b = tile
        else:
            options = ", ".join(f"({a}, {b})" for a, b in factorizations(world))
            raise ValueError(f"tile must be a pair (a, b) with a*b = {world}, got {tile!r}; choose one of: {options}")
        return cls(world=world, a=a, b=b)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.a, self.b)

    def owner(self, x: int, y: int) -> int:
        """Rank that computes block ``(x, y)``."""
        return (x // self.a) * self.a + (y % self.a)

    def q_group(self, rank: int) -> tuple[int, ...]:
        """The ``a`` ranks (= Q chunks) of ``rank``'s Q-group, in group-rank order."""
        start = (rank // self.a) * self.a
        return tuple(range(start, start + self.a))

    def kv_group(self, rank: int) -> tuple[int, ...]:
        """The ``b`` ranks (= KV chunks) of ``rank``'s KV-group, in group-rank order."""
        return tuple(rank % self.a + j * self.a for j in range(self.b))

    def q_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.q_group(i * self.a) for i in range(self.b))

    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.kv_group(i) for i in range(self.a))

    def blocks(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Blocks ``(x, y)`` computed by ``rank``: its Q-group rows times its KV-group columns."""
        return tuple((x, y) for x in self.q_group(rank) for y in self.kv_group(rank))

    def __str__(self) -> str:
        return f"{self.a}x{self.b}"


# ----------------------------------------------------------------------------------------------
# Sequence layouts


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not supported; choose one of {sorted(LAYOUTS)}")


def check_seq_len(seq_len: int, world: int, layout: str) -> None:
    """Raise ``ValueError`` unless a global ``seq_len`` can be laid out over ``world`` ranks."""
    check_layout(layout)
    parts = 2 * world if layout == "zigzag" else world
    if seq_len < parts or seq_len % parts:
        padded = max(parts, -(-seq_len // parts) * parts)
        raise ValueError(
            f"seq_len {seq_len} must be a positive multiple of {parts} "
            f"({'2*P' if layout == 'zigzag' else 'P'} for the {layout} layout with P={world}); "
            f"pad the sequence to {padded}"
        )


def chunk_ranges(seq_len: int, world: int, rank: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Global token ranges ``[start, stop)`` held by ``rank``, in local order.

    ``contiguous``: one range, chunk ``rank``. ``zigzag``: half-chunks ``rank`` and
    ``2P-1-rank`` (see Note [Zig-zag causal balance]).
    """
    check_seq_len(seq_len, world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the CP group of size {world}")
    if layout == "contiguous":
        size = seq_len // world
        return ((rank * size, (rank + 1) * size),)
    half = seq_len // (2 * world)
    second = 2 * world - 1 - rank
    return ((rank * half, (rank + 1) * half), (second * half, (second + 1) * half))


def local_positions(seq_len: int, world: int, rank: int, layout: str) -> list[int]:
    """Global positions of the tokens ``rank`` holds, in local order."""
    return [p for start, stop in chunk_ranges(seq_len, world, rank, layout) for p in range(start, stop)]


def layout_permutation(seq_len: int, world: int, layout: str) -> list[int]:
    """Global positions in the order of the concatenated local shards of ranks ``0..P-1``."""
    return [p for rank in range(world) for p in local_positions(seq_len, world, rank, layout)]


# ----------------------------------------------------------------------------------------------
# Blocks


class MaskKind(enum.Enum):
    """What part of block ``(x, y)`` is computed; see Note [Zig-zag causal balance]."""

    FULL = "full"
    CAUSAL = "causal"
    KV_FIRST_HALF = "kv_first_half"
    Q_SECOND_HALF = "q_second_half"
    SKIP = "skip"


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

    @property
    def causal(self) -> bool:
        return self.kind is MaskKind.CAUSAL

    @property
    def pairs(self) -> int:
        """Query-key pairs computed (the block's compute cost)."""
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
    layout: str
    backward: str = "regather"
    """``"regather"`` gathers Q and KV again in backward (less memory); ``"reuse"`` keeps the
    chunks gathered in forward (less traffic)."""
    schedule: str = "overlap"
    """``"overlap"``: p2p rings with compute overlapped (Note [Overlapped schedule]);
    ``"collective"``: all-gather, compute, all-to-all."""
    link_cost: tuple[float, float] = (1.0, 1.0)
    """Relative seconds per byte on the Q ring and on the KV ring; orders the overlapped schedule's moves."""
    buffer_budget: int | None = None
    """Most bytes of gathered Q/KV chunks the overlapped schedule may hold at once (``None``: no limit)."""

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"backward {self.backward!r} is not supported; choose one of {sorted(BACKWARD_MODES)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {sorted(SCHEDULE_NAMES)}")
        if self.layout == "zigzag" and self.shape.seq_local % 2:
            raise ValueError(
                f"seq_local {self.shape.seq_local} must be even for the zigzag layout "
                f"(global seq_len must be a multiple of 2*P = {2 * self.tiling.world}); pad the sequence"
            )
        if len(self.link_cost) != 2 or min(self.link_cost) <= 0:
            raise ValueError(f"link_cost must be two positive numbers (Q ring, KV ring), got {self.link_cost!r}")
        if self.buffer_budget is not None and self.buffer_budget < 1:
            raise ValueError(f"buffer_budget must be a positive number of bytes or None, got {self.buffer_budget!r}")

    @property
    def seq_len(self) -> int:
        return self.shape.seq_local * self.tiling.world

    def blocks(self, rank: int) -> tuple[BlockWork, ...]:
        """Kernel calls of ``rank``, in execution order (its diagonal block first)."""
        work = [
            block_work(x, y, causal=self.causal, layout=self.layout, seq_local=self.shape.seq_local)
            for x, y in self.tiling.blocks(rank)
        ]
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
            raise ValueError(f"phase {phase!r} must be 'forward' or 'backward'")
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
        if phase != "backward":
            raise ValueError(f"phase {phase!r} must be 'forward' or 'backward'")
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

    def peak_bytes(self, phase: Phase, rank: int = 0) -> int:
        """Bytes one rank allocates at the peak of ``phase``, beyond its inputs and saved tensors.

        Counts what the schedule holds — gathered Q/KV chunks (all of them for ``backward="reuse"``,
        which keeps them from forward to backward), fp32 accumulators of partial outputs and
        gradients, transfer buffers — plus one block's kernel outputs and temporaries. The
        overlapped schedule frees a chunk after its last use, so its peak follows its path; the
        collective schedule holds every gathered chunk and the reduce buffers together.
        """
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase {phase!r} must be 'forward' or 'backward'")
        if self.schedule == "collective":
            return self._collective_peak(phase, rank)
        return self._overlap_peak(phase, rank)

    def block_at(self, rank: int, q_offset: int, kv_offset: int) -> BlockWork | None:
        """The kernel call of ``rank``'s block at ring offsets ``(q_offset, kv_offset)`` of the
        overlapped schedule (offset ``i`` is the chunk that started ``i`` ring positions before
        ``rank``), or ``None`` when the mask leaves nothing to compute."""
        t = self.tiling
        q_members, kv_members = t.q_group(rank), t.kv_group(rank)
        x = q_members[(q_members.index(rank) - q_offset) % t.a]
        y = kv_members[(kv_members.index(rank) - kv_offset) % t.b]
        return block_work(x, y, causal=self.causal, layout=self.layout, seq_local=self.shape.seq_local)

    def _kernel_bytes(self, w: BlockWork | None, phase: Phase) -> int:
        """Outputs and temporaries of one block's kernel call (calibrated on the CPU flash kernel):
        forward its output and the merge's weighted copy; backward dq, dk, dv and the kernel's own
        out; GQA adds the K, V repeated to every head."""
        if w is None:
            return 0
        s = self.shape
        q_bytes = s.chunk_elems * s.itemsize
        rq = (w.q_rows[1] - w.q_rows[0]) / s.seq_local
        rk = (w.kv_rows[1] - w.kv_rows[0]) / s.seq_local
        gqa = rk if s.kv_heads != s.heads else 0.0
        if phase == "forward":
            return int(rq * (q_bytes + s.chunk_elems * s.acc_itemsize) + gqa * q_bytes // 2)
        return int((2 * rq + 2 * rk + 1.5 * gqa) * q_bytes)

    def _units(self) -> dict[str, int]:
        s = self.shape
        q_bytes, kv_bytes = self.chunk_bytes()
        acc = s.chunk_elems * s.acc_itemsize
        return {
            "q": q_bytes,
            "kv": kv_bytes,
            "acc": acc,
            "kv_acc": kv_bytes // s.itemsize * s.acc_itemsize,
            "stats": s.stats_elems * s.acc_itemsize,
        }

    def _collective_peak(self, phase: Phase, rank: int) -> int:
        u, a, b = self._units(), self.tiling.a, self.tiling.b
        kernel = max(self._kernel_bytes(w, phase) for w in self.blocks(rank))
        if phase == "forward":
            rows = a * (u["acc"] + u["stats"])
            gathered = a * u["q"] + b * u["kv"]
            # gloo stages an all-gather through a flat copy of its output (NCCL gathers in place)
            stages = [
                a * u["q"] * (2 if a > 1 else 1),  # the all-gather of Q
                gathered + u["kv"] + (b * u["kv"] if b > 1 else 0),  # the all-gather of the stacked K, V
                gathered + rows + kernel,  # block compute
                gathered + 3 * rows + u["acc"] + u["stats"] if a > 1 else 0,  # packed, received, merged row
            ]
            return max(stages)
        regather = self.backward == "regather"
        gathered = (a * 2 * u["q"] + b * u["kv"]) if regather else a * u["q"]
        stats = (2 * a + 3) * u["stats"]
        grads = 2 * (a * u["acc"] + b * u["kv_acc"]) + u["acc"] + u["kv_acc"]
        return gathered + stats + max(grads, a * u["acc"] + b * u["kv_acc"] + kernel)

    def _overlap_peak(self, phase: Phase, rank: int) -> int:
        u, a, b = self._units(), self.tiling.a, self.tiling.b
        sched = self.overlap(phase)
        keep = self.backward == "reuse"
        if phase == "forward":
            # Partial rows are packed into a copy when sent: the copy and the receive buffer are in flight.
            partial = {"q": u["acc"] + u["stats"]}
            alive = {"q": sched.partials_alive("q", sent_at="launch")}
            inflight_bytes = {"q": 2 * (u["acc"] + u["stats"])}
            fixed = 0
            q_unit, kv_unit, q0_input = u["q"], u["kv"], not keep
            if keep:  # the chunk stores are allocated whole
                fixed += a * u["q"] + b * u["kv"]
                q_unit = kv_unit = 0
        else:
            # Partial gradients are sent as they are: only the receive buffer is extra while in flight.
            partial = {"q": u["acc"], "kv": u["kv_acc"]}
            alive = {ring: sched.partials_alive(ring, sent_at="wait") for ring in partial}
            inflight_bytes = dict(partial)
            fixed = u["stats"]  # delta
            q_unit = (u["q"] if keep else 2 * u["q"]) + 2 * u["stats"]  # (dO) or (q, dO), with lse and delta
            kv_unit, q0_input = (0, True) if keep else (u["kv"], False)  # reuse: offset 0's dO is the input
        last_q = sched.last_use("q")
        inflight: dict[str, int] = {}
        peak = 0
        for t, (act, (nq, nkv)) in enumerate(zip(sched.actions, sched.chunks_alive(), strict=True)):
            if act.op == "launch" and act.step.kind == "reduce":
                inflight[act.step.ring] = inflight_bytes[act.step.ring]
            held = nq * q_unit + nkv * kv_unit - (u["q"] if q0_input and last_q.get(0, -1) >= t else 0)
            partials = sum(alive[ring][t] * partial[ring] for ring in partial)
            kernel = self._kernel_bytes(self.block_at(rank, *act.block), phase) if act.op == "compute" else 0
            now = fixed + held + partials + sum(inflight.values()) + kernel
            peak = max(peak, now)
            if act.op == "wait" and act.step.kind == "reduce":
                inflight.pop(act.step.ring, None)
        return peak

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
        """The traffic formula of ALGORITHMS.md in units of ``C`` (lse/delta left out).

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
    layout: str,
    backward: str = "regather",
    schedule: str = "overlap",
    link_cost: tuple[float, float] = (1.0, 1.0),
    buffer_budget: int | None = None,
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
    )
