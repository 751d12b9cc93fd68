"""Masks beyond causal and full attention: packed documents, padding and a left window, over global positions.

Pure Python (no torch). An :class:`AttentionMask` says, for every row of the batch, which global positions
form which document; a token outside every document is padding. Query ``i`` sees key ``j`` when both lie in
the same document, ``j <= i`` under causal attention, and ``i - j < window`` when a window is given::

    documents (0, 3), (3, 4), (4, 7), padding 7..8, causal, window 2     (x: attends, .: masked)

              key  0 1 2 3 4 5 6 7
    query 0        x . . . . . . .
          1        x x . . . . . .
          2        . x x . . . . .       window 2: two keys, itself included
          3        . . . x . . . .       a document of one token
          4        . . . . x . . .
          5        . . . . x x . .
          6        . . . . . x x .
          7        . . . . . . . .       padding attends nothing (output 0, lse -inf)

Note [Masked blocks]
~~~~~~~~~~~~~~~~~~~~
The plan counts, for every block a rank computes, the query-key pairs the mask leaves (in closed form over
the intersections of the block's global ranges with each document, :func:`visible_pairs`). A block with no
pair left in any row of the batch is skipped (no kernel call), one the mask leaves untouched keeps its kind
(and its fused kernel), and any other becomes ``MaskKind.MASKED``: on a kernel that takes ``segments`` one call
whose sequences are the block's documents (Note [Block segments]; with a window, its runs), on the others tiles of
:data:`TILE` rows with an explicit mask. The
traffic stays as planned: a skipped block saves compute, not bytes (every chunk still moves along its ring,
since other ranks' blocks of the same chunk may need it); ``AttentionPlan.pairs`` counts what is computed.

Note [Tile segments]
~~~~~~~~~~~~~~~~~~~~
flash-attn's varlen kernels take a masked tile as sequences: sequence ``n`` is queries ``[q0, q1)`` against keys
``[k0, k1)`` (``sq``, ``sk`` rows), and with ``window_size = (left, right)`` its query ``i`` sees key ``j`` when
``i + sk - sq - left <= j <= i + sk - sq + right`` (``-1``: no bound), the band anchored at the bottom-right
corner. In a tile of consecutive global positions, a document's queries and keys see each other in a band too:
``lo <= k - q <= hi`` with ``lo = 1 - window`` (or no bound) and ``hi = 0`` under causal attention (or no
bound). :func:`tile_segments` keeps the queries that see a key, then the keys one of them sees; the last query
then sees the last key, so the corner lies in the band and ``left = (ke - qe) - lo``, ``right = hi - (ke - qe)``
are never negative. Queries in no segment attend nothing in the tile (``lse = -inf``). One varlen call takes a
single window, so the kernels call once per distinct ``(left, right)``; an ordinary tile of one document has
one. Requires consecutive global positions, so :func:`block_tiles` never lets a tile straddle the two halves of a
zig-zag chunk.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from mesh_cp.core.layout import chunk_ranges, global_ranges
from mesh_cp.core.options import Layout

Range = tuple[int, int]


@dataclass(frozen=True)
class AttentionMask:
    """Documents (with padding between or around them) and a left window, per row of the batch."""

    documents: tuple[tuple[Range, ...], ...] | None = None
    """Per batch row, the ``[start, stop)`` global spans of its documents, sorted and disjoint; positions in no
    span are padding. ``None``: every row is one document over the whole sequence."""
    window: int | None = None
    """Query ``i`` sees keys ``j`` with ``i - j < window`` (itself included), under causal attention only.
    ``None``: no window."""

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive number of tokens or None, got {self.window!r}")
        for row, spans in enumerate(self.documents or ()):
            last = 0
            for start, stop in spans:
                if not (isinstance(start, int) and isinstance(stop, int) and last <= start < stop):
                    raise ValueError(
                        f"documents of row {row} must be sorted, disjoint, non-empty [start, stop) spans of global "
                        f"positions, got {spans!r}"
                    )
                last = stop

    @classmethod
    def from_lengths(cls, lengths: Sequence[Sequence[int]], *, pad_left: Sequence[int] | None = None, window=None):
        """Documents packed back to back in every row, from their lengths (``pad_left[b]`` padding tokens
        first in row ``b``; whatever follows the last document is padding)."""
        documents = []
        for row, row_lengths in enumerate(lengths):
            start = 0 if pad_left is None else pad_left[row]
            spans = []
            for n in row_lengths:
                if n < 1:
                    raise ValueError(f"document lengths must be positive, got {list(row_lengths)} in row {row}")
                spans.append((start, start + n))
                start += n
            documents.append(tuple(spans))
        return cls(documents=tuple(documents), window=window)

    def check(self, batch: int, seq_len: int, causal: bool) -> None:
        """Raise ``ValueError`` unless this mask fits a batch of ``batch`` rows of ``seq_len`` tokens."""
        if self.documents is not None:
            if len(self.documents) != batch:
                raise ValueError(f"the mask has documents for {len(self.documents)} rows, the batch has {batch}")
            ends = [spans[-1][1] for spans in self.documents if spans]
            if ends and max(ends) > seq_len:
                raise ValueError(f"a document ends at {max(ends)}, past the sequence of {seq_len} tokens")
        if self.window is not None and not causal:
            raise NotImplementedError(f"a window ({self.window}) needs causal attention; pass causal=True")

    def row_documents(self, row: int, seq_len: int) -> tuple[Range, ...]:
        return ((0, seq_len),) if self.documents is None else self.documents[row]

    @property
    def rows(self) -> int | None:
        return None if self.documents is None else len(self.documents)

    def code(self) -> str:
        """A short fingerprint of the contents, equal on every process for equal masks (the call check across
        ranks compares it with ``debug``)."""
        return _code(self)

    def form(self) -> str:
        """What the call check compares on every new call shape: the rows and the window, not the documents, which
        change every step of a packed run (a check of them would gather and sync on every step)."""
        rows = "every row one document" if self.documents is None else f"documents in {len(self.documents)} rows"
        return f"{rows}, window {self.window}"


NO_MASK = AttentionMask()
"""One document over the whole sequence in every row, no window: causal or full attention as usual."""


@functools.lru_cache(maxsize=64)
def _code(mask: AttentionMask) -> str:
    text = repr(mask)
    return f"{zlib.crc32(text.encode()):08x}:{len(text)}"


def _count(i: int, c: int, d: int, causal: bool, window: int | None) -> int:
    """Keys ``j`` in ``[c, d)`` that query ``i`` sees (``j <= i`` if causal, ``i - j < window`` if given)."""
    lower = c if window is None else max(c, i - window + 1)
    upper = min(d, i + 1) if causal else d
    return max(0, upper - lower)


def visible_pairs(q: Range, k: Range, *, causal: bool, window: int | None) -> int:
    """Query-key pairs ``(i, j)``, ``i`` in ``q``, ``j`` in ``k`` (global ranges of one document), that attend.

    The count per query is piecewise linear in ``i`` with breaks where a bound of ``j`` changes form
    (``i + 1 = c``, ``i + 1 = d``, ``i - window + 1 = c``, ``i - window + 1 = d``); between breaks it is
    summed as an arithmetic series, so the cost does not grow with the lengths.
    """
    (a, b), (c, d) = q, k
    if a >= b or c >= d:
        return 0
    cuts = {a, b}
    for p in (c - 1, d - 1, *((c + window - 1, d + window - 1) if window is not None else ())):
        cuts.update(x for x in (p, p + 1) if a < x < b)
    points = sorted(cuts)
    total = 0
    for lo, hi in zip(points, points[1:], strict=False):
        first, last = _count(lo, c, d, causal, window), _count(hi - 1, c, d, causal, window)
        total += (first + last) * (hi - lo) // 2
    return total


def block_pairs(
    mask: AttentionMask, row: int, q_ranges: Sequence[Range], k_ranges: Sequence[Range], *, causal: bool, seq_len: int
) -> int:
    """Pairs that attend in batch row ``row`` between the global ranges of a block's queries and keys."""
    docs = mask.row_documents(row, seq_len)
    starts = [s for s, _ in docs]
    total = 0
    for qa, qb in q_ranges:
        first = max(bisect.bisect_right(starts, qa) - 1, 0)
        for start, stop in docs[first:]:
            if start >= qb:
                break
            qi = (max(qa, start), min(qb, stop))
            for ka, kb in k_ranges:
                total += visible_pairs(qi, (max(ka, start), min(kb, stop)), causal=causal, window=mask.window)
    return total


