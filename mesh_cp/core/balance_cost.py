"""The query-key pairs every rank computes for packed rows, vectorised over many candidate orders at once.

The balancing search of :mod:`mesh_cp.core.balance` scores thousands of document orders per call; this module gives
the same per-rank counts as :meth:`AttentionPlan.pairs` (Note [Masked blocks] in :mod:`mesh_cp.core.masks`) for
all of them in a few numpy operations (Note [Pairs per half-chunk]).

Note [Pairs per half-chunk]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Cut a row into the ``n`` parts of its layout (``2P`` half-chunks zig-zag, ``P`` chunks contiguous) of ``h`` tokens
each. A document's causal pairs fall in part pairs ``(I, J)``, ``J <= I``: inside one part, its piece of ``p``
tokens keeps ``p (p + 1) / 2`` pairs; across two parts, its query piece (``U`` tokens of part ``I``) and key piece
(``V`` tokens of part ``J``) keep all ``U V``. Rank ``owner(chunk(I), chunk(J))`` of the tiling computes them. Only
one document can cover the edge at the start of part ``I`` (documents do not overlap), so the pairs across parts
come from the at most ``n - 1`` documents that cross an edge, each against the parts before it, back to the span of
the longest document; the pairs inside a part are the triangles of its first and last pieces plus prefix sums over
the documents wholly inside. A window ``w`` counts, inside a part, ``w (w + 1) / 2 + (p - w) w`` when ``p > w``,
and across parts ``gap = (I - J - 1) h`` tokens apart the lattice points ``u + v <= w - 2 - gap`` of the
``U x V`` rectangle. Several rows of a batch are one long row of ``rows * n`` parts whose documents never cross a
row's end; every row's pairs add to the same ranks. Counts are integers below ``2**53``, so their float64 sums are
exact, the same on every process.
"""

from __future__ import annotations

import numpy as np

from mesh_cp.core.layout import check_seq_len
from mesh_cp.core.options import Layout
from mesh_cp.core.tiling import Tiling


