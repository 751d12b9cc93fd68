"""The Mesh-Attention plan: who computes which block and who sends what to whom, as frozen data.

Pure Python (no torch): the executors run this plan, the communication counter checks what they sent
against it, and the simulator (:mod:`mesh_cp.sim`, also the peak-memory model) reads it. The tiling is
Note [Mesh tiling] in :mod:`mesh_cp.core.tiling`; the layouts are in :mod:`mesh_cp.core.layout`.
The blocks and Note [Zig-zag causal balance] are in :mod:`mesh_cp.core.blocks`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from mesh_cp.core.blocks import BlockWork, ChunkCall, MaskKind, block_work, chunk_calls
from mesh_cp.core.head_parallel import check_head_parallel, mesh_shape
from mesh_cp.core.masks import NO_MASK, AttentionMask, Tile, block_tiles, rectangle_pairs
from mesh_cp.core.options import Backward, Layout, Partials, Phase, Schedule, check_option, positive_or_none
from mesh_cp.core.schedule import OverlapSchedule, build_overlap_schedule
from mesh_cp.core.segments import block_segments, tile_segments
from mesh_cp.core.shape import AttentionShape
from mesh_cp.core.tiling import Tiling

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
    group: Literal["heads", "q", "kv"]
    op: Literal["all_gather", "all_to_all"]
    what: str
    group_size: int
    piece_bytes: int
    """Bytes of the piece one rank contributes per peer."""

    @property
    def bytes_sent(self) -> int:
        return (self.group_size - 1) * self.piece_bytes


@dataclass(frozen=True)
class AttentionPlan:
    """Everything one attention call does, as data: the head exchange, blocks, transfers, bytes and buffers.

    ``P = head_parallel * tiling.world`` CP ranks. With ``head_parallel = u > 1`` the call first exchanges heads
    inside groups of ``u`` ranks and the ``m = tiling.world`` ranks holding the same heads compute the blocks
    (Note [Head-parallel x mesh plan] in :mod:`mesh_cp.core.head_parallel`); ``u = 1`` has no exchange. Block
    methods (:meth:`blocks`, :meth:`block_at`, :meth:`overlap`) take a *mesh rank* (the CP rank ``// u``)."""

    tiling: Tiling
    """The ``a x b`` tiling of the ``m`` mesh ranks (``P`` ranks when ``head_parallel = 1``)."""
    shape: AttentionShape
    """Per-rank sizes of the call's inputs: ``S / P`` tokens, all heads."""
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
    head_parallel: int = 1
    """``u``: ranks per head group that exchange heads by all-to-all (1: none)."""
    return_lse: bool = False
    """The call returns the lse: with ``u > 1`` it travels back through the head exchange, and its gradient in when
    a loss reads it (``lse_grad`` of the byte methods; autograd hands none otherwise, and none is sent)."""
    partials: Partials = "accumulator"
    """The dtype the collective schedule sends row partials (``o``, ``dq``) to their owners in: ``"accumulator"``
    (fp32), or ``"input"`` where each is one kernel call's output in the input dtype (Note [Partials as computed] in
    :mod:`mesh_cp.core.row_partials`). The overlapped schedule's, merged along the ring, travel in fp32."""

    def __post_init__(self) -> None:
        check_option("layout", self.layout)
        check_option("backward", self.backward)
        check_option("schedule", self.schedule)
        check_option("partials", self.partials)
        check_head_parallel(self.world, self.head_parallel, self.shape)
        if self.layout == "zigzag" and self.shape.seq_local % 2:
            raise ValueError(
                f"seq_local {self.shape.seq_local} must be even for the zigzag layout "
                f"(global seq_len must be a multiple of 2*P = {2 * self.world}); pad the sequence"
            )
        if len(self.link_cost) != 2 or min(self.link_cost) <= 0:
            raise ValueError(f"link_cost must be two positive numbers (Q ring, KV ring), got {self.link_cost!r}")
        if self.mask is not None:
            self.mask.check(self.shape.batch, self.seq_len, self.causal)
        positive_or_none("buffer_budget", self.buffer_budget, unit="bytes")

    @property
    def world(self) -> int:
        """``P = u * m``, the ranks of the CP group."""
        return self.head_parallel * self.tiling.world

    @functools.cached_property
    def mesh_shape(self) -> AttentionShape:
        """Per-rank sizes the blocks are computed on: :attr:`shape` after the head exchange (``S / m`` tokens,
        ``H / u`` heads; :func:`~mesh_cp.core.head_parallel.mesh_shape`), :attr:`shape` itself for ``u = 1``."""
        return mesh_shape(self.head_parallel, self.shape)

    @property
    def seq_len(self) -> int:
        return self.shape.seq_local * self.world

    def blocks(self, rank: int) -> tuple[BlockWork, ...]:
        """Kernel calls of ``rank``, in execution order (its diagonal block first)."""
        work = [self._block(x, y) for x, y in self.tiling.blocks(rank)]
        todo = [w for w in work if w is not None]
        return tuple(sorted(todo, key=lambda w: (w.x, w.y) != (rank, rank)))

    def calls(self, rank: int) -> tuple[BlockWork | ChunkCall, ...]:
        """``rank``'s blocks as the collective schedule runs them: the unmasked blocks of a Q chunk as one call
        (Note [One call per Q chunk] in :mod:`mesh_cp.core.blocks`). Built once per plan and rank."""
        if rank not in self._calls:
            self._calls[rank] = chunk_calls(self.blocks(rank))
        return self._calls[rank]

    @functools.cached_property
    def _calls(self) -> dict[int, tuple[BlockWork | ChunkCall, ...]]:
        return {}

    def overlap_calls(self, rank: int, phase: Phase) -> dict[int, tuple[int, ChunkCall | None]]:
        """``rank``'s runs of compute actions of the overlapped schedule in ``phase`` that share a Q offset, by their
        first action: ``(end, call)``, ``call`` the :class:`ChunkCall` of a run of two or more unmasked blocks (Note
        [Rows of the overlapped schedule] in :mod:`mesh_cp.runtime.phases`), ``None`` where each block is its own
        call. Built once per plan, rank and phase; the executor and the memory model read the same."""
        if (rank, phase) not in self._overlap_calls:
            actions, runs, t = self.overlap(phase).actions, {}, 0
            while t < len(actions):
                end = t + 1
                if actions[t].op == "compute":
                    i = actions[t].block[0]
                    while end < len(actions) and actions[end].op == "compute" and actions[end].block[0] == i:
                        end += 1
                    blocks = tuple(w for a in actions[t:end] if (w := self.block_at(rank, *a.block)) is not None)
                    calls = chunk_calls(blocks) if len(blocks) > 1 else ()
                    runs[t] = (end, calls[0] if len(calls) == 1 and isinstance(calls[0], ChunkCall) else None)
                t = end
            self._overlap_calls[(rank, phase)] = runs
        return self._overlap_calls[(rank, phase)]

    @functools.cached_property
    def _overlap_calls(self) -> dict[tuple[int, str], dict[int, tuple[int, ChunkCall | None]]]:
        return {}

    def pairs(self, rank: int) -> int:
        """Query-key pairs ``rank`` computes (its share of the compute)."""
        return sum(w.pairs for w in self.blocks(rank))

    def transfers(self, phase: Phase) -> tuple[Transfer, ...]:
        """The collectives of the mesh in ``phase``, in issue order (the collective schedule's; the head exchange is
        :meth:`all_to_alls`); groups of size 1 move nothing."""
        s, a, b = self.mesh_shape, self.tiling.a, self.tiling.b
        item, acc = s.itemsize, s.acc_itemsize
        rows = s.chunk_elems * (item if self.partials == "input" else acc)  # a row partial, o or dq
        q_bytes, kv_bytes = self.chunk_bytes()
        stats_bytes = s.stats_elems * acc
        if phase == "forward":
            steps = [
                ("q", "all_gather", "q", a, q_bytes),
                ("kv", "all_gather", "k,v", b, kv_bytes),
                ("q", "all_to_all", "o,lse", a, rows + stats_bytes),
            ]
        elif phase == "backward":
            regather = self.backward == "regather"
            steps = [
                ("q", "all_gather", "q,do" if regather else "do", a, (2 if regather else 1) * q_bytes),
                ("q", "all_gather", "lse,delta", a, 2 * stats_bytes),
                *([("kv", "all_gather", "k,v", b, kv_bytes)] if regather else []),
                ("q", "all_to_all", "dq", a, rows),
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
        """Bytes of one Q chunk and of one KV chunk (K and V) of the mesh (:attr:`mesh_shape`), in the input dtype."""
        s = self.mesh_shape
        return s.chunk_elems * s.itemsize, 2 * s.batch * s.seq_local * s.kv_heads * s.head_dim * s.itemsize

    def step_bytes(self, phase: Phase) -> dict[tuple[str, str], int]:
        """Bytes one rank sends per step of the overlapped schedule, by ``(ring, "move" | "reduce")``."""
        s = self.mesh_shape
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
        return self._block(x, y)

    def tiles(self, w: BlockWork, *, runs: bool = False) -> tuple[Tile, ...]:
        """The kernel calls of block ``w`` cut into tiles (:func:`mesh_cp.core.masks.block_tiles`): a ``MASKED``
        block's, or any block's where the kernel cannot run it whole (softcapped logits). With ``runs`` the tiles
        are the block's runs of consecutive global positions, uncut (a kernel that takes ``segments``)."""
        size = 0 if runs else None
        return block_tiles(self.mask or NO_MASK, (w.x, w.q_rows), (w.y, w.kv_rows), **self._mask_options(), size=size)

    def block_segments(self, w: BlockWork) -> tuple | None:
        """The ``MASKED`` block ``w`` as the varlen sequences of one call, per batch row, or ``None`` where it takes
        more (:func:`mesh_cp.core.segments.block_segments`, Note [Block segments]). Built once per plan and block: every
        layer and phase asks, twice per call."""
        if w not in self._segments:
            mask = self.mask or NO_MASK
            self._segments[w] = block_segments(mask, (w.x, w.q_rows), (w.y, w.kv_rows), **self._mask_options())
        return self._segments[w]

    @functools.cached_property
    def _segments(self) -> dict[BlockWork, tuple | None]:
        return {}

    def tile_segments(self, w: BlockWork, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> tuple:
        """The ``"masked"`` tile ``(q_rows, kv_rows)`` of block ``w`` as flash-attn varlen sequences per batch row
        (:func:`mesh_cp.core.segments.tile_segments`)."""
        return tile_segments(self.mask or NO_MASK, (w.x, q_rows), (w.y, kv_rows), **self._mask_options())

    def _mask_options(self) -> dict:
        return {"seq_len": self.seq_len, "world": self.tiling.world, "layout": self.layout, "causal": self.causal}

    def _work_options(self) -> dict:
        return {"causal": self.causal, "layout": self.layout, "seq_local": self.mesh_shape.seq_local}

    def _block(self, x: int, y: int) -> BlockWork | None:
        """The kernel call of block ``(x, y)`` under the mask, counted once per plan (plans are cached by
        :func:`make_plan`, so once per call shape and mask, whatever the layers and phases that ask)."""
        if (x, y) not in self._blocks:
            self._blocks[(x, y)] = self._masked(block_work(x, y, **self._work_options()))
        return self._blocks[(x, y)]

    @functools.cached_property
    def _blocks(self) -> dict[tuple[int, int], BlockWork | None]:
        return {}

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

    def all_to_alls(self, phase: Phase, *, lse_grad: bool = True) -> tuple[Transfer, ...]:
        """The head exchange of ``phase`` in issue order (Note [Head-parallel x mesh plan]): all-to-alls over the head
        group, ``what`` the tensors each carries (Q, K and V in one, and dq, dk, dv in one: Note [One exchange per
        direction] in :mod:`mesh_cp.runtime.heads`) and ``piece_bytes`` the ``X / u`` sent to each peer (``X`` their
        bytes per rank in the head layout, a repeated K/V counted with its repeats). Empty for ``u = 1``.
        ``lse_grad``: a loss reads the returned lse, so its gradient travels in backward (``False``: it does not)."""
        check_option("phase", phase)
        u = self.head_parallel
        if u == 1:
            return ()
        s = self.mesh_shape
        q_bytes, kv_bytes = self.chunk_bytes()
        lse = [s.stats_elems * s.acc_itemsize] if self.return_lse else []
        if phase == "forward":
            moves = [("q,k,v", q_bytes + kv_bytes), ("out", q_bytes)]
            moves += [("lse", n) for n in lse]
        else:
            moves = [("dout", q_bytes), *(("dlse", n) for n in lse if lse_grad)]
            moves += [("dq,dk,dv", q_bytes + kv_bytes)]
        return tuple(
            Transfer(phase=phase, group="heads", op="all_to_all", what=what, group_size=u, piece_bytes=x // u)
            for what, x in moves
        )

    def bytes_sent(self, phase: Phase, group: str | None = None, *, lse_grad: bool = True) -> int:
        """Bytes one rank sends in ``phase``: all of them, or only within its head group (``"heads"``), its Q-group
        (``"q"``) or its KV-group (``"kv"``); ``lse_grad`` as in :meth:`all_to_alls`.

        Both schedules send the same bytes: a ring all-gather or reduce-scatter step moves what the
        bandwidth-optimal collective moves.
        """
        heads = sum(t.bytes_sent for t in self.all_to_alls(phase, lse_grad=lse_grad))
        if group == "heads":
            return heads
        if self.schedule == "collective":
            mesh = sum(t.bytes_sent for t in self.transfers(phase) if group is None or t.group == group)
        else:
            nbytes = self.step_bytes(phase)
            mesh = sum(
                nbytes[(step.ring, step.kind)]
                for step in self.overlap(phase).steps()
                if group is None or step.ring == group
            )
        return mesh + (heads if group is None else 0)

    def traffic_units(self, phase: Phase) -> float:
        """The traffic formula of docs/ALGORITHMS.md in units of ``C`` (lse/delta left out).

        It counts every transfer at the input's element size; since partial outputs and gradients
        travel in fp32 (but for the rows of :attr:`partials` ``"input"``), ``traffic_units * C * itemsize`` equals
        the bytes sent (less the statistics) for fp32 inputs only — :meth:`bytes_sent` is exact for every dtype.

        forward ``2(a-1) + 2r(b-1)``; backward ``3(a-1) + 4r(b-1)`` with re-gather and
        ``2(a-1) + 2r(b-1)`` when the forward's chunks are reused; ``r`` is the mesh's K/V ratio. With
        ``u > 1`` the head exchange adds ``(2 + 2r)(u - 1) / u`` (Note [Head-parallel x mesh plan]).
        """
        a, b, r, u = self.tiling.a, self.tiling.b, self.mesh_shape.kv_ratio, self.head_parallel
        heads = (2 + 2 * r) * (u - 1) / u
        if phase == "forward" or self.backward == "reuse":
            return heads + 2 * (a - 1) + 2 * r * (b - 1)
        return heads + 3 * (a - 1) + 4 * r * (b - 1)

    def stats_bytes_sent(self, phase: Phase, *, lse_grad: bool = True) -> int:
        """Bytes of lse/delta statistics one rank sends in ``phase`` (not in the formula): the mesh's, and the
        lse (forward) or its gradient (backward, when ``lse_grad``) in the head exchange when the call returns it."""
        per_chunk = self.mesh_shape.stats_elems * self.mesh_shape.acc_itemsize
        heads = sum(t.bytes_sent for t in self.all_to_alls(phase, lse_grad=lse_grad) if t.what in ("lse", "dlse"))
        return (self.tiling.a - 1) * per_chunk * (1 if phase == "forward" else 2) + heads


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
    head_parallel: int = 1,
    return_lse: bool = False,
    partials: Partials = "accumulator",
) -> AttentionPlan:
    """Cached :class:`AttentionPlan` constructor (plans are immutable and reused across layers and steps)."""
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
        head_parallel=head_parallel,
        return_lse=return_lse,
        partials=partials,
    )
