"""Masked tiles and blocks as flash-attn varlen sequences ("segments"): which queries of a document see which of
its keys, as bands anchored at the bottom-right corner of each sequence.

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
one. Requires consecutive global positions, so :func:`~mesh_cp.core.masks.block_tiles` never lets a tile straddle the two halves of a
zig-zag chunk.
"""

from __future__ import annotations

import functools

from mesh_cp.core.layout import global_ranges
from mesh_cp.core.masks import AttentionMask, Range, spans_within
from mesh_cp.core.options import Layout

Segment = tuple[int, int, int, int, int, int]
"""``(q0, q1, k0, k1, left, right)``: one flash-attn varlen sequence of a tile (Note [Tile segments])."""
LaidSegment = tuple[int, int, tuple[Range, ...], int, int]
"""``(q0, q1, keys, left, right)``: one varlen sequence over the key ranges ``keys`` laid end to end (Note [Laid
keys] in :mod:`mesh_cp.kernels.varlen`)."""


def laid(segment: Segment | LaidSegment) -> LaidSegment:
    """``segment`` in the laid form (Note [Laid keys]): a plain segment's keys are one range."""
    if len(segment) == 6:
        q0, q1, k0, k1, left, right = segment
        return q0, q1, ((k0, k1),), left, right
    return segment


def key_count(segment: Segment | LaidSegment) -> int:
    """The segment's ``sk``: its keys laid end to end."""
    return sum(k1 - k0 for k0, k1 in laid(segment)[2])


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
    of consecutive global positions, as :func:`mesh_cp.core.masks.block_tiles` cuts them) as flash-attn varlen sequences, per batch
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
        for doc, spans in enumerate(mask.document_spans(row, seq_len)):
            q_part, k_part = _one_part(spans, q, row, doc), _one_part(spans, k, row, doc)
            if q_part is None or k_part is None:
                continue
            (qs, qe), (ks, ke) = q_part, k_part
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
        segments.sort()
        if any(a[3] > b[2] for a, b in zip(segments, segments[1:], strict=False)):
            raise NotImplementedError(
                f"row {row}: the documents' keys in keys {k} are not in the order of their queries in {q}; "
                f"split documents must keep their parts in the same document order in every piece of the layout"
            )
        rows.append(tuple(segments))
    return tuple(rows)


def _one_part(spans: tuple[Range, ...], rows: Range, row: int, doc: int) -> Range | None:
    """The one part of a document (its ``spans``) in the tile's global ``rows``, ``None`` if it has none there."""
    parts = spans_within(spans, *rows)
    if len(parts) > 1:
        raise NotImplementedError(
            f"document {doc} of row {row} has {len(parts)} parts {parts} in one tile's rows {rows}: a tile takes one "
            f"part of each document (split documents take one part per half-chunk of the zig-zag layout)"
        )
    return parts[0] if parts else None


