"""Packed documents as one kernel call per Q chunk: every document's keys are one window of the keys laid in global
order (pure Python).

Note [Documents in global order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the keys of a rank's KV chunks laid in global order (Note [Keys in global order] in
:mod:`mesh_cp.core.key_layout`), the keys a document's queries see in one half of a Q chunk are the document's positions
up to the half's end (causal) or all of them, among the positions the rank holds: one run of the layout. A zig-zag
half lies in one piece of global positions, so its queries of one document see that run, ending in their own half
(its causal square, bottom-right) when the rank holds the half's own keys, and wholly before them otherwise. Every
(document, Q half) pair is then one varlen sequence, and a Q chunk with all its blocks, masked or not, one call.

Two halves of one Q chunk may see the same keys (a document across both halves), which the backward of one varlen
call cannot take (two sequences writing the same ``dk`` rows): each half index reads its own section of the layout,
all the keys up to the last position of that half index in any Q chunk of the rank (for causal attention the first
halves see only first halves: the layout is about one and a half times the KV chunks, as for causal attention without
documents). The rows between sequences are read in place (``seqused_k``), so this runs on kernels that take
``segments`` and leave rows between them unread (:attr:`~mesh_cp.core.program.KernelMode.gaps`); a window (counted
in positions, which the layout skips) and split documents (whose parts are not one run) keep one call per block.
"""

from __future__ import annotations

from mesh_cp.core.layout import local_positions

Rows = tuple[int, int]
Unit = tuple[int, int, Rows]
"""``(start position, col, rows)``: rows of the KV chunk at ``col`` that hold consecutive global positions."""


def applies(plan, mode) -> bool:
    """Whether the plan's Q chunks run as one call each (Note [Documents in global order])."""
    mask = plan.mask
    return (
        mask is not None
        and mask.documents is not None
        and mask.window is None
        and mask.parts is None
        and mode.by_segments
        and mode.gaps
        and not mode.reference_softcap
    )


def document_calls(plan, rank: int, mode, slots: dict[int, int], cols: dict[int, int]) -> tuple[tuple, list[dict]]:
    """``(layout, specs)``: the layout's ``(col, rows)`` pieces and one call spec per Q chunk of ``rank`` that has a
    block (the keyword arguments of :class:`~mesh_cp.core.program.Call` but ``slot`` and the first writes)."""
    seq = plan.mesh_shape.seq_local
    seq_len, world = seq * plan.tiling.world, plan.tiling.world
    halves = ((0, seq // 2), (seq // 2, seq)) if plan.layout == "zigzag" else ((0, seq),)
    positions = {x: local_positions(seq_len, world, x, plan.layout) for x in slots}
    units = sorted(
        (local_positions(seq_len, world, y, plan.layout)[r0], col, (r0, r1))
        for y, col in cols.items()
        for r0, r1 in halves
    )
    sections, layout, at = [], [], 0
    for _, r1 in halves:
        last = max(positions[x][r1 - 1] for x in slots)
        section = []
        for start, col, rows in (u for u in units if u[0] <= last or not plan.causal):
            section.append((start, col, rows, at))
            layout.append((col, rows))
            at += rows[1] - rows[0]
        sections.append(section)
    ys = {col: y for y, col in cols.items()}
    todo = sorted({w.x for w in plan.blocks(rank)}, key=lambda x: slots[x])
    extra = {} if mode.softcap is None else {"softcap": mode.softcap}
    specs = [s for s in (_call(plan, x, positions[x], halves, sections, ys, extra) for x in todo) if s is not None]
    return _read_only(layout, specs)


def _read_only(layout: list, specs: list[dict]) -> tuple[tuple, list[dict]]:
    """The layout without the pieces no call's sequences read (keys of documents no query of the rank sees, first
    halves no second half needs), and the calls' rows in it: every sequence reads a run of pieces that stay, so its
    window stays one run; fewer rows are laid."""
    read = {s["keys"][0] + off for s in specs for _, _, _, off in s["pieces"]}
    kept, moves, old, new = [], [], 0, 0  # moves: (old start, size, new start) of every piece kept
    for col, (r0, r1) in layout:
        if old in read:
            kept.append((col, (r0, r1)))
            moves.append((old, r1 - r0, new))
            new += r1 - r0
        old += r1 - r0

    def moved(row: int) -> int:
        """The new row of layout row ``row`` (inside a kept piece, or at its end)."""
        off, _, to = next(m for m in moves if m[0] <= row <= m[0] + m[1])
        return to + row - off

    for spec in specs:
        v0, v1 = spec["keys"]
        n0 = moved(v0)
        spec["keys"] = (n0, moved(v1 - 1) + 1)
        spec["pieces"] = tuple((col, y, rows, moved(v0 + off) - n0) for col, y, rows, off in spec["pieces"])
        segments = spec["extra"]["segments"]
        spec["extra"] = {
            **spec["extra"],
            "segments": tuple(
                tuple(
                    (a, b, moved(v0 + k0) - n0, moved(v0 + k1 - 1) + 1 - n0, left, right)
                    for a, b, k0, k1, left, right in row
                )
                for row in segments
            ),
        }
    return tuple(kept), specs


def _call(plan, x: int, pos: list[int], halves, sections, ys: dict[int, int], extra: dict) -> dict | None:
    """The call of Q chunk ``x`` (local rows ``pos`` at global positions ``pos``): a varlen sequence per document and
    half, per batch row, over the layout's rows; ``None`` when no query sees a key."""
    mask, seq_len = plan.mask, plan.mesh_shape.seq_local * plan.tiling.world
    rows_per_batch, touched = [], set()
    for b in range(plan.shape.batch if mask.rows is None else mask.rows):
        segments = []
        for (r0, r1), section in zip(halves, sections, strict=True):
            p0, p1 = pos[r0], pos[r0] + (r1 - r0)
            for d0, d1 in mask.row_documents(b, seq_len):
                qa, qb = max(d0, p0), min(d1, p1)
                if qa >= qb:
                    continue
                window, used = _rows_of(section, d0, qb if plan.causal else d1)
                if window is None:
                    continue
                own = plan.causal and any(start == p0 for start, _, _, _ in section)
                segments.append((qa - p0 + r0, qb - p0 + r0, *window, -1, 0 if own else -1))
                touched |= used
        rows_per_batch.append(segments)
    if not touched:
        return None
    pieces = sorted(touched, key=lambda u: u[3])
    v0, v1 = pieces[0][3], pieces[-1][3] + pieces[-1][2][1] - pieces[-1][2][0]
    segs = tuple(
        tuple((a, b, k0 - v0, k1 - v0, left, right) for a, b, k0, k1, left, right in row) for row in rows_per_batch
    )
    return {
        "x": x,
        "q_rows": (halves[0][0], halves[-1][1]),
        "keys": (v0, v1),
        "laid": True,
        "pieces": tuple((col, ys[col], rows, off - v0) for _, col, rows, off in pieces),
        "causal": False,
        "reference": False,
        "extra": {**extra, "segments": segs},
        "mask": False,
    }


def _rows_of(section, lo: int, hi: int):
    """The layout rows of ``section`` holding positions in ``[lo, hi)`` (one run, as the section is in global order)
    and the units they touch; ``(None, set())`` for none."""
    first = last = None
    used = set()
    for unit in section:
        start, _, (r0, r1), off = unit
        a, b = max(lo, start), min(hi, start + r1 - r0)
        if a < b:
            first = off + a - start if first is None else first
            last = off + b - start
            used.add(unit)
    return (None, used) if first is None else ((first, last), used)
