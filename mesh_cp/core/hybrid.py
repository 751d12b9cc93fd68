"""The head-parallel x mesh plan: all-to-alls over heads inside a head group, Mesh-Attention across the ranks that
then hold the same heads, as frozen data.

Pure Python (no torch). The executor is :mod:`mesh_cp.runtime.heads`; the cost model is :mod:`mesh_cp.sim.hybrid`.

Note [Head-parallel x mesh plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``P = u x m`` CP ranks; CP rank ``r = g * u + i`` (``g < m``, ``i < u``)::

    P = 8, u = 2, m = 4 (inner tile 2 x 2)
                     g=0      g=1      g=2      g=3
    i=0  ranks        0        2        4        6       mesh group of rank 0: 0 2 4 6 (mesh ranks g = 0..3)
    i=1  ranks        1        3        5        7       mesh group of rank 1: 1 3 5 7
    head groups     {0,1}    {2,3}    {4,5}    {6,7}     u consecutive ranks: inside a node when u | ranks per node

Every CP rank holds ``S / P`` tokens of all ``H`` query heads (``Hkv`` K/V heads), its chunk of the layout over
``P`` ranks, as with a plain mesh; a head group's tokens are the chunk mesh rank ``g`` holds in the layout over
``m`` ranks (Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`). An all-to-all in the head group (and a
local reordering) turns that into the whole chunk, ``S / m`` tokens, with ``H / u`` query heads and
``max(Hkv / u, 1)`` K/V heads: K/V heads are split when ``u | Hkv`` and, when ``u > Hkv`` (``Hkv | u``), each is
first repeated ``u / Hkv`` times, so each rank receives the one K/V head its query heads use. The ``m`` ranks of a
mesh group then run the ordinary Mesh-Attention plan (:class:`~mesh_cp.core.plan.AttentionPlan`, the *inner*
plan) of ``Tiling(m, a, b)`` on that shape: a sequence of ``S`` tokens over ``m`` ranks. ``u = 1`` is the plain
mesh, ``a = 1`` (a ring over ``m``) is USP, ``m = 1`` is Ulysses.

*Bytes.* An all-to-all of a tensor of ``X`` bytes per rank in the head layout (``S / m`` tokens, the heads this
rank gets) sends ``X / u`` to each of the ``u - 1`` peers: ``(u - 1) / u * X``. The head-layout Q is as large as a
rank's Q chunk of the plain mesh (``C``): ``S / m * H / u = S / P * H``. Per phase::

    forward   in: q, k, v              back: out (+ lse, fp32, when the caller asks for it)
    backward  in: dO (+ the lse's gradient, fp32, when lse was returned)
              back: dq, dk, dv (the saved out and lse stay in the head layout: nothing resent)

all in the input dtype except the statistics. In units of ``C`` with ``r' = max(Hkv / u, 1) / (H / u)`` (the
inner plan's K/V ratio; ``r`` itself while ``u | Hkv``, ``u / H`` when K/V heads are repeated) each phase moves
``(2 + 2r')(u - 1) / u`` through the all-to-alls, inside a node when ``u`` divides the ranks per node, plus the
inner plan's ``2(a - 1) + 2r'(b - 1)`` forward (``3(a - 1) + 4r'(b - 1)`` backward with re-gather): the mesh of
``m`` ranks is the part that crosses nodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.options import Backward, Layout, Phase, Schedule, check_option
from mesh_cp.core.plan import AttentionPlan, AttentionShape, make_plan
from mesh_cp.core.tiling import Tiling


def _check_group(world: int, heads: int, rank: int) -> None:
    for name, value in (("world", world), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world % heads:
        raise ValueError(f"heads={heads} head-parallel ranks do not divide the CP group size P={world}; choose u | P")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the CP group of size {world}")


def head_group_ranks(world: int, heads: int, rank: int) -> tuple[int, ...]:
    """The ``u = heads`` CP ranks of ``rank``'s head group, in group-rank order: ``g * u + i'`` for ``i' < u``,
    where ``rank = g * u + i`` (Note [Head-parallel x mesh plan])."""
    _check_group(world, heads, rank)
    start = rank - rank % heads
    return tuple(range(start, start + heads))


def mesh_group_ranks(world: int, heads: int, rank: int) -> tuple[int, ...]:
    """The ``m = world / heads`` CP ranks of ``rank``'s mesh group, in mesh-rank order: ``g' * u + i`` for
    ``g' < m``, where ``rank = g * u + i``; ``rank`` is mesh rank ``g`` of it."""
    _check_group(world, heads, rank)
    return tuple(range(rank % heads, world, heads))