def triangle(n: np.ndarray, window: int | None) -> np.ndarray:
    """Causal pairs inside ``n`` consecutive tokens of one document (``i - j < window`` when given)."""
    full = n * (n + 1) // 2
    if window is None:
        return full
    return np.where(n <= window, full, window * (window + 1) // 2 + (n - window) * window)


def rectangle(u: np.ndarray, v: np.ndarray, gap: int, window: int | None) -> np.ndarray:
    """Pairs between ``u`` query tokens and ``v`` key tokens ending ``gap`` tokens before the first query, all of
    one document (``i - j < window`` when given): Note [Pairs per half-chunk]."""
    if window is None:
        return u * v
    r = window - 2 - gap

    def below(x):  # lattice points (a, b >= 0) with a + b <= x
        return np.where(x >= 0, (x + 1) * (x + 2) // 2, 0)

    return below(r) - below(r - u) - below(r - v) + below(r - u - v)


class PackCost:
    """Per-rank pairs of ``rows`` packed rows of ``seq_len`` tokens laid out over the ``tiling.world`` ranks of a
    plan (Note [Pairs per half-chunk]); ``longest`` bounds the documents' lengths (how far back a document reaches)."""

    def __init__(
        self, *, seq_len: int, tiling: Tiling, layout: Layout, window: int | None, rows: int, longest: int
    ) -> None:
        world = tiling.world
        check_seq_len(seq_len, world, layout)
        parts = 2 * world if layout == "zigzag" else world
        chunk = [i if i < world else parts - 1 - i for i in range(parts)]
        self.seq_len, self.world, self.window, self.rows = seq_len, world, window, rows
        self.part = seq_len // parts
        self.parts = parts * rows
        self.back = max(1, min(parts - 1, -(-longest // self.part)))
        own = np.zeros((parts, parts), dtype=np.int64)
        for i in range(parts):
            for j in range(i + 1):
                own[i, j] = tiling.owner(chunk[i], chunk[j])
        whole = np.arange(self.parts) % parts
        edges = np.arange(1, self.parts)[:, None]
        back = np.arange(1, self.back + 1)[None, :]
        # The rank of every part's pairs inside it, then of every (edge, back) pair of parts; a key part in the row
        # before is never reached (its pieces are 0).
        self.owners = np.concatenate([own[whole, whole], own[edges % parts, (edges - back) % parts].ravel()])
        # (world, rows * parts / world): the parts of every rank's own chunk, in every row.
        self.rank_parts = np.array([np.flatnonzero(own[whole, whole] == g) for g in range(world)])

    def spans(self, lengths: np.ndarray, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the items of each candidate lie: ``lengths`` and ``breaks`` (``(C, K)``, ``breaks`` marking the
        items that start a new row) give ``start, stop`` (global positions of the batch as one long row) and which
        candidates fit (no row longer than ``seq_len``); a candidate that does not fit gets empty items at 0, so that
        every candidate's positions stay sorted for :meth:`costs`."""
        ends = np.cumsum(lengths, axis=1)
        row_start = np.maximum.accumulate(np.where(breaks, ends - lengths, 0), axis=1)
        stop = ends - row_start
        fits = (stop <= self.seq_len).all(axis=1)
        stop = np.where(fits[:, None], stop + np.cumsum(breaks, axis=1) * self.seq_len, 0)
        return np.where(fits[:, None], stop - lengths, 0), stop, fits

    def costs(self, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """``(C, world)`` pairs per rank (float64, exact) of ``C`` candidates whose documents lie at
        ``[start, stop)`` (``(C, K)``, sorted, disjoint, none crossing a row's end; empty items allowed)."""
        count, k = start.shape
        h, window = self.part, self.window
        shift = (np.arange(count) * (self.parts * h + 1))[:, None]
        lo = np.arange(self.parts) * h
        flat = (lo[None, :] + shift).ravel()
        first = np.searchsorted((stop + shift).ravel(), flat, side="right").reshape(count, -1)
        last = np.searchsorted((start + shift).ravel(), flat + h, side="left").reshape(count, -1) - 1
        first -= np.arange(count)[:, None] * k
        last -= np.arange(count)[:, None] * k
        rows = np.arange(count)[:, None]
        f, g = np.minimum(first, k - 1), np.clip(last, 0, k - 1)
        lengths = stop - start
        prefix = np.concatenate([np.zeros((count, 1), np.int64), np.cumsum(triangle(lengths, window), axis=1)], 1)

        def piece(index):
            return np.clip(np.minimum(stop[rows, index], lo + h) - np.maximum(start[rows, index], lo), 0, None)

        within = np.where(last >= first, triangle(piece(f), window), 0)
        within += np.where(last > first, triangle(piece(g), window), 0)
        within += np.where(last > first + 1, prefix[rows, g] - prefix[rows, np.minimum(f + 1, k)], 0)
        edge = lo[1:]
        d = f[:, 1:]
        s, e = start[rows, d], stop[rows, d]
        crosses = (first[:, 1:] < k) & (s < edge)
        query = np.where(crosses, np.minimum(e, edge + h) - edge, 0)
        across = np.empty((count, self.parts - 1, self.back), dtype=np.int64)
        for t in range(1, self.back + 1):
            key_lo = edge - t * h
            key = np.clip(np.minimum(e, key_lo + h) - np.maximum(s, key_lo), 0, None)
            across[:, :, t - 1] = rectangle(query, key, (t - 1) * h, window)
        pairs = np.concatenate([within, across.reshape(count, -1)], axis=1)
        where = (np.arange(count)[:, None] * self.world + self.owners[None, :]).ravel()
        return np.bincount(where, weights=pairs.ravel(), minlength=count * self.world).reshape(count, self.world)