TILE = 512
"""Rows and columns of the tiles a ``MASKED`` block is cut into (a module setting: tests make it small)."""

Tile = tuple[tuple[int, int], tuple[int, int], str]


def rectangle_pairs(
    mask: AttentionMask,
    q: tuple[int, Range],
    k: tuple[int, Range],
    *,
    seq_len: int,
    world: int,
    layout: Layout,
    causal: bool,
) -> list[int]:
    """Pairs that attend, per batch row of ``mask``, between the local rows ``q[1]`` of Q chunk ``q[0]`` and the
    local rows ``k[1]`` of KV chunk ``k[0]`` in ``layout``."""
    q_ranges = global_ranges(seq_len, world, q[0], layout, q[1])
    k_ranges = global_ranges(seq_len, world, k[0], layout, k[1])
    return [block_pairs(mask, b, q_ranges, k_ranges, causal=causal, seq_len=seq_len) for b in range(mask.rows or 1)]


def block_tiles(
    mask: AttentionMask,
    q: tuple[int, Range],
    k: tuple[int, Range],
    *,
    seq_len: int,
    world: int,
    layout: Layout,
    causal: bool,
    size: int | None = None,
) -> tuple[Tile, ...]:
    """The kernel calls of a ``MASKED`` block of Q chunk ``q[0]`` (local rows ``q[1]``) against KV chunk ``k[0]``
    (rows ``k[1]``): rows and columns cut into tiles of ``size`` rows (default :data:`TILE`; ``0``: no cut but the
    runs of consecutive global positions, for kernels that take ``segments``), the tiles the mask empties (in every
    batch row) left out, the others ``"full"`` (no mask), ``"causal"`` (the usual top-left causal square) or
    ``"masked"`` (an explicit mask). Ranges are local rows of the chunks (Note [Masked blocks])."""
    size = TILE if size is None else size or seq_len
    return _block_tiles(mask, q, k, seq_len, world, layout, causal, size)


