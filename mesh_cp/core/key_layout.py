"""The layout of a phase's keys: the KV chunks' rows laid end to end once, in sections that every row group of the
phase's calls reads one run of (pure Python).

Note [Keys in global order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The unmasked blocks of a Q chunk are one call over their keys (Note [One call per Q chunk] in
:mod:`mesh_cp.core.blocks`). A row group of such a call sees keys in global order up to its own position: laid in
global order, its keys are one run ending in its causal half. In a zig-zag chunk ``x`` the first half sees the first
halves of the earlier chunks and its own (causally); the second half sees every first half, the second halves of the
later chunks (earlier in global order) and its own (causally). With the KV chunks' halves laid once in global order
(first halves by chunk, then second halves by chunk in reverse), each group reads one view, its causal half last.

A kernel that takes neither ``segments`` nor more than one causal diagonal runs a group as two calls on views: its
keys before the causal half, then the causal half's square. A kernel that takes ``segments`` runs the chunk as one
varlen call, whose sequences' keys must not overlap in its backward (two sequences writing the same ``dk`` rows): a
kernel whose varlen sequences may leave gaps between them (``seqused_k``, :attr:`KernelMode.gaps`) reads them from one
section of the layout per group index (the first halves laid twice), and one that needs them adjacent takes laid
segments over the single layout (Note [Laid keys] in :mod:`mesh_cp.kernels.varlen`; it gathers their rows). A group
whose keys are not one run of a section (a mask left some blocks out) gets a section of its own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from mesh_cp.core.blocks import ChunkCall
from mesh_cp.core.consecutive import consecutive_order
from mesh_cp.core.layout import local_positions

if TYPE_CHECKING:
    from mesh_cp.core.program import KernelMode

Rows = tuple[int, int]

Unit = tuple[int, Rows]
"""``(y, rows)``: rows of KV chunk ``y`` that are consecutive in global order (a zig-zag half, a contiguous chunk)."""


def windows(plan, c: ChunkCall) -> list[tuple[list[Unit], int]]:
    """The keys of each row group of ``c`` as units in global order, and how many of the last ones are its causal
    diagonal (the group's own rows of the chunk: none, one zig-zag half, or two where the halves meet)."""
    seq = plan.mesh_shape.seq_local
    grid = (0, seq // 2, seq) if plan.layout == "zigzag" else (0, seq)

    def cut(pieces) -> list[Unit]:
        return [
            (y, (max(k0, a), min(k1, b)))
            for y, (k0, k1) in pieces
            for a, b in zip(grid, grid[1:], strict=False)
            if max(k0, a) < min(k1, b)
        ]

    out = []
    for g in c.groups:
        units = sorted(cut(g.keys), key=lambda u: start(plan, u))
        diagonal = [u for u in cut(g.keys[-1:]) if g.q_rows[0] <= u[1][0] < g.q_rows[1]] if g.causal_tail else []
        tail = len(diagonal)
        if tail and units[-tail:] != sorted(diagonal, key=lambda u: start(plan, u)):
            raise AssertionError(f"the causal diagonal of chunk {c.x} is not the last of its keys: {units}")
        out.append((units, tail))
    return out


def start(plan, unit: Unit) -> int:
    y, (k0, _) = unit
    seq = plan.mesh_shape.seq_local
    return _positions(seq * plan.tiling.world, plan.tiling.world, y, plan.layout)[k0]


@functools.lru_cache(maxsize=1024)
def _positions(seq_len: int, world: int, chunk: int, layout: str) -> tuple[int, ...]:
    return tuple(local_positions(seq_len, world, chunk, layout))


class KeyLayout:
    """The sections of a phase's layout and where every row group's keys are in it (Note [Keys in global order]): the
    units of a section in global order where every group reads one run of them, else in an order where they do
    (Note [Consecutive sets] in :mod:`mesh_cp.core.consecutive`)."""

    def __init__(self, plan, cols: dict[int, int], calls: list[list[tuple[list[Unit], int]]], mode: KernelMode):
        """``calls``: every chunk call's :func:`windows`, in the order :attr:`placed` gives them back."""
        self.cols = cols
        per_group = mode.by_segments and mode.gaps
        apart: set[int] = set()
        while True:  # a call whose group is not one run of its section gets sections of its own
            sections = {s: _section(plan, groups) for s, groups in _shared(calls, apart, per_group).items()}
            bad = {
                c
                for c, call in enumerate(calls)
                if c not in apart
                and any(_run_of(group, sections[g if per_group else 0]) is None for g, group in enumerate(call))
            }
            if not bad:
                break
            apart |= bad
        order = [sections[s] for s in sorted(sections)]
        where = {}
        for c in sorted(apart):
            for g, (units, _) in enumerate(calls[c]):
                where[(c, g)] = len(order)
                order.append(units)
        starts, at = [], 0
        for section in order:
            starts.append(at)
            at += sum(k1 - k0 for _, (k0, k1) in section)
        self.laid = tuple((cols[y], rows) for section in order for y, rows in section)
        self.pieces = with_positions(self.laid)
        self.placed = []
        for c, call in enumerate(calls):
            placed = []
            for g, (units, tail) in enumerate(call):
                s = where.get((c, g), g if per_group else 0)
                first = _run_of((units, tail), order[s])
                offset = starts[s] + sum(k1 - k0 for _, (k0, k1) in order[s][:first])
                placed.append((self._pieces(order[s][first : first + len(units)], offset), tail))
            self.placed.append(placed)

    def _pieces(self, units: list[Unit], offset: int) -> list[tuple[int, int, Rows, int]]:
        out = []
        for y, (k0, k1) in units:
            out.append((self.cols[y], y, (k0, k1), offset))
            offset += k1 - k0
        return out


def _shared(calls, apart: set[int], per_group: bool) -> dict[int, list[tuple[list[Unit], int]]]:
    """The groups of every section shared by the calls not in ``apart``: one section, or one per group index."""
    shared: dict[int, list[tuple[list[Unit], int]]] = {}
    for c, call in enumerate(calls):
        for g, group in enumerate(call):
            if c not in apart:
                shared.setdefault(g if per_group else 0, []).append(group)
    return shared


def _section(plan, groups: list[tuple[list[Unit], int]]) -> list[Unit]:
    """The units of ``groups`` in global order, or in an order where every group's keys are one run."""
    units = sorted({u for group, _ in groups for u in group}, key=lambda u: start(plan, u))
    last = {i: tuple(group[-tail:]) for i, (group, tail) in enumerate(groups) if tail}
    return consecutive_order(units, [frozenset(group) for group, _ in groups], last) or units


def _run_of(group: tuple[list[Unit], int], section: list[Unit]) -> int | None:
    """Where the units of ``group`` are one run of ``section`` (``None``: they are not); a group that ends in its
    causal diagonal needs the diagonal last, in order (the kernel aligns a causal square bottom-right)."""
    units, tail = group
    if not units or any(u not in section for u in units):
        return None
    at = sorted(section.index(u) for u in units)
    if at[-1] - at[0] + 1 != len(units) or (tail and section[at[-1] + 1 - tail : at[-1] + 1] != units[-tail:]):
        return None
    return at[0]


def with_positions(layout) -> list[tuple[int, int, int, int]]:
    """The pieces of ``layout`` as ``(col, k0, k1, at)``, ``at`` their first row in it."""
    out, at = [], 0
    for col, (k0, k1) in layout:
        out.append((col, k0, k1, at))
        at += k1 - k0
    return out


def merged_runs(pieces) -> tuple[tuple[int, int, int, int], ...]:
    """Pieces ``(col, k0, k1, at)`` in order, those that continue the one before in the chunk and the layout as one."""
    out: list[tuple[int, int, int, int]] = []
    for col, k0, k1, at in pieces:
        if out and out[-1][0] == col and out[-1][2] == k0 and out[-1][3] + out[-1][2] - out[-1][1] == at:
            out[-1] = (col, out[-1][1], k1, out[-1][3])
        else:
            out.append((col, k0, k1, at))
    return tuple(out)
