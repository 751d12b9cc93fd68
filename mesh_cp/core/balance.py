"""Balanced packing: the order of the documents in packed rows that evens out the pairs every rank computes.

::

    rows = balance_documents([20815, 21973, 9518, ...], seq_len=131072, world=16, tile=(4, 4))
    order = rows[0]                      # indices into the lengths, in the order to pack them

Note [Balanced packing]
~~~~~~~~~~~~~~~~~~~~~~~
The zig-zag layout balances one causal sequence (Note [Zig-zag causal balance] in :mod:`mesh_cp.core.blocks`), not
a packed row: a document's pairs stay inside it, so a rank whose half-chunks lie in long documents computes more
than one in short ones (at ``P = 16``, 8192 tokens per rank, 4x4, the busiest rank computes 1.34 to 1.70 times the
mean for the mixes of ``scripts/bench_rank.py``). The order of the documents is free: with attention inside each
document and positions that restart in every document, each token's output and loss are the same wherever its
document sits, so reordering is exact (up to the order in which floating-point sums are taken). Between the rows
of a batch the choice of row is free too. :func:`balance_documents` searches for the order (and rows) that
minimises the busiest rank's pairs, counted as the plan counts them (Note [Pairs per half-chunk] in
:mod:`mesh_cp.core.balance_cost`, equal to :meth:`AttentionPlan.pairs`):

- a local search from four starts (longest first, into the first row with room; the given order; two shuffles;
  with several rows all four start from the longest-first placement):
  each of 100 steps tries 16 moves per start (swap two documents, or move one; half of them take a document from
  the busiest rank's half-chunks, a third move it one to three places), each start takes its best move unless
  that raises its score by more than a threshold that shrinks to 0, and the search stops early once the busiest
  rank is within 1% of the mean. The score is the sum over ranks of ``(pairs / mean) ** 8``: it follows the
  busiest rank and still rewards a move that lowers the next ones. Several rows are one sequence of items with an
  empty item opening every row after the first, so a move may change a document's row; one that overflows a row
  scores ``inf``.
- up to 8 documents in one row, 25 steps of that search bound an exact search: documents placed left to right,
  every prefix whose busiest rank already computes as much as the bound dropped (about 20,000 prefixes for 8).

The search is seeded and uses only exact integer counts and IEEE arithmetic, so every process of a CP group (with
the same numpy) gets the same order from the same lengths. What reordering cannot fix: a row of few long documents
has few orders, and a document across two half-chunks puts a whole ``h x h`` block (``h`` the half-chunk) on one
rank; the best of the 5040 orders of the ``long`` mix (7 documents of 9.5K-25K, ``h = 4096``) leaves the busiest
rank at 1.19 times the mean. Splitting the documents evens out any mix (Note [Split documents] in
:mod:`mesh_cp.core.split`), at the price of more, shorter varlen sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mesh_cp.core.balance_cost import PackCost, triangle
from mesh_cp.core.layout import check_seq_len, chunk_ranges
from mesh_cp.core.masks import AttentionMask, block_pairs
from mesh_cp.core.options import Layout
from mesh_cp.core.split import split_documents
from mesh_cp.core.tiling import Tiling, most_square_tile

EXACT = 8
"""Up to this many documents in one row, a short search bounds an exact one (:func:`_exact`)."""
STEPS, STARTS, MOVES = 100, 4, 16
"""Local search: steps, starts searched side by side, moves tried per start and step."""
THRESHOLD = 0.03
"""A start takes its best move when its score rises by less than this (times the ranks) times the share of the
steps left."""
GOOD_ENOUGH = 1.01
"""The search stops once the busiest rank computes at most this times the mean."""

Rows = tuple[tuple[int, ...], ...]


def balance_documents(
    lengths: Sequence[int],
    *,
    seq_len: int,
    world: int,
    tile: tuple[int, int] | str | None = None,
    layout: Layout = "zigzag",
    window: int | None = None,
    rows: int = 1,
) -> Rows:
    """The documents of every row (indices into ``lengths``, in packing order) that minimise the busiest rank's
    query-key pairs when the rows are packed back to back from position 0 (Note [Balanced packing]).

    ``seq_len``: tokens of a row (padded as the layout needs); ``world``: the ranks that compute blocks, ``P``
    (``P / head_parallel`` with head groups: a mesh's ``tiling.world``); ``tile``: their ``a x b`` tiling (default
    the most square, as :func:`most_square_tile`); ``layout``: the sequence layout; ``window``: the mask's left
    window; ``rows``: rows of the batch. Deterministic: every process gets the same rows from the same inputs.
    """
    tiling = _tiling(tile, world)
    sizes = _checked(lengths, seq_len=seq_len, world=world, layout=layout, window=window, rows=rows)
    first = _first_fit(sizes, seq_len, rows)
    if world == 1 or len(sizes) < 2:  # every order computes the same
        return (tuple(range(len(sizes))),) if rows == 1 else first
    cost = PackCost(seq_len=seq_len, tiling=tiling, layout=layout, window=window, rows=rows, longest=max(sizes))
    items = np.array([*sizes, *([0] * (rows - 1))], dtype=np.int64)
    starts = [_items(first, len(sizes))] + ([np.arange(len(sizes))] if rows == 1 else [])
    exact = rows == 1 and len(sizes) <= EXACT
    best = _search(cost, items, starts, STEPS // 4 if exact else STEPS)
    if exact:
        _, _, busiest = _evaluate(cost, items, best[None], _mean(cost, items))
        found = _exact(cost, items, busiest[0])
        best = best if found is None else found
    return _rows(best, len(sizes))


def rank_pairs(
    rows: Sequence[Sequence[int]],
    *,
    seq_len: int,
    world: int,
    tile: tuple[int, int] | str | None = None,
    layout: Layout = "zigzag",
    window: int | None = None,
    split: bool = False,
) -> list[int]:
    """Query-key pairs every rank computes for packed ``rows`` (document lengths, back to back from 0), summed over
    the rows (for one row, :meth:`AttentionPlan.pairs` of the causal plan with that mask); counted block by block
    with :func:`mesh_cp.core.masks.block_pairs`, the reference the search's counts are tested against. ``split``:
    the documents laid out split (Note [Split documents] in :mod:`mesh_cp.core.split`; zig-zag, no window)."""
    tiling = _tiling(tile, world)
    check_seq_len(seq_len, world, layout)
    if split and layout != "zigzag":
        raise ValueError(f"split documents are laid out over the zig-zag layout's half-chunks, got layout {layout!r}")
    mask = split_documents(rows, seq_len=seq_len, world=world)[0] if split else AttentionMask.from_lengths(rows)
    mask = dataclasses.replace(mask, window=window)
    mask.check(len(rows), seq_len, causal=True)
    chunks = [chunk_ranges(seq_len, world, x, layout) for x in range(world)]
    where = {"causal": True, "seq_len": seq_len}
    return [
        sum(block_pairs(mask, r, chunks[x], chunks[y], **where) for r in range(len(rows)) for x, y in tiling.blocks(g))
        for g in range(world)
    ]


def _tiling(tile: tuple[int, int] | str | None, world: int) -> Tiling:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be the number of ranks that compute blocks (a positive int), got {world!r}")
    return Tiling(world, *most_square_tile(world)) if tile is None else Tiling.parse(tile, world)


def _checked(lengths, *, seq_len: int, world: int, layout: Layout, window, rows: int) -> list[int]:
    """The lengths as ints; ``ValueError`` naming the value and the fix for anything the rows cannot hold."""
    check_seq_len(seq_len, world, layout)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int (the rows of the batch), got {rows!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of tokens or None, got {window!r}")
    sizes = list(lengths)
    for i, n in enumerate(sizes):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"document lengths must be positive ints, got {n!r} at index {i}; drop empty documents")
        if n > seq_len:
            raise ValueError(
                f"document {i} has {n} tokens, more than a row of seq_len={seq_len}; split it or pass a longer seq_len"
            )
    if sum(sizes) > rows * seq_len:
        raise ValueError(
            f"the documents hold {sum(sizes)} tokens, more than {rows} row(s) of {seq_len}; pass "
            f"rows={-(-sum(sizes) // seq_len)} or more, or a longer seq_len"
        )
    return [int(n) for n in sizes]


def _first_fit(sizes: list[int], seq_len: int, rows: int) -> Rows:
    """The documents in ``rows`` rows, longest first, each into the first row with room (the search's start)."""
    filled, out = [0] * rows, [[] for _ in range(rows)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        row = next((r for r in range(rows) if filled[r] + sizes[i] <= seq_len), None)
        if row is None:
            raise ValueError(
                f"the documents ({sum(sizes)} tokens, longest {max(sizes)}) do not fit {rows} rows of {seq_len} "
                f"tokens by first fit, longest first; pass rows={rows + 1} or a longer seq_len"
            )
        filled[row] += sizes[i]
        out[row].append(i)
    return tuple(tuple(row) for row in out)


def _items(rows: Rows, count: int) -> np.ndarray:
    """Rows as one sequence of items: the documents, with item ``count + r - 1`` (empty) opening row ``r > 0``."""
    out = list(rows[0])
    for r, row in enumerate(rows[1:]):
        out += [count + r, *row]
    return np.array(out, dtype=np.int64)


def _rows(items: np.ndarray, count: int) -> Rows:
    """The rows of a sequence of items (:func:`_items`)."""
    out: list[list[int]] = [[]]
    for i in items.tolist():
        if i >= count:
            out.append([])
        else:
            out[-1].append(i)
    return tuple(tuple(row) for row in out)


def _evaluate(cost: PackCost, items: np.ndarray, orders: np.ndarray, mean: float):
    """Pairs per rank, score (Note [Balanced packing]) and the busiest rank's pairs of candidate ``orders``
    (``(C, K)`` item indices); a candidate whose rows overflow scores ``inf``."""
    start, stop, fits = cost.spans(items[orders], orders >= len(items) - cost.rows + 1)
    pairs = cost.costs(start, stop)
    x = pairs / mean
    x = x * x
    x = x * x
    x = x * x
    score = x[:, 0].copy()
    for g in range(1, cost.world):  # in a fixed order: the same sum on every process
        score += x[:, g]
    score[~fits] = np.inf
    return pairs, score, np.where(fits, pairs.max(axis=1), np.inf)


def _mean(cost: PackCost, items: np.ndarray) -> float:
    """Mean pairs per rank, the same for every order: every document's pairs over the ranks."""
    return max(float(triangle(items, cost.window).sum()), 1.0) / cost.world


def _exact(cost: PackCost, items: np.ndarray, bound: float) -> np.ndarray | None:
    """The order of a row's few documents whose busiest rank computes least, if below ``bound``: documents placed
    left to right, level by level, dropping every prefix whose busiest rank already reaches ``bound`` (a document's
    pairs depend only on where it lies, and pairs only add up)."""
    k = len(items)
    prefixes, used = np.zeros((1, 0), dtype=np.int64), np.zeros((1, k), dtype=bool)
    stop, pairs = np.zeros(1, dtype=np.int64), np.zeros((1, cost.world))
    for _ in range(k):
        parent, doc = np.nonzero(~used)
        start = stop[parent]
        new = pairs[parent] + cost.costs(start[:, None], (start + items[doc])[:, None])
        keep = new.max(axis=1) < bound
        if not keep.any():
            return None
        parent, doc = parent[keep], doc[keep]
        prefixes = np.concatenate([prefixes[parent], doc[:, None]], axis=1)
        used = used[parent]
        used[np.arange(len(doc)), doc] = True
        stop, pairs = stop[parent] + items[doc], new[keep]
    return prefixes[int(pairs.max(axis=1).argmin())]


def _search(cost: PackCost, items: np.ndarray, starts: list[np.ndarray], steps: int) -> np.ndarray:
    """The local search of Note [Balanced packing] from ``starts`` (item orders), ``steps`` steps; the best order
    it saw."""
    rng = np.random.default_rng(0)
    while len(starts) < STARTS:
        starts.append(rng.permutation(starts[0]) if cost.rows == 1 else starts[0])
    orders, mean = np.array(starts), _mean(cost, items)
    pairs, score, busiest = _evaluate(cost, items, orders, mean)
    i = int(np.lexsort((score, busiest))[0])
    best, key = orders[i].copy(), (busiest[i], score[i])
    chains = np.arange(STARTS)
    for step in range(steps):
        if key[0] <= GOOD_ENOUGH * mean:
            break
        moved = _moves(rng, cost, items, orders, pairs)
        new_pairs, new_score, new_busiest = _evaluate(cost, items, moved, mean)
        pick = chains * MOVES + new_score.reshape(STARTS, MOVES).argmin(axis=1)
        take = new_score[pick] < score + THRESHOLD * cost.world * (1 - step / steps)
        orders[take], pairs[take], score[take] = moved[pick[take]], new_pairs[pick[take]], new_score[pick[take]]
        i = int(np.lexsort((new_score, new_busiest))[0])
        if (new_busiest[i], new_score[i]) < key:
            best, key = moved[i].copy(), (new_busiest[i], new_score[i])
    return best


def _moves(rng, cost: PackCost, items: np.ndarray, orders: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """``MOVES`` candidates per start: a swap of two items or a move of one, half of them of an item under the
    start's busiest rank, a third of them by one to three places."""
    count, k = orders.shape[0] * MOVES, orders.shape[1]
    base = np.repeat(orders, MOVES, axis=0)
    i = rng.integers(0, k, count)
    j = rng.integers(0, k - 1, count)
    j += j >= i
    parts = np.repeat(cost.rank_parts[pairs.argmax(axis=1)], MOVES, axis=0)
    position = parts[np.arange(count), rng.integers(0, parts.shape[1], count)] * cost.part
    position += rng.integers(0, cost.part, count)
    _, stop, _ = cost.spans(items[orders], orders >= len(items) - cost.rows + 1)
    under = np.minimum((np.repeat(stop, MOVES, axis=0) <= position[:, None]).sum(axis=1), k - 1)
    i = np.where(rng.random(count) < 0.5, under, i)
    near = np.clip(i + rng.integers(1, 4, count) * rng.choice((-1, 1), count), 0, k - 1)
    j = np.where(rng.random(count) < 0.3, near, j)
    j = np.where(j == i, (i + 1) % k, j)
    swap = rng.random(count) < 0.5
    keys = np.tile(np.arange(k, dtype=np.float64), (count, 1))
    rows = np.arange(count)
    keys[rows, i] = np.where(swap, j, j + np.where(j > i, 0.5, -0.5))
    keys[rows, j] = np.where(swap, i, keys[rows, j])
    return np.take_along_axis(base, np.argsort(keys, axis=1, kind="stable"), axis=1)
