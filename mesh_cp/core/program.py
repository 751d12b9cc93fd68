"""A rank's kernel calls as data: which calls run, over which Q rows and key rows, into which accumulators (pure
Python).

Note [Rank programs]
~~~~~~~~~~~~~~~~~~~~
A :class:`Program` holds what one rank runs in one phase between its transfers, built once per plan, rank, schedule
step and kernel (:class:`KernelMode`, what the kernel takes), and read by the executors (which replay it), the memory
model and the per-rank benchmark:

- :attr:`Program.layout`: the key pieces laid end to end once per phase, in global order (Note [Keys in global
  order]); a call over several KV chunks reads a view of it;
- :attr:`Program.calls`: every kernel call, in order: its Q slot and rows, its keys (a view of the layout, or of one
  KV chunk), how the kernel masks them (``causal``, ``segments``, a dense ``mask``, the reference kernel), and whether
  its writes into the Q-row and key-row accumulators are first writes (Note [First writes] in
  :mod:`mesh_cp.core.blocks`).

Note [Keys laid once per phase]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The overlapped schedule runs a Q move's blocks with every KV chunk held as one call (Note [Rows of the overlapped
schedule] in :mod:`mesh_cp.runtime.phases`), and a rank makes such a call for every Q chunk but its own, each over
the KV chunks held then. One layout serves them all (:class:`OverlapPrograms`): its sections hold the units every
call's groups read, each group one run of them. A run lays the rows no earlier run laid, into their place, before its
calls (:attr:`Program.lays`), so every key row is copied once per section in the phase, and the layout is dropped
after the last run that reads it. A KV chunk that no call reads but through the layout is then freed once it is laid
and forwarded (:attr:`OverlapPrograms.kv_last_use`), not held to the last Q move: the layout replaces the held chunks
rather than adding to them.

The calls of different runs read different sets of chunks (the chunks held grow as KV moves arrive, and a Q chunk sees
the first halves of earlier chunks only), so global order does not make every group one run: the units of a section are
ordered so that it does (Note [Consecutive sets] in :mod:`mesh_cp.core.consecutive`). The keys a group sees whole may
come in any order; only a causal diagonal must be the last of its group's keys (the kernel aligns it bottom-right),
which the order keeps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from mesh_cp.core import document_calls
from mesh_cp.core.blocks import BlockWork, ChunkCall, MaskKind, first_writes, unwritten
from mesh_cp.core.key_layout import KeyLayout, merged_runs, windows, with_positions

Rows = tuple[int, int]


@dataclass(frozen=True)
class KernelMode:
    """What the kernel takes, as far as the calls depend on it."""

    keywords: frozenset[str]
    """Its optional keywords (``"mask"``, ``"segments"``, ``"softcap"``)."""
    softcap: float | None = None
    """The call's logit softcap."""
    gaps: bool = False
    """Its varlen sequences may leave key rows between them unread (``seqused_k``): no gather for such segments."""

    @property
    def by_segments(self) -> bool:
        """A chunk call is one varlen call and a masked block one call of its documents (a kernel that also takes
        dense masks builds them instead)."""
        return "segments" in self.keywords and "mask" not in self.keywords

    @property
    def reference_softcap(self) -> bool:
        """Softcapped logits the kernel cannot take: every block goes tile by tile to the reference kernel."""
        return self.softcap is not None and "softcap" not in self.keywords


