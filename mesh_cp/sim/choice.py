"""The automatic choice of the head-parallel degree ``u`` and the tile: every candidate ``(u, a x b)`` simulated,
the fastest that fits the memory budget chosen, and why (no torch). :func:`mesh_cp.auto_mesh` builds a mesh with it.

Note [Choice of the layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`choose` simulates every ``(u, a x b)`` with ``u | P``, ``u | heads``, ``u`` and ``kv_heads`` dividing one
another and ``a * b = P / u`` (:func:`candidates`; only ``u = head_parallel`` when that is given, ``1`` for the
plain meshes) with :func:`mesh_cp.sim.simulate`, and takes the fastest within the memory budget; equal times go to
the fewest bytes across nodes, then the fewest bytes. The candidates fall into four kinds (:func:`candidate_kind`):
the plain ``mesh`` (``u = 1``, the ring included), ``usp`` (``a = 1``: Ulysses x ring), ``ulysses`` (``m = 1``)
and ``hybrid`` (the rest). It is not always a hybrid: once the mesh hides its communication behind the compute,
the time the head group's all-to-alls add (they overlap nothing) is what tells candidates apart, and the plain
mesh, which has none, is fastest by a fraction of a percent; the hybrid then still sends far fewer bytes across
nodes, which the reason reports beside the times.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

from mesh_cp.core import (
    AttentionPlan,
    AttentionShape,
    Tiling,
    check_head_parallel,
    check_seq_len,
    factorizations,
    head_parallel_unavailable,
    make_plan,
    valid_head_parallel,
)
from mesh_cp.core.options import Backward, Layout, Schedule, positive_int, positive_or_none
from mesh_cp.sim.model import SimResult, simulate
from mesh_cp.sim.placement import describe_links, link_cost
from mesh_cp.sim.topology import Topology

Kind = Literal["mesh", "hybrid", "usp", "ulysses"]
_KIND_NAMES = {"mesh": "mesh", "hybrid": "hybrid", "usp": "USP", "ulysses": "Ulysses"}


class Choice(NamedTuple):
    """What :func:`choose` chose: ``u, tiling, reason = choose(...)``."""

    head_parallel: int
    """``u``: ranks per head group (1: a plain mesh)."""
    tiling: Tiling
    """The ``a x b`` tiling of the ``P / u`` ranks of a mesh group."""
    reason: str
    """The winner's predicted time and bytes across nodes beside the best of each kind, and where its groups sit."""


