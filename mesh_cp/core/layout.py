"""Sequence layouts: which global tokens each CP rank holds, in which local order.

Pure Python (no torch). ``"contiguous"``: rank ``g`` holds chunk ``g`` of ``P``. ``"zigzag"``: rank ``g``
holds half-chunks ``g`` and ``2P-1-g`` of ``2P`` (Note [Zig-zag causal balance] in :mod:`mesh_cp.core.plan`
says why).
"""

from __future__ import annotations

from mesh_cp.core.options import Layout, check_layout

__all__ = [
    "check_layout",
    "check_seq_len",
    "chunk_ranges",
    "global_ranges",
    "layout_permutation",
    "local_positions",
]


def check_seq_len(seq_len: int, world: int, layout: Layout) -> None:
    """Raise ``ValueError`` unless a global ``seq_len`` can be laid out over ``world`` ranks."""
    check_layout(layout)
    parts = 2 * world if layout == "zigzag" else world
    if seq_len < parts or seq_len % parts:
        padded = max(parts, -(-seq_len // parts) * parts)
        raise ValueError(
            f"seq_len {seq_len} must be a positive multiple of {parts} "
            f"({'2*P' if layout == 'zigzag' else 'P'} for the {layout} layout with P={world}); "
            f"pad the sequence to {padded}"
        )


def chunk_ranges(seq_len: int, world: int, rank: int, layout: Layout) -> tuple[tuple[int, int], ...]:
    """Global token ranges ``[start, stop)`` held by ``rank``, in local order.

    ``contiguous``: one range, chunk ``rank``. ``zigzag``: half-chunks ``rank`` and
    ``2P-1-rank`` (see Note [Zig-zag causal balance]).
    """
    check_seq_len(seq_len, world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the CP group of size {world}")
    if layout == "contiguous":
        size = seq_len // world
        return ((rank * size, (rank + 1) * size),)
    half = seq_len // (2 * world)
    second = 2 * world - 1 - rank
    return ((rank * half, (rank + 1) * half), (second * half, (second + 1) * half))


def local_positions(seq_len: int, world: int, rank: int, layout: Layout) -> list[int]:
    """Global positions of the tokens ``rank`` holds, in local order."""
    return [p for start, stop in chunk_ranges(seq_len, world, rank, layout) for p in range(start, stop)]


def layout_permutation(seq_len: int, world: int, layout: Layout) -> list[int]:
    """Global positions in the order of the concatenated local shards of ranks ``0..P-1``."""
    return [p for rank in range(world) for p in local_positions(seq_len, world, rank, layout)]


def global_ranges(
    seq_len: int, world: int, chunk: int, layout: Layout, local: tuple[int, int]
) -> tuple[tuple[int, int], ...]:
    """The global ``[start, stop)`` ranges of the local rows ``local = [start, stop)`` of ``chunk``."""
    out, offset = [], 0
    for g0, g1 in chunk_ranges(seq_len, world, chunk, layout):
        lo, hi = max(local[0], offset), min(local[1], offset + g1 - g0)
        if lo < hi:
            out.append((g0 + lo - offset, g0 + hi - offset))
        offset += g1 - g0
    return tuple(out)