@dataclass(frozen=True, eq=False)
class Call:
    """One kernel call of a program (Note [Rank programs])."""

    slot: int
    """Position of its Q chunk among the chunks the phase holds (gathered position or ring offset)."""
    x: int
    """Its Q chunk."""
    q_rows: Rows
    keys: Rows
    """Rows of its key source: the layout when :attr:`laid`, else KV chunk ``pieces[0][0]``."""
    laid: bool
    pieces: tuple[tuple[int, int, Rows, int], ...]
    """``(col, y, kv_rows, at)``: rows ``kv_rows`` of KV chunk ``y`` (at position ``col``) are its key rows from
    ``at`` on; its ``dk, dv`` there belong to them (rows of its keys in no piece are in no sequence)."""
    causal: bool
    reference: bool
    """It goes to the reference kernel (softcapped logits, or a masked tile the kernel cannot take)."""
    extra: dict = field(hash=False)
    """Its keywords but a mask: ``softcap``, ``segments`` (do not change the dict)."""
    mask: bool
    """It takes a dense mask, built on the device from the document ids (a masked tile)."""
    first: bool = True
    """The first write of its Q rows in the Q-row accumulators."""
    first_kv: tuple[bool, ...] = ()
    """The same for each of its pieces in the key-row accumulators."""


