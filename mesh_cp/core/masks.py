"""Masks beyond causal and full attention: packed documents, padding and a left window, over global positions.

Pure Python (no torch). An :class:`AttentionMask` says, for every row of the batch, which global positions
form which document (a document is one span, or several parts when split: Note [Split documents] in
:mod:`mesh_cp.core.split`); a token outside every document is padding. Query ``i`` sees key ``j`` when both lie in
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
whose sequences are the block's documents (Note [Block segments]; split documents' parts over laid keys; with a
window, its runs), on
the others tiles of :data:`TILE` rows with an explicit mask. The traffic stays as planned: a skipped block saves
compute, not bytes (every chunk still moves along its ring, since other ranks' blocks of the same chunk may need
it); ``AttentionPlan.pairs`` counts what is computed. The varlen sequences of tiles and blocks are in
:mod:`mesh_cp.core.segments`.
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
    parts: tuple[tuple[int, ...], ...] | None = None
    """Per batch row, the document each span of :attr:`documents` belongs to: spans of one document are its parts,
    in global order (Note [Split documents] in :mod:`mesh_cp.core.split`). ``None``: every span is a document."""

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive number of tokens or None, got {self.window!r}")
        if self.parts is not None:
            _check_parts(self)
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
        """The spans of row ``row``: its documents, or their parts when :attr:`parts` is given."""
        return ((0, seq_len),) if self.documents is None else self.documents[row]

    def span_documents(self, row: int, seq_len: int) -> tuple[int, ...]:
        """The document of every span of :meth:`row_documents` (each its own unless :attr:`parts` is given)."""
        return _span_documents(self, row, seq_len)

    def document_spans(self, row: int, seq_len: int) -> tuple[tuple[Range, ...], ...]:
        """Every document of row ``row`` as its spans, in global order."""
        return _document_spans(self, row, seq_len)

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
        return f"{rows}, window {self.window}" + (", split documents" if self.parts is not None else "")


NO_MASK = AttentionMask()
"""One document over the whole sequence in every row, no window: causal or full attention as usual."""


def _check_parts(mask: AttentionMask) -> None:
    if mask.documents is None or len(mask.parts) != len(mask.documents):
        rows = None if mask.documents is None else len(mask.documents)
        raise ValueError(f"parts must give a document for every span of every row ({rows} rows), got {mask.parts!r}")
    for row, (spans, docs) in enumerate(zip(mask.documents, mask.parts, strict=True)):
        if len(docs) != len(spans) or not all(isinstance(d, int) and d >= 0 for d in docs):
            raise ValueError(
                f"parts of row {row} must be a document number >= 0 for each of its {len(spans)} spans, got {docs!r}"
            )
    if mask.window is not None:
        raise NotImplementedError(
            f"a window ({mask.window}) counts positions inside a document, which global positions do not across the "
            f"parts of a split document; pack the documents whole (no parts) to use a window"
        )


@functools.lru_cache(maxsize=256)
def _span_documents(mask: AttentionMask, row: int, seq_len: int) -> tuple[int, ...]:
    spans = mask.row_documents(row, seq_len)
    return tuple(range(len(spans))) if mask.parts is None else mask.parts[row]


@functools.lru_cache(maxsize=256)
def _document_spans(mask: AttentionMask, row: int, seq_len: int) -> tuple[tuple[Range, ...], ...]:
    spans, docs = mask.row_documents(row, seq_len), _span_documents(mask, row, seq_len)
    out: list[list[Range]] = [[] for _ in range(max(docs, default=-1) + 1)]
    for span, doc in zip(spans, docs, strict=True):
        out[doc].append(span)
    return tuple(tuple(spans) for spans in out)


def spans_within(spans: tuple[Range, ...], lo: int, hi: int) -> list[Range]:
    """The sorted ``spans`` cut to ``[lo, hi)``, the empty ones left out."""
    first = max(bisect.bisect_right([s for s, _ in spans], lo) - 1, 0)
    out = []
    for start, stop in spans[first:]:
        if start >= hi:
            break
        if max(lo, start) < min(hi, stop):
            out.append((max(lo, start), min(hi, stop)))
    return out


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
    spans, span_docs = mask.row_documents(row, seq_len), mask.span_documents(row, seq_len)
    doc_spans = mask.document_spans(row, seq_len)
    starts = [s for s, _ in spans]
    total = 0
    for qa, qb in q_ranges:
        first = max(bisect.bisect_right(starts, qa) - 1, 0)
        for (start, stop), doc in zip(spans[first:], span_docs[first:], strict=True):
            if start >= qb:
                break
            qi = (max(qa, start), min(qb, stop))
            for ka, kb in k_ranges:
                for ki in spans_within(doc_spans[doc], ka, kb):
                    total += visible_pairs(qi, ki, causal=causal, window=mask.window)
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