def _runs(seq_len: int, world: int, chunk: int, layout: Layout, local: Range, size: int) -> list[Range]:
    """The local rows ``local`` of ``chunk`` cut into pieces of at most ``size`` rows, each of consecutive global
    positions (a piece never straddles the two halves of a zig-zag chunk)."""
    pieces, offset = [], 0
    for g0, g1 in chunk_ranges(seq_len, world, chunk, layout):
        lo, hi = max(local[0], offset), min(local[1], offset + g1 - g0)
        pieces.extend((s, min(s + size, hi)) for s in range(lo, hi, size))
        offset += g1 - g0
    return pieces


@functools.lru_cache(maxsize=4096)
def _block_tiles(mask, q, k, seq_len, world, layout, causal, size) -> tuple[Tile, ...]:
    (x, q_local), (y, k_local) = q, k
    where = {"seq_len": seq_len, "world": world, "layout": layout, "causal": causal}
    out = []
    for q0, q1 in _runs(seq_len, world, x, layout, q_local, size):
        for k0, k1 in _runs(seq_len, world, y, layout, k_local, size):
            pairs = set(rectangle_pairs(mask, (x, (q0, q1)), (y, (k0, k1)), **where))
            if pairs == {0}:
                continue
            n = q1 - q0
            if pairs == {n * (k1 - k0)}:
                kind = "full"
            elif causal and (x, q0, q1) == (y, k0, k1) and pairs == {n * (n + 1) // 2}:
                kind = "causal"
            else:
                kind = "masked"
            out.append(((q0, q1), (k0, k1), kind))
    return tuple(out)


Segment = tuple[int, int, int, int, int, int]
"""``(q0, q1, k0, k1, left, right)``: one flash-attn varlen sequence of a tile (Note [Tile segments])."""


def tile_segments(
    mask: AttentionMask,
    q: tuple[int, Range],
    k: tuple[int, Range],
    *,
    seq_len: int,
    world: int,
    layout: Layout,
    causal: bool,
) -> tuple[tuple[Segment, ...], ...]:
    """The visible pairs of one tile (local rows ``q[1]`` of Q chunk ``q[0]``, ``k[1]`` of KV chunk ``k[0]``, each
    of consecutive global positions, as :func:`block_tiles` cuts them) as flash-attn varlen sequences, per batch
    row of ``mask``: Note [Tile segments]."""
    q_range = global_ranges(seq_len, world, q[0], layout, q[1])
    k_range = global_ranges(seq_len, world, k[0], layout, k[1])
    if len(q_range) != 1 or len(k_range) != 1:
        raise ValueError(f"a tile's rows must be consecutive global positions, got {q_range} and {k_range}")
    return _tile_segments(mask, q_range[0], k_range[0], seq_len, causal)


@functools.lru_cache(maxsize=4096)
def _tile_segments(mask: AttentionMask, q: Range, k: Range, seq_len: int, causal: bool):
    lo = None if mask.window is None else 1 - mask.window  # k - q >= lo
    hi = 0 if causal else None  # k - q <= hi
    rows = []
    for row in range(mask.rows or 1):
        segments = []
        for start, stop in mask.row_documents(row, seq_len):
            qs, qe = max(q[0], start), min(q[1], stop)
            ks, ke = max(k[0], start), min(k[1], stop)
            # Keep the queries that see a key of [ks, ke), then the keys one of them sees.
            if hi is not None:
                qs = max(qs, ks - hi)
            if lo is not None:
                qe = min(qe, ke - lo)
            if qs >= qe or ks >= ke:
                continue
            if lo is not None:
                ks = max(ks, qs + lo)
            if hi is not None:
                ke = min(ke, qe + hi)
            shift = ke - qe
            left = -1 if lo is None else shift - lo
            right = -1 if hi is None else hi - shift
            segments.append((qs - q[0], qe - q[0], ks - k[0], ke - k[0], left, right))
        rows.append(tuple(segments))
    return tuple(rows)


def block_segments(
    mask: AttentionMask,
    q: tuple[int, Range],
    k: tuple[int, Range],
    *,
    seq_len: int,
    world: int,
    layout: Layout,
    causal: bool,
) -> tuple[tuple[Segment, ...], ...] | None:
    """A ``MASKED`` block (local rows ``q[1]`` of Q chunk ``q[0]``, ``k[1]`` of KV chunk ``k[0]``) as the varlen
    sequences of one call, per batch row of ``mask``, in the block's local rows; ``None`` where it takes more than
    one call (then :func:`block_tiles` with ``size=0`` gives its runs).

    Note [Block segments]
    ~~~~~~~~~~~~~~~~~~~~~
    A chunk's local rows are in increasing global order (a zig-zag chunk: its first half, then its second), so a
    document's queries in a block are one run of local rows, and so are its keys. Without a window every query of a
    document sees a prefix of the document's keys in the block, and in both layouts the blocks are of two kinds: the
    keys lie before every query (the keys after the last query, the later half of a KV chunk, are dropped), one
    segment with no bound; or queries and keys are the same positions (the diagonal), one causal segment, the band
    ``(-1, 0)``. A window bounds the keys from below in global positions, which is no band across the gap between the
    two halves of a zig-zag chunk: such a block runs as its runs (Note [Tile segments]).
    """
    if mask.window is not None:
        return None
    q_ranges = global_ranges(seq_len, world, q[0], layout, q[1])
    k_ranges = global_ranges(seq_len, world, k[0], layout, k[1])
    return _block_segments(mask, q_ranges, k_ranges, seq_len, causal)


@functools.lru_cache(maxsize=4096)
def _block_segments(mask: AttentionMask, q_ranges, k_ranges, seq_len: int, causal: bool):
    rows = []
    for row in range(mask.rows or 1):
        segments = []
        for start, stop in mask.row_documents(row, seq_len):
            qd, kd = _doc_rows(q_ranges, start, stop), _doc_rows(k_ranges, start, stop)
            if qd is None or kd is None:
                continue
            if qd is False or kd is False:
                return None
            (q0, q1, q_glob), (k0, k1, k_glob) = qd, kd
            if causal and q_glob == k_glob:
                segments.append((q0, q1, k0, k1, -1, 0))
                continue
            if causal:  # keys after the last query see nothing; the rest must precede the first query
                last_q = q_glob[-1][1] - 1
                k1 = k0 + sum(max(0, min(g1, last_q + 1) - g0) for g0, g1 in k_glob)
                if k1 == k0:
                    continue
                if _global_at(k_glob, k1 - k0 - 1) > q_glob[0][0]:
                    return None
            segments.append((q0, q1, k0, k1, -1, -1))
        rows.append(tuple(segments))
    return tuple(rows)


def _doc_rows(ranges: tuple[Range, ...], start: int, stop: int):
    """The local rows (from the block's first row) of document ``[start, stop)`` among the block's global ``ranges``
    (in local order) with their global pieces: ``(lo, hi, pieces)``, ``None`` when it has none there, ``False`` when
    they are not one run of local rows."""
    parts, offset = [], 0
    for g0, g1 in ranges:
        lo, hi = max(g0, start), min(g1, stop)
        if lo < hi:
            parts.append((offset + lo - g0, offset + hi - g0, lo, hi))
        offset += g1 - g0
    if not parts:
        return None
    if any(a[1] != b[0] for a, b in zip(parts, parts[1:], strict=False)):
        return False
    return parts[0][0], parts[-1][1], tuple((p[2], p[3]) for p in parts)


def _global_at(pieces: tuple[Range, ...], index: int) -> int:
    """The global position of the ``index``-th row of the global ``pieces`` laid end to end."""
    for g0, g1 in pieces:
        if index < g1 - g0:
            return g0 + index
        index -= g1 - g0
    raise IndexError(index)
