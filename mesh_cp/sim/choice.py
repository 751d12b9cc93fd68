"""The automatic tile choice: every factorisation ``a x b`` of the CP size simulated, the fastest that fits
the memory budget chosen, and why (no torch). :func:`choose_tile` chooses among plain meshes;
:func:`choose_hybrid` also among head-parallel x mesh hybrids (Note [Hybrid choice]). :func:`mesh_cp.auto_mesh`
builds a mesh with the latter.

Note [Hybrid choice]
~~~~~~~~~~~~~~~~~~~~
:func:`choose_hybrid` simulates every ``(u, a x b)`` with ``u | P``, ``u | heads``, ``u`` and ``kv_heads``
dividing one another and ``a * b = P / u`` (:func:`hybrid_candidates`) with :func:`mesh_cp.sim.simulate_hybrid`,
and takes the fastest within the memory budget; equal times go to the fewest bytes across nodes, then the fewest
bytes. The candidates fall into four kinds (:func:`hybrid_kind`): the plain ``mesh`` (``u = 1``, the ring
included), ``usp`` (``a = 1``: Ulysses x ring), ``ulysses`` (``m = 1``) and ``hybrid`` (the rest). The plain
meshes are among them, simulated exactly as :func:`choose_tile` simulates them, so the choice is never predicted
slower than the best plain mesh. It is not always a hybrid: once the mesh hides its communication behind the
compute, the time the head group's all-to-alls add (they overlap nothing) is what tells candidates apart, and the
plain mesh, which has none, is fastest by a fraction of a percent; the hybrid then still sends far fewer bytes
across nodes, which the reason reports beside the times.
"""

from __future__ import annotations

import functools
from typing import Literal

from mesh_cp.core import AttentionShape, Tiling, check_seq_len, factorizations, hybrid_unavailable, valid_heads
from mesh_cp.core.options import Backward, Layout, Schedule
from mesh_cp.sim.hybrid import HybridResult, hybrid_group_links, simulate_hybrid
from mesh_cp.sim.model import SimResult, group_links, plan_for_topology, simulate
from mesh_cp.sim.topology import Topology
from mesh_cp.sim.ulysses import ulysses_unavailable

HybridKind = Literal["mesh", "hybrid", "usp", "ulysses"]
_KIND_NAMES = {"mesh": "mesh", "hybrid": "hybrid", "usp": "USP", "ulysses": "Ulysses"}


def describe_links(tiling: Tiling, topology: Topology) -> str:
    """``"Q ring inside a node, KV ring across nodes"`` (a ring of one rank is ``"unused"``)."""
    links = group_links(tiling, topology)
    where = {"intra": "inside a node", "inter": "across nodes"}
    parts = [
        f"{name} ring {where[links[ring]] if size > 1 else 'unused'}"
        for name, ring, size in (("Q", "q", tiling.a), ("KV", "kv", tiling.b))
    ]
    return ", ".join(parts)


def simulate_tiles(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
) -> dict[Tiling, SimResult]:
    """:func:`simulate` every factorisation ``a x b`` of ``world`` (``shape`` holds per-rank sizes)."""
    check_seq_len(shape.seq_local * world, world, layout)
    return dict(_simulate_tiles(world, shape, topology, causal, layout, backward, schedule))


@functools.lru_cache(maxsize=64)
def _simulate_tiles(
    world: int, shape: AttentionShape, topology: Topology, causal: bool, layout: str, backward: str, schedule: str
) -> tuple[tuple[Tiling, SimResult], ...]:
    tilings = [Tiling(world=world, a=a, b=b) for a, b in factorizations(world)]
    options = {"causal": causal, "layout": layout, "backward": backward, "schedule": schedule}
    return tuple((t, simulate(plan_for_topology(t, shape, topology, **options), topology)) for t in tilings)


