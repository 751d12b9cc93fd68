"""The automatic tile choice: every factorisation ``a x b`` of the CP size simulated, the fastest that fits
the memory budget chosen, and why (no torch). :func:`mesh_cp.auto_mesh` builds a mesh with it."""

from __future__ import annotations

import functools

from mesh_cp.core import AttentionShape, Tiling, check_seq_len, factorizations
from mesh_cp.core.options import Backward, Layout, Schedule
from mesh_cp.sim.model import SimResult, group_links, plan_for_topology, simulate
from mesh_cp.sim.topology import Topology


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