def candidates(
    world: int, shape: AttentionShape, *, head_parallel: int | None = None
) -> tuple[tuple[int, Tiling], ...]:
    """Every ``(u, Tiling(P / u, a, b))`` that can run ``shape`` (per-rank sizes) on ``world`` ranks
    (:func:`mesh_cp.core.valid_head_parallel`), ``u`` ascending, then ``a``; only ``u = head_parallel`` when given
    (``ValueError`` with the fix when that ``u`` cannot run it, :func:`mesh_cp.core.check_head_parallel`)."""
    positive_int("world", world, what="ranks of the CP group")
    if head_parallel is not None:
        check_head_parallel(world, head_parallel, shape)
    degrees = valid_head_parallel(world, shape) if head_parallel is None else (head_parallel,)
    return tuple((u, Tiling(world=world // u, a=a, b=b)) for u in degrees for a, b in factorizations(world // u))


def plan_for_topology(
    head_parallel: int,
    tiling: Tiling,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
) -> AttentionPlan:
    """The plan of ``u = head_parallel`` around ``tiling`` for ``shape`` (per-rank sizes), with the overlapped
    schedule's moves ordered by the rings' link speeds on ``topology`` (:func:`mesh_cp.sim.link_cost`): the plan
    every candidate is simulated with."""
    return make_plan(
        tiling,
        shape,
        causal=causal,
        layout=layout,
        backward=backward,
        schedule=schedule,
        link_cost=link_cost(head_parallel, tiling, topology),
        head_parallel=head_parallel,
    )


def simulate_candidates(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
    head_parallel: int | None = None,
) -> dict[tuple[int, Tiling], SimResult]:
    """:func:`mesh_cp.sim.simulate` of every :func:`candidates` ``(u, tiling)`` of ``world`` ranks (``shape``:
    per-rank sizes; ``head_parallel``: only that ``u``, ``1`` for the plain meshes)."""
    positive_int("world", world, what="ranks of the CP group")
    check_seq_len(shape.seq_local * world, world, layout)
    return dict(_simulate_candidates(world, shape, topology, causal, layout, backward, schedule, head_parallel))


@functools.lru_cache(maxsize=64)
def _simulate_candidates(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    causal: bool,
    layout: Layout,
    backward: Backward,
    schedule: Schedule,
    head_parallel: int | None,
) -> tuple[tuple[tuple[int, Tiling], SimResult], ...]:
    options = {"causal": causal, "layout": layout, "backward": backward, "schedule": schedule}
    return tuple(
        ((u, t), simulate(plan_for_topology(u, t, shape, topology, **options), topology))
        for u, t in candidates(world, shape, head_parallel=head_parallel)
    )


# ----------------------------------------------------------------------------------------------
# Choice


def candidate_kind(head_parallel: int, tiling: Tiling) -> Kind:
    """``"mesh"`` (``u = 1``), ``"ulysses"`` (``m = 1``), ``"usp"`` (``a = 1``) or ``"hybrid"``."""
    if head_parallel == 1:
        return "mesh"
    if tiling.world == 1:
        return "ulysses"
    return "usp" if tiling.a == 1 else "hybrid"


def candidate_label(head_parallel: int, tiling: Tiling) -> str:
    """``"tile 4x8"`` for a plain mesh, else ``"tile 4x8 with head_parallel=8"``: the arguments of
    :meth:`mesh_cp.CPMesh.create` that build it."""
    return f"tile {tiling}" if head_parallel == 1 else f"tile {tiling} with head_parallel={head_parallel}"


def best_of_kind(results: dict[tuple[int, Tiling], SimResult], kind: Kind) -> tuple[int, Tiling] | None:
    """The fastest candidate of ``kind`` in ``results`` (ties: fewest bytes across nodes, then fewest bytes), or
    ``None`` when there is none."""
    keys = [key for key in results if candidate_kind(*key) == kind]
    return min(keys, key=lambda key: _rank_key(key, results[key]), default=None)


def _rank_key(key: tuple[int, Tiling], result: SimResult) -> tuple:
    return (result.time, result.traffic.inter, result.traffic.total, key[0], key[1].a)


def choose(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
    memory_budget: int | None = None,
    head_parallel: int | None = None,
) -> Choice:
    """``(u, tiling, reason)``: the head-parallel degree and tile with the fastest predicted forward + backward
    within ``memory_budget`` bytes per rank (``None``: no limit), among every :func:`candidates` (only
    ``u = head_parallel`` when given; ``1`` chooses a plain mesh); see Note [Choice of the layout]. ``shape`` holds
    per-rank sizes. The reason names the winner (:func:`candidate_label`), its predicted time and bytes across
    nodes, the same for the best plain mesh, hybrid, USP and Ulysses it beat, and where its groups sit.
    """
    positive_or_none("memory_budget", memory_budget, unit="bytes")
    options = {"causal": causal, "layout": layout, "backward": backward, "schedule": schedule}
    results = simulate_candidates(world, shape, topology, **options, head_parallel=head_parallel)
    fits = {key: r for key, r in results.items() if memory_budget is None or r.memory <= memory_budget}
    if not fits:
        least = min(results, key=lambda key: results[key].memory)
        raise ValueError(
            f"memory_budget {memory_budget} bytes is below the peak of every tile of {world} ranks; the least is "
            f"{results[least].memory} bytes ({candidate_label(*least)}); raise the budget or shorten the "
            f"sequence per rank"
        )
    chosen = min(fits, key=lambda key: _rank_key(key, fits[key]))
    return Choice(*chosen, _reason(chosen, results, fits, shape, topology))


def _reason(
    chosen: tuple[int, Tiling],
    results: dict[tuple[int, Tiling], SimResult],
    fits: dict[tuple[int, Tiling], SimResult],
    shape: AttentionShape,
    topology: Topology,
) -> str:
    """The reason of :func:`choose`: the winner, then each kind's best beside it (Note [Choice of the layout])."""
    c = shape.chunk_elems * shape.itemsize
    win = results[chosen]
    world = chosen[0] * chosen[1].world
    kind = candidate_kind(*chosen)
    suffix = f" ({_KIND_NAMES[kind]})" if kind in ("usp", "ulysses") else ""
    parts = [
        f"{candidate_label(*chosen)}{suffix}: predicted {win.time * 1e3:.3g} ms fwd+bwd, {win.traffic.inter / c:.3g} "
        f"C per rank across nodes fwd+bwd (C = a rank's Q chunk)"
    ]
    ring = (1, Tiling(world=world, a=1, b=world))
    if ring != chosen and ring in results:
        parts.append(f"vs ring 1x{world} {results[ring].time * 1e3:.3g} ms ({results[ring].time / win.time:.2f}x)")
    for kind in ("mesh", "hybrid", "usp", "ulysses"):
        name, best = _KIND_NAMES[kind], best_of_kind(fits, kind)
        if best == chosen:
            parts.append(f"it is the best {name}")
        elif best is not None:
            other = results[best]
            parts.append(
                f"the best {name} {candidate_label(*best)}: {other.time * 1e3:.3g} ms ({other.time / win.time:.3f}x), "
                f"{other.traffic.inter / c:.3g} C"
            )
        elif best_of_kind(results, kind) is not None:
            parts.append(f"every {name} is over the memory budget")
        elif kind == "ulysses" and (why := head_parallel_unavailable(world, world, shape)) is not None:
            parts.append(f"Ulysses unavailable ({why.split('; ')[0]})")  # u = P; its first clause: no "; " inside
    parts.append(describe_links(*chosen, topology))
    over = len(results) - len(fits)
    if over:
        parts.append(f"{over} candidate(s) over the memory budget")
    return "; ".join(parts)