def choose_tile(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    memory_budget: int | None = None,
    schedule: Schedule = "overlap",
) -> tuple[Tiling, str]:
    """The tile with the fastest predicted forward + backward within ``memory_budget``, and why.

    Simulates every factorisation ``a x b`` of ``world`` with ``schedule``; drops tiles whose peak
    memory per rank (:func:`mesh_cp.sim.memory.peak_bytes`) exceeds ``memory_budget`` bytes (``None``:
    no limit); ties go to the tile sending fewer bytes. ``shape`` holds per-rank sizes.
    """
    if memory_budget is not None and memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")
    results = simulate_tiles(world, shape, topology, causal=causal, layout=layout, backward=backward, schedule=schedule)
    fits = {t: r for t, r in results.items() if memory_budget is None or r.memory <= memory_budget}
    if not fits:
        least = min(results, key=lambda t: results[t].memory)
        raise ValueError(
            f"memory_budget {memory_budget} bytes is below the peak of every tile of {world} ranks; the least is "
            f"{results[least].memory} bytes (tile {least}); raise the budget or shorten the sequence per rank"
        )
    best = min(fits, key=lambda t: (fits[t].time, fits[t].traffic.total, t.a))
    ring, chosen = results[Tiling(world=world, a=1, b=world)], fits[best]
    units = chosen.forward.traffic.total / (shape.chunk_elems * shape.itemsize)
    over = len(results) - len(fits)
    reason = (
        f"tile {best}: predicted {chosen.time * 1e3:.3g} ms fwd+bwd vs ring 1x{world} {ring.time * 1e3:.3g} ms "
        f"({ring.time / chosen.time:.2f}x); {describe_links(best, topology)}; {units:.3g} C per rank forward"
    )
    if over:
        reason += f"; {over} tile(s) over the memory budget"
    return best, reason


# ----------------------------------------------------------------------------------------------
# Head-parallel x mesh


def hybrid_kind(heads: int, tiling: Tiling) -> HybridKind:
    """``"mesh"`` (``u = 1``), ``"ulysses"`` (``m = 1``), ``"usp"`` (``a = 1``) or ``"hybrid"``."""
    if heads == 1:
        return "mesh"
    if tiling.world == 1:
        return "ulysses"
    return "usp" if tiling.a == 1 else "hybrid"


def hybrid_label(heads: int, tiling: Tiling) -> str:
    """``"tile 4x8"`` for a plain mesh, else ``"tile 4x8 with heads=8"``: the arguments of
    :meth:`mesh_cp.CPMesh.create` that build it."""
    return f"tile {tiling}" if heads == 1 else f"tile {tiling} with heads={heads}"


def describe_hybrid_links(heads: int, tiling: Tiling, topology: Topology) -> str:
    """``"head groups inside a node, Q ring across nodes, KV ring across nodes"`` (:func:`describe_links` for
    ``heads = 1``; a ring of one rank is ``"unused"``)."""
    if heads == 1:
        return describe_links(tiling, topology)
    links = hybrid_group_links(heads, tiling, topology)
    where = {"intra": "inside a node", "inter": "across nodes"}
    parts = [f"head groups {where[links['heads']]}"]
    parts += [
        f"{name} ring {where[links[ring]] if size > 1 else 'unused'}"
        for name, ring, size in (("Q", "q", tiling.a), ("KV", "kv", tiling.b))
    ]
    return ", ".join(parts)


