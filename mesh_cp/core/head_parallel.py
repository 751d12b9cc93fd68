"""The head-parallel degree ``u`` of a plan: which ranks exchange heads, which run the mesh, and what ``u`` can be.

Pure Python (no torch). The plan that carries ``u`` is :class:`~mesh_cp.core.plan.AttentionPlan`; the executor of
its head exchange is :mod:`mesh_cp.runtime.heads`.

Note [Head-parallel x mesh plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``P = u x m`` CP ranks; CP rank ``r = g * u + i`` (``g < m``, ``i < u``)::

    P = 8, u = 2, m = 4 (tile 2 x 2 of the m mesh ranks)
                     g=0      g=1      g=2      g=3
    i=0  ranks        0        2        4        6       mesh group of rank 0: 0 2 4 6 (mesh ranks g = 0..3)
    i=1  ranks        1        3        5        7       mesh group of rank 1: 1 3 5 7
    head groups     {0,1}    {2,3}    {4,5}    {6,7}     u consecutive ranks: inside a node when u | ranks per node

Every CP rank holds ``S / P`` tokens of all ``H`` query heads (``Hkv`` K/V heads), its chunk of the layout over
``P`` ranks, as with a plain mesh; a head group's tokens are the chunk mesh rank ``g`` holds in the layout over
``m`` ranks (Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`). An all-to-all in the head group (and a
local reordering) turns that into the whole chunk, ``S / m`` tokens, with ``H / u`` query heads and
``max(Hkv / u, 1)`` K/V heads (:func:`mesh_shape`): K/V heads are split when ``u | Hkv`` and, when ``u > Hkv``
(``Hkv | u``), each is first repeated ``u / Hkv`` times, so each rank receives the one K/V head its query heads
use. The ``m`` ranks of a mesh group then run the blocks of ``Tiling(m, a, b)`` on that shape: a sequence of ``S``
tokens over ``m`` ranks. One plan holds both parts (the head exchange is empty for ``u = 1``): ``u = 1`` is the
plain mesh, ``a = 1`` (a ring over ``m``) is USP, ``m = 1`` is Ulysses.

*Bytes.* An all-to-all of a tensor of ``X`` bytes per rank in the head layout (``S / m`` tokens, the heads this
rank gets) sends ``X / u`` to each of the ``u - 1`` peers: ``(u - 1) / u * X``. The head-layout Q is as large as a
rank's Q chunk of the plain mesh (``C``): ``S / m * H / u = S / P * H``. Per phase::

    forward   in: q, k, v              back: out (+ lse, fp32, when the caller asks for it)
    backward  in: dO (+ the lse's gradient, fp32, when lse was returned and a loss reads it)
              back: dq, dk, dv (the saved out and lse stay in the head layout: nothing resent)

all in the input dtype except the statistics. In units of ``C`` with ``r' = max(Hkv / u, 1) / (H / u)`` (the
mesh part's K/V ratio; ``r`` itself while ``u | Hkv``, ``u / H`` when K/V heads are repeated) each phase moves
``(2 + 2r')(u - 1) / u`` through the all-to-alls, inside a node when ``u`` divides the ranks per node, plus the
mesh's ``2(a - 1) + 2r'(b - 1)`` forward (``3(a - 1) + 4r'(b - 1)`` backward with re-gather): the mesh of
``m`` ranks is the part that crosses nodes.
"""

from __future__ import annotations

from typing import NamedTuple

from mesh_cp.core.options import positive_int
from mesh_cp.core.shape import AttentionShape


class HeadCounts(NamedTuple):
    """The query and K/V head counts of a layer: what the checks below read of an :class:`AttentionShape`, for
    callers that know only these (a model's attention layer before any call)."""

    heads: int
    kv_heads: int


