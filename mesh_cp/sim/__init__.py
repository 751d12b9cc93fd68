"""Cost model and simulator over the plan objects of :mod:`mesh_cp.core` (no torch import).

::

    topology = Topology.h100_infiniband(head_dim=128)
    result = simulate(plan, topology)          # predicted time, traffic per link class, memory
    tile, reason = choose_tile(256, shape, topology, memory_budget=40 * 2**30)

``model`` times a plan, ``memory`` is the peak-memory model, ``ulysses`` the head-parallel comparison,
``choice`` the automatic tile choice (:func:`mesh_cp.auto_mesh` builds a mesh with it).
"""

from mesh_cp.sim.choice import choose_tile, describe_links, simulate_tiles
from mesh_cp.sim.memory import peak_bytes
from mesh_cp.sim.model import (
    PhaseResult,
    SimResult,
    Traffic,
    bottleneck_rank,
    compute_imbalance,
    group_links,
    next_hops,
    plan_for_topology,
    rank_traffic,
    ring_link_cost,
    simulate,
    simulate_phase,
)
from mesh_cp.sim.topology import LINK_CLASSES, PRESETS, LinkClass, Topology
from mesh_cp.sim.ulysses import simulate_ulysses, ulysses_unavailable

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
    "compute_imbalance",
    "describe_links",
    "group_links",
    "next_hops",
    "peak_bytes",
    "plan_for_topology",
    "rank_traffic",
    "ring_link_cost",
    "simulate",
    "simulate_phase",
    "simulate_tiles",
    "simulate_ulysses",
    "ulysses_unavailable",
]
