"""The overlapped schedule as data: a greedy lattice path of ring moves, cut into lockstep rounds.

Pure Python (no torch): the executor in :mod:`mesh_cp.runtime.executors` runs these rounds, the
plan counts their bytes and buffers, and the simulator times them.

Note [Overlapped schedule]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank ``g`` sits at position ``p`` of its Q ring (its Q-group, ``a`` ranks, sending to ``p + 1``) and
at position ``p'`` of its KV ring (its KV-group, ``b`` ranks). A *move* on a ring passes the chunk
received last to the next rank and receives one from the previous rank. After ``i`` Q moves and
``j`` KV moves the rank holds Q *offsets* ``0..i`` (offset ``i`` is the chunk that started at ring
position ``p - i``) and KV offsets ``0..j``; block ``(i', j')`` can be computed for every pair held.
All ``a * b`` blocks of the tile are reached by a lattice path from ``(0, 0)`` to ``(a-1, b-1)``::

    KV offset j ->         path Q Q KV KV (a = b = 3)      numbers: the round that computes a block
      Q  (0,0)-(0,1)-(0,2)     0  3  4
      |    |     |     |       1  3  4
      i  (1,0)-(1,1)-(1,2)     2  3  4
           |     |     |
         (2,0)-(2,1)-(2,2)

*Greedy order.* At ``(i, j)`` a Q move unlocks ``j + 1`` blocks for its transfer time ``t_q``, a KV
move unlocks ``i + 1`` blocks for ``t_kv``; take the move with the most blocks per unit of transfer
time (ties: the cheaper move, then Q), skipping moves after which the path could not finish within
the buffer budget. Every rank follows the same relative path, so every send has its receive.

*Actions.* The path becomes one list of actions that every rank runs in the same order. Each ring
keeps one move in flight: its next move is launched as soon as the previous one on that ring has
been waited for, so the Q ring and the KV ring (different links when the Q-group sits inside a
node) transfer side by side while blocks are computed. The path orders the waits: for every move in
path order, wait for it, launch what became ready, compute the blocks the move unlocked.
Results that belong to other ranks — partial ``(o, lse)`` of rows in forward, ``dq`` of rows and
``dk, dv`` of columns in backward — are reduced by a ring reduce-scatter riding along: reduce step
``s`` sends the partial of offset ``s + 1`` (already merged with what step ``s - 1`` brought) to the
next rank and receives the partial of offset ``s + 2``. It is launched right after the block that
completes offset ``s + 1`` on this rank, after waiting for step ``s - 1`` (whose partial it
carries). After ``n - 1`` steps the partial of offset 0 — the rank's own chunk — has visited every
member. Blocks unlocked by a KV move are computed in the order the reduce-scatter needs rows
(offsets 1, 2, ..., 0). A chunk is freed after the last action that computes with it or forwards
it (its send ends at the next move's wait); the buffer budget bounds the chunk bytes alive at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

Ring = Literal["q", "kv"]
RINGS: tuple[Ring, ...] = ("q", "kv")


@dataclass(frozen=True)
class RingStep:
    """One transfer on a ring: every member sends to the next member and receives from the previous."""

    ring: Ring
    kind: Literal["move", "reduce"]
    index: int
    """For a move, the offset it brings (``1..n-1``); for a reduce step, ``s`` (``0..n-2``)."""


@dataclass(frozen=True)
class Action:
    """``launch`` or ``wait`` a ring step, or ``compute`` block ``(q_offset, kv_offset)``."""

    op: Literal["launch", "wait", "compute"]
    step: RingStep | None = None
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class OverlapSchedule:
    """The actions of one phase of the overlapped schedule on an ``a x b`` tile."""

    a: int
    b: int
    path: tuple[Ring, ...]
    """Ring moves in order (the lattice path)."""
    actions: tuple[Action, ...]
    kv_present: bool
    """All KV offsets are held from the start (backward reusing the forward's chunks): no KV moves."""

    def ring_size(self, ring: Ring) -> int:
        return self.a if ring == "q" else self.b

    def steps(self) -> tuple[RingStep, ...]:
        return tuple(act.step for act in self.actions if act.op == "launch")

    def last_use(self, ring: Ring) -> dict[int, int]:
        """Offset -> index of the last action that needs that chunk: a block computed with it, or the
        wait that ends the move forwarding it."""
        last: dict[int, int] = {}
        for t, act in enumerate(self.actions):
            if act.op == "compute":
                last[act.block[0] if ring == "q" else act.block[1]] = t
        for offset, t in self.forwarded(ring).items():
            last[offset] = max(last.get(offset, -1), t)
        return last

    def forwarded(self, ring: Ring) -> dict[int, int]:
        """Offset -> index of the wait that ends the move forwarding that chunk to the next rank."""
        return {
            act.step.index - 1: t
            for t, act in enumerate(self.actions)
            if act.op == "wait" and act.step.ring == ring and act.step.kind == "move"
        }

    def arrival(self, ring: Ring) -> dict[int, int]:
        """Offset -> index of the action that allocates its receive buffer (``-1``: held from the start)."""
        held = range(self.ring_size(ring)) if ring == "kv" and self.kv_present else (0,)
        first = dict.fromkeys(held, -1)
        for t, act in enumerate(self.actions):
            if act.op == "launch" and act.step.ring == ring and act.step.kind == "move":
                first[act.step.index] = t
        return first

    def chunks_alive(self, last_use: dict[Ring, dict[int, int]] | None = None) -> list[tuple[int, int]]:
        """Per action, the number of Q chunks and KV chunks held (including buffers being received); ``last_use``
        per ring where a chunk is freed after another action than :meth:`last_use`'s."""
        n = max(len(self.actions), 1)
        counts = {}
        for ring in RINGS:
            last = (last_use or {}).get(ring) or self.last_use(ring)
            change = [0] * (n + 1)  # +1 where a chunk's span starts, -1 after it ends
            for offset, start in self.arrival(ring).items():
                change[max(start, 0)] += 1
                change[max(last.get(offset, start), start) + 1] -= 1
            running, counts[ring] = 0, []
            for t in range(n):
                running += change[t]
                counts[ring].append(running)
        return list(zip(counts["q"], counts["kv"], strict=True))

    def partials_alive(self, ring: Ring, *, sent_at: Literal["launch", "wait"]) -> list[int]:
        """Per action, the partial results (rows for ``"q"``, columns for ``"kv"``) held for reduction.

        A partial lives from its first block (or from landing from the previous rank) until it is
        sent on: until its reduce step is launched (``sent_at="launch"``, when a copy is sent) or
        waited for (``"wait"``, when the partial itself is sent). Offset 0 lives to the end.
        """
        n, count = self.ring_size(ring), max(len(self.actions), 1)
        steps = {}
        for t, act in enumerate(self.actions):
            if act.op in ("launch", "wait") and act.step.ring == ring and act.step.kind == "reduce":
                steps[(act.op, act.step.index)] = t
        if n > 1 and not steps:
            return [0] * count  # this ring's partials are not reduced in this phase
        start: dict[int, int] = {}
        for t, act in enumerate(self.actions):
            if act.op == "compute":
                start.setdefault(act.block[0] if ring == "q" else act.block[1], t)
        for s in range(n - 1):  # step s lands offset s + 2
            landed = (s + 2) % n
            start[landed] = min(start.get(landed, count), steps[("wait", s)])
        alive = [0] * count
        for offset, first in start.items():
            last = count - 1 if offset == 0 else steps[(sent_at, offset - 1)]
            for t in range(first, last + 1):
                alive[t] += 1
        return alive

    def peak_chunk_bytes(self, q_bytes: int, kv_bytes: int) -> int:
        return max(nq * q_bytes + nkv * kv_bytes for nq, nkv in self.chunks_alive())


class _ActionList:
    """Builds the actions of a lattice path (Note [Overlapped schedule]): launches, waits and computes."""

    def __init__(self, a: int, b: int, path: tuple[Ring, ...], reduce: tuple[Ring, ...], kv_present: bool) -> None:
        self.size = {"q": a, "kv": b}
        self.held = {"q": 1, "kv": b if kv_present else 1}
        self.reduce = reduce
        # Blocks each offset still needs before its partial is complete on this rank.
        self.remaining = {"q": dict.fromkeys(range(a), b), "kv": dict.fromkeys(range(b), a)}
        self.next_step = dict.fromkeys(reduce, 0)
        self.pending: set[Ring] = set()
        self.actions: list[Action] = []
        # Each ring's moves in order, numbered by the offset they bring. A ring's next move is launched as
        # soon as its previous one has been waited for, so the two rings (different links) run side by
        # side; the path orders the waits, and so the compute.
        self.queued = {
            ring: [RingStep(ring, "move", k) for k in range(1, self.size[ring]) if path.count(ring) >= k]
            for ring in RINGS
        }
        self.busy = dict.fromkeys(RINGS, False)

    def launch_reduces(self) -> None:
        """Launch each ring's next reduce step once its offset is complete, waiting for the previous
        step first (its partial is part of what this step sends)."""
        for ring in self.reduce:
            s = self.next_step[ring]
            if s < self.size[ring] - 1 and self.remaining[ring][s + 1] == 0:
                if ring in self.pending:
                    self.actions.append(Action("wait", RingStep(ring, "reduce", s - 1)))
                self.actions.append(Action("launch", RingStep(ring, "reduce", s)))
                self.pending.add(ring)
                self.next_step[ring] += 1

    def wait_reduces(self) -> None:
        for ring in self.reduce:
            if ring in self.pending:
                self.actions.append(Action("wait", RingStep(ring, "reduce", self.next_step[ring] - 1)))
                self.pending.discard(ring)

    def compute(self, blocks: list[tuple[int, int]]) -> None:
        for i, j in blocks:
            self.actions.append(Action("compute", block=(i, j)))
            self.remaining["q"][i] -= 1
            self.remaining["kv"][j] -= 1
            self.launch_reduces()

    def launch_moves(self) -> None:
        for ring in RINGS:
            if not self.busy[ring] and self.queued[ring]:
                self.actions.append(Action("launch", self.queued[ring].pop(0)))
                self.busy[ring] = True

    def wait_move(self, ring: Ring) -> None:
        """Wait for ``ring``'s move, launch what became ready, compute the blocks it unlocked (KV columns in
        the order the reduce-scatter needs rows: offsets 1, 2, ..., 0)."""
        held = self.held
        self.actions.append(Action("wait", RingStep(ring, "move", held[ring])))
        self.busy[ring] = False
        self.launch_reduces()
        self.launch_moves()
        new = held[ring]
        held[ring] += 1
        if ring == "q":
            self.compute([(new, j) for j in range(held["kv"])])
        else:
            self.compute([(i, new) for i in sorted(range(held["q"]), key=lambda i: (i == 0, i))])


def _actions(a: int, b: int, path: tuple[Ring, ...], reduce: tuple[Ring, ...], kv_present: bool) -> tuple[Action, ...]:
    build = _ActionList(a, b, path, reduce, kv_present)
    build.launch_moves()
    build.compute([(0, j) for j in range(build.held["kv"])])
    for ring in path:
        build.wait_move(ring)
    while build.pending:
        build.wait_reduces()
        build.launch_reduces()
    return tuple(build.actions)


@functools.lru_cache(maxsize=512)
def build_overlap_schedule(
    a: int,
    b: int,
    *,
    t_q: float,
    t_kv: float,
    reduce: tuple[Ring, ...],
    kv_present: bool = False,
    q_bytes: int = 0,
    kv_bytes: int = 0,
    budget: int | None = None,
) -> OverlapSchedule:
    """Greedy lattice path and its actions; see Note [Overlapped schedule].

    ``t_q``/``t_kv``: transfer time of one move on each ring (any unit). ``reduce``: the rings whose
    partial results are reduce-scattered. ``q_bytes``/``kv_bytes``: size of one chunk held, for the
    ``budget`` on the chunk bytes alive at once (``None``: no limit).
    """
    reduce = tuple(r for r in RINGS if r in reduce)
    left = {"q": a - 1, "kv": 0 if kv_present else b - 1}
    held = {"q": 1, "kv": b if kv_present else 1}
    path: list[Ring] = []

    def fits(candidate: tuple[Ring, ...]) -> bool:
        rest = {ring: left[ring] - candidate[len(path) :].count(ring) for ring in RINGS}
        finishes = (("q",) * rest["q"] + ("kv",) * rest["kv"], ("kv",) * rest["kv"] + ("q",) * rest["q"])
        return any(_peak(a, b, candidate + tail, kv_present, q_bytes, kv_bytes) <= budget for tail in finishes)

    while left["q"] or left["kv"]:
        options = []
        if left["q"]:
            options.append((held["kv"] / t_q if t_q else float("inf"), -t_q, 1, "q"))
        if left["kv"]:
            options.append((held["q"] / t_kv if t_kv else float("inf"), -t_kv, 0, "kv"))
        ring = next(
            (ring for *_, ring in sorted(options, reverse=True) if budget is None or fits((*path, ring))),
            None,
        )
        if ring is None:
            raise ValueError(
                f"buffer budget {budget} bytes is too small for the {a}x{b} tile: the overlapped schedule "
                f"needs at least {minimum_budget(a, b, kv_present, q_bytes, kv_bytes)} bytes of chunk buffers; "
                f"raise the budget or use a tile with smaller groups"
            )
        path.append(ring)
        left[ring] -= 1
        held[ring] += 1
    return OverlapSchedule(
        a=a, b=b, path=tuple(path), actions=_actions(a, b, tuple(path), reduce, kv_present), kv_present=kv_present
    )


def _peak(a: int, b: int, path: tuple[Ring, ...], kv_present: bool, q_bytes: int, kv_bytes: int) -> int:
    actions = _actions(a, b, path, (), kv_present)
    return OverlapSchedule(a=a, b=b, path=path, actions=actions, kv_present=kv_present).peak_chunk_bytes(
        q_bytes, kv_bytes
    )


def minimum_budget(a: int, b: int, kv_present: bool, q_bytes: int, kv_bytes: int) -> int:
    """Least chunk-buffer bytes of any path: all moves of one ring first, then the other streams."""
    q_moves, kv_moves = ("q",) * (a - 1), ("kv",) * (0 if kv_present else b - 1)
    return min(_peak(a, b, path, kv_present, q_bytes, kv_bytes) for path in (q_moves + kv_moves, kv_moves + q_moves))