def head_parallel_unavailable(
    world: int, head_parallel: object, shape: AttentionShape | HeadCounts | None = None
) -> str | None:
    """Why ``u = head_parallel`` cannot split a CP group of ``world`` ranks (and, given ``shape``, the per-rank
    sizes of a call or the :class:`HeadCounts` of a layer, the query and K/V heads of that call), with the fix;
    ``None`` when it can. The one check of
    the head-parallel degree: :meth:`mesh_cp.CPMesh.create`, the config block, the plan and the cost model use it.
    """
    u = head_parallel
    if isinstance(u, bool) or not isinstance(u, int) or u < 1:
        return f"head_parallel (the head-parallel degree u) must be a positive int, got {u!r}; 1 is the plain mesh"
    if world % u:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        return f"head_parallel={u} does not divide the CP group size P={world}; choose one of {divisors}"
    reason = None if shape is None else _heads_unavailable(u, shape)
    return None if reason is None else f"{reason}; choose head_parallel among {list(valid_head_parallel(world, shape))}"


def _heads_unavailable(u: int, shape: AttentionShape | HeadCounts) -> str | None:
    """Why ``u`` cannot split the query heads of ``shape`` and split or repeat its K/V heads (no fix named)."""
    kv = shape.kv_heads
    if shape.heads % u:
        return f"head_parallel={u} does not divide the {shape.heads} query heads"
    if kv % u and u % kv:
        return (
            f"head_parallel={u} and the {kv} K/V heads must divide one another (K/V heads are split when "
            f"u | kv_heads, repeated when kv_heads | u)"
        )
    return None


def check_head_parallel(world: int, head_parallel: object, shape: AttentionShape | HeadCounts | None = None) -> int:
    """``head_parallel`` when :func:`head_parallel_unavailable` finds nothing; else ``ValueError`` with its reason."""
    reason = head_parallel_unavailable(world, head_parallel, shape)
    if reason is not None:
        raise ValueError(reason)
    return head_parallel


def valid_head_parallel(world: int, shape: AttentionShape | HeadCounts) -> tuple[int, ...]:
    """Every head-parallel degree ``u`` that can run ``shape`` on ``world`` ranks: ``u | P``, ``u | heads``, and ``u``
    and ``kv_heads`` dividing one another (the checks of :func:`head_parallel_unavailable`)."""
    return tuple(u for u in range(1, world + 1) if world % u == 0 and _heads_unavailable(u, shape) is None)


def mesh_shape(head_parallel: int, shape: AttentionShape) -> AttentionShape:
    """The per-rank shape after the head group's all-to-all: ``S / m = u * seq_local`` tokens, ``H / u`` query
    heads, ``max(Hkv / u, 1)`` K/V heads; ``shape`` itself for ``u = 1``."""
    if head_parallel == 1:
        return shape
    return AttentionShape(
        batch=shape.batch,
        seq_local=shape.seq_local * head_parallel,
        heads=shape.heads // head_parallel,
        kv_heads=max(shape.kv_heads // head_parallel, 1),
        head_dim=shape.head_dim,
        itemsize=shape.itemsize,
    )


def head_group_ranks(world: int, head_parallel: int, rank: int) -> tuple[int, ...]:
    """The ``u = head_parallel`` CP ranks of ``rank``'s head group, in group-rank order: ``g * u + i'`` for
    ``i' < u``, where ``rank = g * u + i`` (Note [Head-parallel x mesh plan])."""
    _check_rank(world, head_parallel, rank)
    start = rank - rank % head_parallel
    return tuple(range(start, start + head_parallel))


def mesh_group_ranks(world: int, head_parallel: int, rank: int) -> tuple[int, ...]:
    """The ``m = world / u`` CP ranks of ``rank``'s mesh group, in mesh-rank order: ``g' * u + i`` for ``g' < m``,
    where ``rank = g * u + i``; ``rank`` is mesh rank ``g`` of it."""
    _check_rank(world, head_parallel, rank)
    return tuple(range(rank % head_parallel, world, head_parallel))


def _check_rank(world: int, head_parallel: int, rank: int) -> None:
    positive_int("world", world, what="ranks of the CP group")
    check_head_parallel(world, head_parallel)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the CP group of size {world}")
