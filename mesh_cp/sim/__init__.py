"""Cost model and simulator over the plan objects of :mod:`mesh_cp.core` (no torch import).

::

    topology = Topology.h100_infiniband(head_dim=128)
    result = simulate(plan, topology)          # predicted time, traffic per link class (head exchange and mesh), memory
    u, tiling, reason = choose(256, shape, topology, memory_budget=40 * 2**30)   # every (u, a x b): mesh ... Ulysses
    u, tiling, reason = choose(256, shape, topology, head_parallel=1)            # plain meshes only

One model for every plan ``(u, a x b)``: the plain mesh (``u = 1``), the head-parallel x mesh plans, USP
(``a = 1``) and Ulysses (``u = P``, tile ``1 x 1``). ``model`` times a plan (Note [Simulator cost model]),
``placement`` says where its groups sit and which links they cross, ``memory`` is the peak-memory model,
``choice`` simulates every candidate and chooses (:func:`mesh_cp.auto_mesh` builds a mesh with it), ``decode``
models decoding with a sharded cache.
"""

from mesh_cp.sim.choice import (
    Choice,
    Kind,
    best_of_kind,
    candidate_kind,
    candidate_label,
    candidates,
    choose,
    plan_for_topology,
    simulate_candidates,
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
from mesh_cp.sim.memory import peak_bytes
from mesh_cp.sim.model import (
    PhaseResult,
    SimResult,
    Traffic,
    all_to_all_seconds,
    compute_imbalance,
    rank_traffic,
    simulate,
)
from mesh_cp.sim.placement import (
    MeshGroupTopology,
    describe_links,
    group_links,
    link_cost,
    mesh_group_topology,
    next_hops,
)
from mesh_cp.sim.topology import LINK_CLASSES, PRESETS, LinkClass, Topology

__all__ = [
    "DECODE_METHODS",
    "LINK_CLASSES",
    "PRESETS",
    "Choice",
    "DecodeCost",
    "DecodeLevel",
    "DecodeRow",
    "Kind",
    "LinkClass",
    "MeshGroupTopology",
    "PhaseResult",
    "SimResult",
    "Topology",
    "Traffic",
    "all_to_all_seconds",
    "best_of_kind",
    "candidate_kind",
    "candidate_label",
    "candidates",
    "choose",
    "compute_imbalance",
    "decode_table",
    "default_decode_tile",
    "describe_links",
    "format_decode_table",
    "group_links",
    "link_cost",
    "mesh_group_topology",
    "next_hops",
    "peak_bytes",
    "plan_for_topology",
    "rank_traffic",
    "simulate",
    "simulate_candidates",
    "simulate_decode",
    "tree_level_links",
]
