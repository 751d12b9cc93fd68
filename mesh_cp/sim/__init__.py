"""Cost model and simulator over the plan objects of :mod:`mesh_cp.core` (no torch import).

::

    topology = Topology.h100_infiniband(head_dim=128)
    result = simulate(plan, topology)          # predicted time, traffic per link class, memory
    tile, reason = choose_tile(256, shape, topology, memory_budget=40 * 2**30)
    heads, tile, reason = choose_hybrid(256, shape, topology)   # also head-parallel x mesh hybrids

``model`` times a plan, ``memory`` is the peak-memory model, ``ulysses`` the head-parallel comparison,
``hybrid`` the head-parallel x mesh hybrid, ``choice`` the automatic choice (:func:`mesh_cp.auto_mesh` builds a
mesh with it).
"""

from mesh_cp.sim.choice import (
    best_of_kind,
    choose_hybrid,
    choose_tile,
    describe_hybrid_links,
    describe_links,
    hybrid_candidates,
    hybrid_kind,
    hybrid_label,
    simulate_hybrids,
    simulate_tiles,
)
from mesh_cp.sim.decode import (
    DECODE_METHODS,
    DecodeCost,
    DecodeLevel,
    DecodeRow,
    decode_table,
    default_decode_tile,
    format_decode_table,
    simulate_decode,
    tree_level_links,
)
from mesh_cp.sim.hybrid import (
    HybridPhaseResult,
    HybridResult,
    MeshGroupTopology,
    hybrid_group_links,
    hybrid_link_cost,
    mesh_group_topology,
    simulate_hybrid,
    simulate_hybrid_plan,
)
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
from mesh_cp.sim.ulysses import all_to_all_seconds, simulate_ulysses, ulysses_unavailable

__all__ = [
    "DECODE_METHODS",
    "LINK_CLASSES",
    "PRESETS",
    "DecodeCost",
    "DecodeLevel",
    "DecodeRow",
    "HybridPhaseResult",
    "HybridResult",
    "LinkClass",
    "MeshGroupTopology",
    "PhaseResult",
    "SimResult",
    "Topology",
    "Traffic",
    "all_to_all_seconds",
    "best_of_kind",
    "bottleneck_rank",
    "choose_hybrid",
    "choose_tile",
    "compute_imbalance",
    "decode_table",
    "default_decode_tile",
    "describe_hybrid_links",
    "describe_links",
    "format_decode_table",
    "group_links",
    "hybrid_candidates",
    "hybrid_group_links",
    "hybrid_kind",
    "hybrid_label",
    "hybrid_link_cost",
    "mesh_group_topology",
    "next_hops",
    "peak_bytes",
    "plan_for_topology",
    "rank_traffic",
    "ring_link_cost",
    "simulate",
    "simulate_decode",
    "simulate_hybrid",
    "simulate_hybrid_plan",
    "simulate_hybrids",
    "simulate_phase",
    "simulate_tiles",
    "simulate_ulysses",
    "tree_level_links",
    "ulysses_unavailable",
]