@dataclass(frozen=True, eq=False)
class Program:
    """A rank's kernel calls in one phase of a plan (Note [Rank programs])."""

    layout: tuple[tuple[int, Rows], ...]
    """``(col, rows)``: the key pieces laid end to end once in the phase (empty: no call reads a layout)."""
    calls: tuple[Call, ...]
    seq: int
    """Rows of a chunk."""
    q_fills: tuple[tuple[int, int, int], ...]
    """``(slot, start, stop)``: the Q rows no first write covers, filled with the identity before the calls run (empty:
    the accumulators need no fill)."""
    kv_fills: tuple[tuple[int, int, int], ...]
    """The same for the key rows of every column."""
    lays: tuple[tuple[int, int, int, int], ...] = ()
    """``(col, k0, k1, at)``: the rows ``k0:k1`` of KV chunk ``col`` this program copies to rows ``at`` on of the
    layout before its calls (the whole layout in the collective schedule; in the overlapped one the rows no earlier run
    of the phase laid, Note [Keys laid once per phase])."""

    @property
    def view(self) -> bool:
        """The layout is one run of one chunk: its calls read a view of that chunk, nothing is laid."""
        return len(self.runs) == 1

    @property
    def laid_rows(self) -> int:
        """Rows this program lays by a copy: none when the layout is empty or a view of one chunk."""
        return 0 if len(self.runs) <= 1 else sum(k1 - k0 for _, k0, k1, _ in self.lays)

    @property
    def layout_rows(self) -> int:
        """Rows of the phase's layout."""
        return sum(k1 - k0 for _, (k0, k1) in self.layout)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The layout as runs ``(col, k0, k1)`` of consecutive rows of one chunk."""
        return tuple(run[:3] for run in merged_runs(with_positions(self.layout)))


def rank_program(plan, rank: int, mode: KernelMode) -> Program:
    """``rank``'s calls in the collective schedule (slots: positions in the gathered Q and KV chunks), built once per
    plan, rank and mode."""
    return _cached(plan, ("collective", rank, mode), lambda: _collective(plan, rank, mode))


def run_program(plan, rank: int, phase: str, t: int, mode: KernelMode) -> tuple[int, Program]:
    """``(end, program)`` of the run of compute actions of the overlapped schedule that starts at action ``t`` of
    ``phase`` (:meth:`~mesh_cp.core.plan.AttentionPlan.overlap_calls`): slots and columns are ring offsets; first
    writes are left to the executor, which also merges partials received along the rings."""
    return overlap_programs(plan, rank, phase, mode).runs[t]


@dataclass(frozen=True, eq=False)
class OverlapPrograms:
    """The programs of the runs of one phase of the overlapped schedule on one rank, over one layout of the phase
    (Note [Keys laid once per phase])."""

    runs: dict[int, tuple[int, Program]]
    """Per run, by its first action: ``(end, program)``."""
    kv_last_use: dict[int, int]
    """KV offset -> the last action that reads its chunk (what the phase frees it after): the calls on the layout read
    the layout, not the chunk."""

    @functools.cached_property
    def layout_span(self) -> tuple[int, int] | None:
        """The first action that lays keys and the last action of a run that reads them (``None``: no copied layout)."""
        laying = [t for t, (_, prog) in self.runs.items() if prog.laid_rows]
        reading = [end - 1 for _, (end, prog) in self.runs.items() if any(c.laid for c in prog.calls)]
        return (min(laying), max(reading)) if laying else None


def overlap_programs(plan, rank: int, phase: str, mode: KernelMode) -> OverlapPrograms:
    """The programs of ``rank``'s runs in ``phase`` of the overlapped schedule, built once per plan, rank, phase and
    mode."""
    return _cached(plan, ("overlap", rank, phase, mode), lambda: _overlap(plan, rank, phase, mode))


def units(plan, rank: int, mode: KernelMode) -> tuple:
    """``rank``'s blocks and chunk calls in the collective schedule: single blocks when softcapped logits go tile by
    tile to the reference kernel."""
    return plan.blocks(rank) if mode.reference_softcap else plan.calls(rank)


def _cached(plan, key, build):
    cache = plan.__dict__.setdefault("_programs", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _collective(plan, rank: int, mode: KernelMode) -> Program:
    slots = {x: i for i, x in enumerate(plan.tiling.q_group(rank))}
    cols = {y: j for j, y in enumerate(plan.tiling.kv_group(rank))}
    if document_calls.applies(plan, mode):  # Note [Documents in global order]
        layout, specs = document_calls.document_calls(plan, rank, mode, slots, cols)
        return _assemble(plan, layout, specs, slots, cols, first=True)
    return _program(plan, units(plan, rank, mode), slots, cols, mode, first=True)


def _overlap(plan, rank: int, phase: str, mode: KernelMode) -> OverlapPrograms:
    """The programs of every run of ``phase`` over one layout of the phase (Note [Keys laid once per phase])."""
    actions = plan.overlap(phase).actions
    todos, cols = {}, {}
    for t, (end, chunk) in plan.overlap_calls(rank, phase).items():
        i = actions[t].block[0]
        blocks = [(a.block[1], w) for a in actions[t:end] if (w := plan.block_at(rank, *a.block)) is not None]
        run_cols, slots = {w.y: j for j, w in blocks}, {w.x: i for _, w in blocks}
        cols.update(run_cols)
        chunked = chunk is not None and mode.by_segments and not mode.reference_softcap
        todos[t] = (end, (chunk,) if chunked else tuple(w for _, w in blocks), slots, run_cols)
    chunks = [u for _, todo, _, _ in todos.values() for u in todo if isinstance(u, ChunkCall)]
    layout = KeyLayout(plan, cols, [windows(plan, c) for c in chunks], mode)
    placed, runs, laid = iter(layout.placed), {}, set()
    for t, (end, todo, slots, run_cols) in todos.items():
        specs = _specs(plan, todo, placed, run_cols, mode)
        read = {s["keys"][0] + piece[3] for s in specs if s["laid"] for piece in s["pieces"]}  # layout rows of pieces
        lays = merged_runs(piece for piece in layout.pieces if piece[3] in read - laid)
        laid |= read
        runs[t] = (end, _assemble(plan, layout.laid, specs, slots, run_cols, first=False, lays=lays))
    return OverlapPrograms(runs, _kv_last_use(plan.overlap(phase), runs))


def _kv_last_use(sched, runs: dict[int, tuple[int, Program]]) -> dict[int, int]:
    """KV offset -> the last action that reads its chunk: the wait of the move that forwards it, or the last action of
    a run that computes on it or lays its rows (a call on a copied layout reads the layout)."""
    last = dict(sched.last_use("kv"))  # an offset that nothing reads keeps the schedule's
    direct = sched.forwarded("kv")
    for end, prog in runs.values():
        reads = {c.pieces[0][0] for c in prog.calls if not c.laid or prog.view}
        for col in reads | {col for col, *_ in prog.lays}:
            direct[col] = max(direct.get(col, -1), end - 1)
    return {**last, **direct}


def _program(plan, todo, slots, cols, mode: KernelMode, *, first: bool) -> Program:
    chunks = [u for u in todo if isinstance(u, ChunkCall)]
    layout = KeyLayout(plan, cols, [windows(plan, c) for c in chunks], mode)
    specs = _specs(plan, todo, iter(layout.placed), cols, mode)
    return _assemble(plan, layout.laid, specs, slots, cols, first=first)


def _specs(plan, todo, placed, cols, mode: KernelMode) -> list[dict]:
    """The call specs of ``todo``'s chunk calls (their groups' keys the next of ``placed``) and blocks."""
    specs = []
    for u in todo:
        if isinstance(u, ChunkCall):
            specs += _chunk_specs(u, next(placed), mode)
        else:
            specs += _block_specs(plan, u, mode, cols[u.y])
    return specs


def _assemble(plan, layout: tuple, specs: list[dict], slots: dict, cols: dict, *, first: bool, lays=None) -> Program:
    """The program of call ``specs`` over ``layout``, with their first writes (``first``: decided here; else left to
    the executor, as ``False``); it lays ``lays`` (``None``: the whole layout)."""
    seq = plan.mesh_shape.seq_local
    q_writes = [(slots[s["x"]], s["q_rows"]) for s in specs]
    kv_writes = [(col, rows) for s in specs for col, _, rows, _ in s["pieces"]]
    if first:
        first_q, first_kv = first_writes(q_writes, len(slots)), first_writes(kv_writes, len(cols))
    else:
        first_q, first_kv = (False,) * len(specs), (False,) * len(kv_writes)
    q_fills, kv_fills = unwritten(q_writes, first_q, len(slots), seq), unwritten(kv_writes, first_kv, len(cols), seq)
    calls, at = [], 0
    for s, fq in zip(specs, first_q, strict=True):
        n = len(s["pieces"])
        calls.append(Call(slot=slots[s["x"]], first=fq, first_kv=tuple(first_kv[at : at + n]), **s))
        at += n
    if lays is None:
        lays = merged_runs(with_positions(layout))
    return Program(layout, tuple(calls), seq, q_fills, kv_fills, tuple(lays))


REFERENCE_KEYWORDS = frozenset({"mask", "segments", "softcap"})
"""The optional keywords the reference kernel takes (:class:`mesh_cp.kernels.reference.ReferenceKernel`)."""


def _chunk_specs(c: ChunkCall, placed, mode: KernelMode) -> list[dict]:
    """The calls of chunk call ``c`` whose groups' keys are ``placed``: one varlen call on a kernel that takes
    segments, else per group its keys before the causal half and the causal half's square."""
    extra = {} if mode.softcap is None else {"softcap": mode.softcap}
    if mode.by_segments:
        v0 = min(p[0][3] for p, _ in placed)
        v1 = max(p[-1][3] + p[-1][2][1] - p[-1][2][0] for p, _ in placed)
        (r0, _), segments, pieces = c.q_rows, [], {}
        for g, (p, tail) in zip(c.groups, placed, strict=True):
            s0, s1 = p[0][3] - v0, p[-1][3] + p[-1][2][1] - p[-1][2][0] - v0
            window = (s0, s1) if mode.gaps else ((s0, s1),)
            segments.append(
                (g.q_rows[0] - r0, g.q_rows[1] - r0, *window, -1, 0 if tail else -1)
                if mode.gaps
                else (g.q_rows[0] - r0, g.q_rows[1] - r0, window, -1, 0 if tail else -1)
            )
            pieces.update({q[3]: (q[0], q[1], q[2], q[3] - v0) for q in p})
        extra = {**extra, "segments": (tuple(segments),)}
        ordered = tuple(pieces[k] for k in sorted(pieces))
        return [_spec(c.x, c.q_rows, (v0, v1), True, ordered, False, extra=extra)]
    specs = []
    for g, (p, tail) in zip(c.groups, placed, strict=True):
        n = _diagonal_units(p, c.x, g.q_rows) if tail else 0
        full, diag = p[: len(p) - n], p[len(p) - n :]
        for part, causal in ((full, False), (diag, True)):
            if part:
                v0, last = part[0][3], part[-1]
                keys = (v0, last[3] + last[2][1] - last[2][0])
                moved = tuple((q[0], q[1], q[2], q[3] - v0) for q in part)
                specs.append(_spec(c.x, g.q_rows, keys, True, moved, causal, extra=extra))
    return specs


