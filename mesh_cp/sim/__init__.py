"""Cost model and simulator over the plan objects of :mod:`mesh_cp.core` (no torch import).

::

    topology = Topology.h100_infiniband(head_dim=128)
    result = simulate(plan, topology)          # predicted time, traffic per link class, memory
    tile, reason = choose_tile(256, shape, topology, memory_budget=40 * 2**30)
"""

from mesh_cp.sim.model import (
    PhaseResult,
    SimResult,
    Traffic,
    bottleneck_rank,
    choose_tile,
    describe_links,
    group_links,
    next_hops,
    plan_for_topology,
    rank_traffic,
    ring_link_cost,
    simulate,
    simulate_phase,
    simulate_tiles,
    simulate_ulysses,
    ulysses_unavailable,
)
from mesh_cp.sim.topology import LINK_CLASSES, PRESETS, LinkClass, Topology

__all__ = [
    "LINK_CLASSES",
    "PRESETS",
    "LinkClass",
    "PhaseResult",
    "SimResult",
    "Topology",
    "Traffic",
    "bottleneck_rank",
    "choose_tile",
    "describe_links",
    "group_links",
    "next_hops",
    "plan_for_topology",
    "rank_traffic",
    "ring_link_cost",
    "simulate",
    "simulate_phase",
    "simulate_tiles",
    "simulate_ulysses",
    "ulysses_unavailable",
]