def valid_heads(world: int, shape: AttentionShape) -> tuple[int, ...]:
    """Every head-parallel degree ``u`` the hybrid can use for ``shape`` on ``world`` ranks: ``u | P``,
    ``u | heads``, and ``u`` and ``kv_heads`` dividing one another (sequence lengths aside)."""
    kv = shape.kv_heads
    return tuple(
        u for u in range(1, world + 1) if world % u == 0 and shape.heads % u == 0 and (kv % u == 0 or u % kv == 0)
    )


def hybrid_unavailable(world: int, heads: int, shape: AttentionShape, *, layout: Layout = "zigzag") -> str | None:
    """Why ``u = heads`` head-parallel ranks cannot run ``shape`` (per-rank sizes, ``S / P`` tokens) on ``world``
    ranks, with the fix, or ``None`` when they can."""
    check_option("layout", layout)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        return f"heads (the head-parallel degree u) must be a positive int, got {heads!r}"
    choices = f"choose u among {list(valid_heads(world, shape))}"
    if world % heads:
        return f"heads={heads} head-parallel ranks do not divide the CP group size P={world}; {choices}"
    if shape.heads % heads:
        return f"heads={heads} head-parallel ranks do not divide the {shape.heads} query heads; {choices}"
    kv = shape.kv_heads
    if kv % heads and heads % kv:
        return (
            f"heads={heads} head-parallel ranks and the {kv} K/V heads must divide one another (K/V heads are split "
            f"when u | kv_heads, repeated when kv_heads | u); {choices}"
        )
    seq, parts = shape.seq_local * world, 2 * world if layout == "zigzag" else world
    if seq % parts:
        return (
            f"seq_len {seq} ({shape.seq_local} per rank x P={world}) must be a multiple of "
            f"{'2*P' if layout == 'zigzag' else 'P'}={parts} for the {layout} layout; pad the sequence to "
            f"{-(-seq // parts) * parts}"
        )
    return None