def _diagonal_units(pieces, x: int, rows: Rows) -> int:
    """How many of the last ``pieces`` are the causal diagonal: rows ``rows`` of chunk ``x`` itself (one zig-zag
    half, or both when the group is the whole chunk; consecutive in global order then, as no later chunk's keys are
    in the group)."""
    n = 0
    while n < len(pieces) and pieces[-1 - n][1] == x and rows[0] <= pieces[-1 - n][2][0] < rows[1]:
        n += 1
    covered = [q[2] for q in pieces[len(pieces) - n :]]
    if not covered or covered[0][0] != rows[0] or covered[-1][1] != rows[1]:
        raise AssertionError(f"the causal diagonal of chunk {x} rows {rows} is not the last keys laid: {pieces}")
    return n


def _spec(x, q_rows, keys, laid, pieces, causal, *, reference=False, extra=None, mask=False) -> dict:
    return {
        "x": x,
        "q_rows": q_rows,
        "keys": keys,
        "laid": laid,
        "pieces": pieces,
        "causal": causal,
        "reference": reference,
        "extra": extra or {},
        "mask": mask,
    }


def _block_specs(plan, w: BlockWork, mode: KernelMode, col: int) -> list[dict]:
    """Block ``w`` as one call on a view of its KV chunk, or as tiles when the mask cuts it or its logits are
    softcapped and the kernel cannot do that (Note [Masked blocks] in :mod:`mesh_cp.core.masks`; a kernel that takes
    segments runs a masked block as one call of its documents, or as its runs, uncut)."""
    masked = w.kind is MaskKind.MASKED
    tiled = masked or mode.reference_softcap
    runs = masked and mode.softcap is None and mode.by_segments
    if not tiled or (runs and plan.block_segments(w) is not None):
        kind = "block" if masked else "causal" if w.causal else "full"
        return [_tile_spec(plan, w, w.q_rows, w.kv_rows, kind, mode, col)]
    return [_tile_spec(plan, w, q_rows, kv_rows, kind, mode, col) for q_rows, kv_rows, kind in plan.tiles(w, runs=runs)]


def _tile_spec(plan, w: BlockWork, q_rows: Rows, kv_rows: Rows, kind: str, mode: KernelMode, col: int) -> dict:
    """One call of block ``w``: softcapped logits to a kernel that takes ``"softcap"`` (else the reference kernel); a
    ``"masked"`` tile to one that takes a dense ``"mask"`` or ``"segments"``, else to the reference kernel."""
    extra, reference = {}, False
    if mode.softcap is not None:
        reference = "softcap" not in mode.keywords
        extra["softcap"] = mode.softcap
    taken = REFERENCE_KEYWORDS if reference else mode.keywords
    mask = kind == "masked" and ("mask" in taken or "segments" not in taken)
    reference = reference or (mask and "mask" not in taken)
    if kind == "block":
        extra["segments"] = plan.block_segments(w)
    elif kind == "masked" and not mask:
        extra["segments"] = plan.tile_segments(w, q_rows, kv_rows)
    pieces = ((col, w.y, kv_rows, 0),)
    return _spec(w.x, q_rows, kv_rows, False, pieces, kind == "causal", reference=reference, extra=extra, mask=mask)