def hybrid_candidates(
    world: int, shape: AttentionShape, *, layout: Layout = "zigzag", heads: int | None = None
) -> tuple[tuple[int, Tiling], ...]:
    """Every ``(u, Tiling(P / u, a, b))`` the hybrid can run ``shape`` (per-rank sizes) with on ``world`` ranks
    (:func:`mesh_cp.core.hybrid_unavailable`), ``u`` ascending, then ``a``; only ``u = heads`` when given (raising
    ``ValueError`` with the fix when that ``u`` cannot run it)."""
    if heads is not None:
        reason = hybrid_unavailable(world, heads, shape, layout=layout)
        if reason is not None:
            raise ValueError(reason)
    degrees = valid_heads(world, shape) if heads is None else (heads,)
    return tuple(
        (u, Tiling(world=world // u, a=a, b=b))
        for u in degrees
        if hybrid_unavailable(world, u, shape, layout=layout) is None
        for a, b in factorizations(world // u)
    )


def simulate_hybrids(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
    heads: int | None = None,
) -> dict[tuple[int, Tiling], HybridResult]:
    """:func:`mesh_cp.sim.simulate_hybrid` of every :func:`hybrid_candidates` ``(u, tiling)`` (``shape``: per-rank
    sizes); ``u = 1`` gives the plain meshes' predictions."""
    check_seq_len(shape.seq_local * world, world, layout)
    return dict(_simulate_hybrids(world, shape, topology, causal, layout, backward, schedule, heads))


@functools.lru_cache(maxsize=64)
def _simulate_hybrids(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    causal: bool,
    layout: str,
    backward: str,
    schedule: str,
    heads: int | None,
) -> tuple[tuple[tuple[int, Tiling], HybridResult], ...]:
    options = {"causal": causal, "layout": layout, "backward": backward, "schedule": schedule}
    return tuple(
        ((u, t), simulate_hybrid(u, t, shape, topology, **options))
        for u, t in hybrid_candidates(world, shape, layout=layout, heads=heads)
    )


def best_of_kind(results: dict[tuple[int, Tiling], SimResult], kind: HybridKind) -> tuple[int, Tiling] | None:
    """The fastest candidate of ``kind`` in ``results`` (ties: fewest bytes across nodes, then fewest bytes), or
    ``None`` when there is none."""
    keys = [key for key in results if hybrid_kind(*key) == kind]
    return min(keys, key=lambda key: _rank_key(key, results[key]), default=None)


def _rank_key(key: tuple[int, Tiling], result: SimResult) -> tuple:
    return (result.time, result.traffic.inter, result.traffic.total, key[0], key[1].a)


def choose_hybrid(
    world: int,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    memory_budget: int | None = None,
    schedule: Schedule = "overlap",
    heads: int | None = None,
) -> tuple[int, Tiling, str]:
    """``(u, tiling, reason)``: the head-parallel degree and inner tile with the fastest predicted forward +
    backward within ``memory_budget`` bytes per rank (``None``: no limit), among every :func:`hybrid_candidates`
    (only ``u = heads`` when given; ``heads=1`` chooses a plain mesh, as :func:`choose_tile` does); see Note
    [Hybrid choice]. ``shape`` holds per-rank sizes. The reason names the winner (:func:`hybrid_label`), its
    predicted time and bytes across nodes, the same for the best plain mesh, hybrid, USP and Ulysses it beat, and
    where its groups sit.
    """
    if memory_budget is not None and memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")
    options = {"causal": causal, "layout": layout, "backward": backward, "schedule": schedule, "heads": heads}
    results = simulate_hybrids(world, shape, topology, **options)
    fits = {key: r for key, r in results.items() if memory_budget is None or r.memory <= memory_budget}
    if not fits:
        u, least = min(results, key=lambda key: results[key].memory)
        raise ValueError(
            f"memory_budget {memory_budget} bytes is below the peak of every tile of {world} ranks; the least is "
            f"{results[(u, least)].memory} bytes ({hybrid_label(u, least)}); raise the budget or shorten the "
            f"sequence per rank"
        )
    u, tiling = min(fits, key=lambda key: _rank_key(key, fits[key]))
    reason = _hybrid_reason((u, tiling), results, fits, shape, topology, layout)
    return u, tiling, reason


def _hybrid_reason(
    chosen: tuple[int, Tiling],
    results: dict[tuple[int, Tiling], HybridResult],
    fits: dict[tuple[int, Tiling], HybridResult],
    shape: AttentionShape,
    topology: Topology,
    layout: Layout,
) -> str:
    """The reason of :func:`choose_hybrid`: the winner, then each kind's best beside it (Note [Hybrid choice])."""
    c = shape.chunk_elems * shape.itemsize
    win = results[chosen]
    world = chosen[0] * chosen[1].world
    kind = hybrid_kind(*chosen)
    suffix = f" ({_KIND_NAMES[kind]})" if kind in ("usp", "ulysses") else ""
    parts = [
        f"{hybrid_label(*chosen)}{suffix}: predicted {win.time * 1e3:.3g} ms fwd+bwd, {win.traffic.inter / c:.3g} C per rank "
        f"across nodes fwd+bwd (C = a rank's Q chunk)"
    ]
    for kind in ("mesh", "hybrid", "usp", "ulysses"):
        name, best = _KIND_NAMES[kind], best_of_kind(fits, kind)
        if best == chosen:
            parts.append(f"it is the best {name}")
        elif best is not None:
            other = results[best]
            parts.append(
                f"the best {name} {hybrid_label(*best)}: {other.time * 1e3:.3g} ms ({other.time / win.time:.3f}x), "
                f"{other.traffic.inter / c:.3g} C"
            )
        elif best_of_kind(results, kind) is not None:
            parts.append(f"every {name} is over the memory budget")
        elif kind == "ulysses" and ulysses_unavailable(world, shape) is not None:
            parts.append(f"Ulysses unavailable ({ulysses_unavailable(world, shape)})")
    parts.append(describe_hybrid_links(*chosen, topology))
    over = len(results) - len(fits)
    if over:
        parts.append(f"{over} candidate(s) over the memory budget")
    return "; ".join(parts)