def block_segments(
    mask: AttentionMask,
    q: tuple[int, Range],
    k: tuple[int, Range],
    *,
    seq_len: int,
    world: int,
    layout: Layout,
    causal: bool,
) -> tuple[tuple[Segment | LaidSegment, ...], ...] | None:
    """A ``MASKED`` block (local rows ``q[1]`` of Q chunk ``q[0]``, ``k[1]`` of KV chunk ``k[0]``) as the varlen
    sequences of one call, per batch row of ``mask``, in the block's local rows; ``None`` where it takes more than
    one call (then :func:`mesh_cp.core.masks.block_tiles` with ``size=0`` gives its runs).

    Note [Block segments]
    ~~~~~~~~~~~~~~~~~~~~~
    A chunk's local rows are in increasing global order (a zig-zag chunk: its first half, then its second), so a
    document's queries in a block are one run of local rows, and so are its keys. Without a window every query of a
    document sees a prefix of the document's keys in the block, and in both layouts the blocks are of two kinds: the
    keys lie before every query (the keys after the last query, the later half of a KV chunk, are dropped), one
    segment with no bound; or queries and keys are the same positions (the diagonal), one causal segment, the band
    ``(-1, 0)``. A window bounds the keys from below in global positions, which is no band across the gap between the
    two halves of a zig-zag chunk: such a block runs as its runs (Note [Tile segments]).

    Where a document's rows are not one run (a split document has a part in each half of a zig-zag chunk, with other
    documents' parts between them, Note [Split documents] in :mod:`mesh_cp.core.split`), or its keys are not all
    before its first query, each part of it in the queries (consecutive global positions) is a segment of its own
    over laid keys (Note [Laid keys] in :mod:`mesh_cp.kernels.varlen`): the parts of its keys wholly before the
    part, then the part's own positions as the causal diagonal, last; a key part after it is dropped. A key part two
    query parts see is laid for both. Only a key part that overlaps a query part without being its positions leaves
    the block to its runs; in the plan's blocks that never happens without a window.
    """
    if mask.window is not None:
        return None
    q_ranges = global_ranges(seq_len, world, q[0], layout, q[1])
    k_ranges = global_ranges(seq_len, world, k[0], layout, k[1])
    return _block_segments(mask, q_ranges, k_ranges, seq_len, causal)


@functools.lru_cache(maxsize=4096)
def _block_segments(mask: AttentionMask, q_ranges, k_ranges, seq_len: int, causal: bool):
    runs = _run_segments(mask, q_ranges, k_ranges, seq_len, causal)
    return runs if runs is not None else _laid_segments(mask, q_ranges, k_ranges, seq_len, causal)


def _laid_segments(mask: AttentionMask, q_ranges, k_ranges, seq_len: int, causal: bool):
    """A segment per part of a document in the queries, over its key parts laid end to end (Note [Block
    segments]); ``None`` where a key part overlaps a query part without being its positions."""
    rows = []
    for row in range(mask.rows or 1):
        segments = []
        for spans in mask.document_spans(row, seq_len):
            k_parts = _doc_parts(k_ranges, spans)
            for q0, q1, g0, g1 in _doc_parts(q_ranges, spans) if k_parts else ():
                keys, diagonal = [], ()
                for k0, k1, h0, h1 in k_parts:
                    if not causal or h1 <= g0:
                        keys.append((k0, k1))
                    elif (h0, h1) == (g0, g1):
                        diagonal = ((k0, k1),)
                    elif h0 < g1:
                        return None
                if keys or diagonal:
                    segments.append((q0, q1, (*keys, *diagonal), -1, 0 if diagonal else -1))
        rows.append(tuple(sorted(segments)))
    return tuple(rows)


def _run_segments(mask: AttentionMask, q_ranges, k_ranges, seq_len: int, causal: bool):
    """A segment per document whose queries and keys are each one run of local rows, its keys before its first query
    or its diagonal; ``None`` where one is not."""
    rows = []
    for row in range(mask.rows or 1):
        segments = []
        for spans in mask.document_spans(row, seq_len):
            qd, kd = _doc_rows(q_ranges, spans), _doc_rows(k_ranges, spans)
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


def _doc_parts(ranges: tuple[Range, ...], spans: tuple[Range, ...]) -> list[tuple[int, int, int, int]]:
    """The parts of the document of ``spans`` among the block's global ``ranges`` (in local order), each of
    consecutive global positions: ``(local lo, local hi, global lo, global hi)``, local rows from the block's first."""
    parts, offset = [], 0
    for g0, g1 in ranges:
        for lo, hi in spans_within(spans, g0, g1):
            parts.append((offset + lo - g0, offset + hi - g0, lo, hi))
        offset += g1 - g0
    return parts


def _doc_rows(ranges: tuple[Range, ...], spans: tuple[Range, ...]):
    """The local rows (from the block's first row) of the document of ``spans`` among the block's global ``ranges``
    (in local order) with their global pieces: ``(lo, hi, pieces)``, ``None`` when it has none there, ``False`` when
    they are not one run of local rows."""
    parts = _doc_parts(ranges, spans)
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