def inner_shape(heads: int, shape: AttentionShape) -> AttentionShape:
    """The per-rank shape after the head group's all-to-all: ``S / m = u * seq_local`` tokens, ``H / u`` query
    heads, ``max(Hkv / u, 1)`` K/V heads (assumes :func:`hybrid_unavailable` found nothing)."""
    return AttentionShape(
        batch=shape.batch,
        seq_local=shape.seq_local * heads,
        heads=shape.heads // heads,
        kv_heads=max(shape.kv_heads // heads, 1),
        head_dim=shape.head_dim,
        itemsize=shape.itemsize,
    )


@dataclass(frozen=True)
class HybridPlan:
    """One head-parallel x mesh attention call as data: the all-to-alls of the head group and the inner plan of the
    mesh group (Note [Head-parallel x mesh plan]). Build it with :func:`make_hybrid_plan`."""

    heads: int
    """``u``: head-parallel ranks per head group (1: the plain mesh)."""
    plan: AttentionPlan
    """The inner Mesh-Attention plan of the ``m`` ranks of a mesh group, on :func:`inner_shape`."""
    shape: AttentionShape
    """Per-rank sizes of the call's inputs: ``S / P`` tokens, all heads."""

    def __post_init__(self) -> None:
        if self.plan.shape != inner_shape(self.heads, self.shape):
            raise ValueError(
                f"the inner plan's shape {self.plan.shape} is not the head layout of {self.shape} with heads="
                f"{self.heads}; build the plan with make_hybrid_plan"
            )

    @property
    def world(self) -> int:
        """``P = u * m``."""
        return self.heads * self.plan.tiling.world

    @property
    def tiling(self) -> Tiling:
        """The inner ``a x b`` tiling of the ``m`` ranks of a mesh group."""
        return self.plan.tiling

    def all_to_alls(self, phase: Phase, *, lse: bool = False) -> tuple[tuple[str, int], ...]:
        """``(tensor, X)`` for every all-to-all of ``phase`` in issue order, ``X`` the tensor's bytes per rank in the
        head layout (a replicated K/V counted with its repeats); ``lse``: the call returns the lse. None for ``u = 1``."""
        check_option("phase", phase)
        if self.heads == 1:
            return ()
        s = self.plan.shape
        q_bytes, kv_bytes = self.plan.chunk_bytes()
        stats = s.stats_elems * s.acc_itemsize
        if phase == "forward":
            moves = [("q", q_bytes), ("k", kv_bytes // 2), ("v", kv_bytes // 2), ("out", q_bytes)]
            return tuple(moves + ([("lse", stats)] if lse else []))
        moves = [("dout", q_bytes), *([("dlse", stats)] if lse else [])]
        return tuple(moves + [("dq", q_bytes), ("dk", kv_bytes // 2), ("dv", kv_bytes // 2)])

    def a2a_bytes(self, phase: Phase, lse: bool = False) -> int:
        """Bytes one rank sends in the all-to-alls of ``phase``: ``(u - 1) / u`` of each tensor (``X / u`` to each
        peer). The head-layout sizes are multiples of ``u`` (``S / m = u * S / P`` tokens)."""
        return sum((self.heads - 1) * (nbytes // self.heads) for _, nbytes in self.all_to_alls(phase, lse=lse))

    def bytes_sent(self, phase: Phase, lse: bool = False) -> int:
        """Bytes one rank sends in ``phase``: its all-to-alls and its share of the inner mesh."""
        return self.a2a_bytes(phase, lse) + self.plan.bytes_sent(phase)

    def traffic_units(self, phase: Phase) -> float:
        """Note [Head-parallel x mesh plan]'s formula in units of ``C`` (statistics left out): the all-to-alls'
        ``(2 + 2r')(u - 1) / u`` plus the inner plan's :meth:`~mesh_cp.core.plan.AttentionPlan.traffic_units`."""
        u = self.heads
        return (2 + 2 * self.plan.shape.kv_ratio) * (u - 1) / u + self.plan.traffic_units(phase)


@functools.lru_cache(maxsize=256)
def make_hybrid_plan(
    heads: int,
    tiling: Tiling,
    shape: AttentionShape,
    *,
    causal: bool,
    layout: Layout,
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
    link_cost: tuple[float, float] = (1.0, 1.0),
    buffer_budget: int | None = None,
    mask: AttentionMask | None = None,
) -> HybridPlan:
    """The :class:`HybridPlan` of ``u = heads`` head-parallel ranks and the inner ``tiling`` of ``m`` ranks
    (``P = u * m``), for ``shape`` holding the per-rank sizes of the inputs (``S / P`` tokens, all heads).

    The other arguments are the inner plan's (:func:`~mesh_cp.core.plan.make_plan`); ``mask`` is over the global
    sequence of ``S`` tokens. Raises ``ValueError`` naming the value and the fix when ``u`` does not divide the
    query heads, when ``u`` and the K/V heads do not divide one another, or when the sequence cannot be laid out
    over the ``m`` mesh ranks (:func:`hybrid_unavailable`). Cached: plans are immutable.
    """
    if not isinstance(tiling, Tiling):
        raise ValueError(f"tiling must be a mesh_cp.core.Tiling of the m = P / u mesh ranks, got {tiling!r}")
    world = heads * tiling.world if isinstance(heads, int) and not isinstance(heads, bool) else 0
    reason = hybrid_unavailable(world, heads, shape, layout=layout)
    if reason is not None:
        raise ValueError(reason)
    inner = make_plan(
        tiling,
        inner_shape(heads, shape),
        causal=causal,
        layout=layout,
        backward=backward,
        schedule=schedule,
        link_cost=link_cost,
        buffer_budget=buffer_budget,
        mask=mask,
    )
    return HybridPlan(heads=heads, plan=inner, shape=shape)
