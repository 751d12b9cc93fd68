"""Split documents: a packed row laid out per-document zig-zag, so that every rank does the same share of every
document's pairs, whatever the mix of lengths.

::

    mask, (source,) = split_documents([[20815, 21973, 9518, ...]], seq_len=131072, world=16)
    row = packed_row[source]            # token g of the split row is token source[g] of the packed row

Note [Split documents]
~~~~~~~~~~~~~~~~~~~~~~
The zig-zag layout balances one causal sequence: rank ``r`` holds half-chunks ``r`` and ``2P-1-r`` of the ``2P``
equal half-chunks (Note [Zig-zag causal balance] in :mod:`mesh_cp.core.blocks`). A packed row is not one sequence:
a rank whose half-chunks hold the late parts of long documents computes more than one holding their starts, and
reordering whole documents cannot always even it out (Note [Balanced packing] in :mod:`mesh_cp.core.balance`).
Split documents are laid out as TransformerEngine's THD format lays packed sequences out for context parallelism:
document ``d`` of ``n`` tokens is cut into ``2P`` parts of ``n // 2P`` or ``n // 2P + 1`` tokens in order, part
``h`` goes to half-chunk ``h`` after part ``h`` of the documents before it, and what a half-chunk has left at its
end is padding. A rank then holds parts ``r`` and ``2P-1-r`` of every document: with equal parts of ``p`` tokens
every block of the plan holds ``2 p^2`` of each document's pairs (``2 p^2 + p`` on the diagonal), so every rank of
any tile computes the same pairs up to the parts' rounding.

A document's parts lie in increasing global order, so "the key is not after the query" in global positions is the
document's own causal order, and :class:`~mesh_cp.core.masks.AttentionMask` takes the layout as its spans plus
:attr:`~mesh_cp.core.masks.AttentionMask.parts`, the document of each span. Everything that counts pairs, cuts tiles
or builds segments reads documents through their spans. A half-chunk holds one part of each document, so a tile
(never across two half-chunks) holds at most one, and a masked block is one varlen call whose sequences are the
parts in its queries, each over the key parts it sees laid end to end (Note [Block segments] in
:mod:`mesh_cp.core.segments`). Positions count inside the document (what RoPE needs) and
labels are shifted in the document's order before the tokens move (:func:`mesh_cp.runtime.batch.shard_batch`). A
window is not taken: it counts tokens inside a document, which global positions no longer do.

The ``n mod 2P`` longer parts of a document go to the half-chunks with the fewest tokens so far (the lowest index
first), so the half-chunks' fills never differ by more than one token and the longest is
``ceil(total / 2P)``: the split row fits wherever the packed row fits.

Note [THD layout]
~~~~~~~~~~~~~~~~~
TransformerEngine's THD format for context parallelism (what Megatron's ``get_thd_batch_on_this_cp_rank`` hands
each rank, through ``thd_get_partitioned_indices``) pads every document to a multiple of ``2P`` (``cu_seqlens_padded``),
cuts it into ``2P`` equal parts and gives rank ``r`` parts ``r`` and ``2P-1-r`` of every document, in the order
``[d0 part r, d0 part 2P-1-r, d1 part r, ...]``. With parts of equal length and the padded documents filling the row,
the split layout of the padded documents holds the same tokens on every rank: half-chunk ``h`` is part ``h`` of
every document in turn, with no padding, so rank ``r`` holds ``[d0 part r, d1 part r, ..., d0 part 2P-1-r, ...]``.
Only the local order differs: :func:`thd_layout` gives, per rank, the THD position of each of its tokens in the
split layout's order (one ``index_select`` each way around the attention). A document's padding is the end of the
document there: no real token of it attends the padding (it comes later), and the padding's rows carry no loss.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from mesh_cp.core.layout import check_seq_len
from mesh_cp.core.masks import AttentionMask, Range


def split_documents(
    lengths: Sequence[Sequence[int]], *, seq_len: int, world: int
) -> tuple[AttentionMask, list[list[int]]]:
    """The split layout (Note [Split documents]) of packed rows of documents (``lengths[b]``: the documents of row
    ``b``, back to back from position 0, padding after them) over ``world`` ranks of the zig-zag layout: the
    :class:`AttentionMask` of the split rows, and per row ``source``, a permutation of ``range(seq_len)``: position
    ``g`` of the split row holds position ``source[g]`` of the packed row (its padding where the split row pads)."""
    check_seq_len(seq_len, world, "zigzag")
    documents, parts, sources = [], [], []
    for row, row_lengths in enumerate(lengths):
        lengths_row = [int(n) for n in row_lengths]
        if any(n < 1 for n in lengths_row) or sum(lengths_row) > seq_len:
            raise ValueError(
                f"row {row}: documents {lengths_row} must be positive lengths that fit the row's {seq_len} tokens "
                f"({sum(lengths_row)} given)"
            )
        spans, docs, source = _split_row(lengths_row, seq_len, 2 * world)
        documents.append(spans)
        parts.append(docs)
        sources.append(source)
    return AttentionMask(documents=tuple(documents), parts=tuple(parts)), sources


def _split_row(lengths: list[int], seq_len: int, pieces: int) -> tuple[tuple[Range, ...], tuple[int, ...], list[int]]:
    size = seq_len // pieces
    fill = [0] * pieces  # tokens placed in each half-chunk so far
    placed: list[list[tuple[int, int, int]]] = [[] for _ in range(pieces)]  # (document, packed start, length)
    start = 0
    for doc, n in enumerate(lengths):
        base, extra = divmod(n, pieces)
        longer = set(heapq.nsmallest(extra, range(pieces), key=lambda h: (fill[h], h)))
        for h in range(pieces):
            count = base + (h in longer)
            if count:
                placed[h].append((doc, start, count))
                fill[h] += count
                start += count
    spans, docs, source = [], [], []
    padding = iter(range(sum(lengths), seq_len))  # the packed row's padding, after its documents
    for h in range(pieces):
        at = h * size
        for doc, packed, count in placed[h]:
            spans.append((at, at + count))
            docs.append(doc)
            source.extend(range(packed, packed + count))
            at += count
        source.extend(next(padding) for _ in range(size - fill[h]))
    return tuple(spans), tuple(docs), source


def thd_partitioned_indices(cu_seqlens_padded: Sequence[int], total: int, world: int, rank: int) -> list[int]:
    """The packed row's positions that rank ``rank`` of ``world`` holds in TransformerEngine's THD layout, in its
    local order (what ``tex.thd_get_partitioned_indices(cu_seqlens_padded, total, world, rank)`` returns; Note [THD
    layout])."""
    bounds = [int(b) for b in cu_seqlens_padded]
    _check_thd(bounds, total, world)
    out = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        part = (stop - start) // (2 * world)
        for piece in (rank, 2 * world - 1 - rank):
            out.extend(range(start + piece * part, start + (piece + 1) * part))
    return out


def thd_layout(cu_seqlens_padded: Sequence[int], *, world: int, rank: int) -> tuple[AttentionMask, list[int]]:
    """The split layout of a THD row (Note [THD layout]): its :class:`AttentionMask` (the padded documents, split) and
    ``order``: the THD local position on ``rank`` of each token of its split-layout shard, in that shard's order
    (``shard = thd_tokens[order]``)."""
    bounds = [int(b) for b in cu_seqlens_padded]
    total = bounds[-1]
    thd = thd_partitioned_indices(bounds, total, world, rank)  # checks the boundaries
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    mask, (source,) = split_documents([lengths], seq_len=total, world=world)
    half = total // (2 * world)
    where = {packed: j for j, packed in enumerate(thd)}
    mine = (g for h in (rank, 2 * world - 1 - rank) for g in range(h * half, (h + 1) * half))
    return mask, [where[source[g]] for g in mine]


def _check_thd(bounds: list[int], total: int, world: int) -> None:
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(n < 1 or n % (2 * world) for n in lengths):
        raise ValueError(
            f"cu_seqlens_padded {bounds} must rise from 0 to the row's {total} tokens in documents padded to a "
            f"multiple of 2*CP = {2 * world} (got lengths {lengths}): pad every document to a multiple of {2 * world} "
            "and the row to their sum"
        )
