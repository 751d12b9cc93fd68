"""Head-parallel x mesh attention on a :class:`Topology`: the head group's all-to-alls and the inner mesh of a mesh
group, timed with the models of :mod:`mesh_cp.sim.ulysses` and :mod:`mesh_cp.sim.model` (no torch).

Note [Hybrid cost model]
~~~~~~~~~~~~~~~~~~~~~~~~
The plan is :class:`~mesh_cp.core.hybrid.HybridPlan` (Note [Head-parallel x mesh plan]): CP rank ``r = g * u + i``
is rank ``i`` of head group ``g`` and mesh rank ``g`` of mesh group ``i``.

*All-to-alls.* Each tensor of ``HybridPlan.all_to_alls(phase)`` is one direct all-to-all over the head group's
``u`` consecutive ranks (:func:`mesh_cp.sim.ulysses.all_to_all_seconds`, Ulysses' model): ``X / u`` bytes to each
peer, those in the node over NVLink, the others over the NIC. They run one after the other and overlap nothing:
the inputs' before the mesh, the outputs' after it. With ``u | ranks_per_node`` every head group is inside a node.

*Inner mesh.* The mesh is simulated by :mod:`mesh_cp.sim.model` unchanged, on a view of the topology as one mesh
group sees it (:class:`MeshGroupTopology`: mesh rank ``g`` lives on the node of CP rank ``g * u + i``). Mesh ranks
are ``u`` CP ranks apart, so with ``u | ranks_per_node`` a node holds ``ranks_per_node / u`` consecutive mesh
ranks and a Q ring stays inside it only when ``a`` divides that; at ``u = ranks_per_node`` every hop of both rings
crosses nodes. Mesh groups whose nodes repeat the same pattern are simulated once; every distinct one is, and
the slowest counts. The overlapped schedule's move order comes from :func:`hybrid_link_cost` (one order for every
mesh group, as the runtime builds one plan).

*Time* of a phase: the slowest rank's all-to-alls plus the slowest mesh group's mesh (an all-to-all waits for its
whole head group; exact when all head groups and mesh groups are placed alike, an upper bound otherwise).

*Traffic*: bytes of the rank that sends the most across nodes over forward and backward (its all-to-alls and its
share of its mesh group's rings), reported whole and split into ``a2a`` and ``mesh`` (:class:`HybridPhaseResult`).

*Memory*: the inner plan's peak (:func:`mesh_cp.sim.memory.peak_bytes`) plus the head-layout copy of every tensor
the phase's all-to-alls move (forward q, k, v and out; backward dO, dq, dk and dv).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields

from mesh_cp.core import AttentionShape, HybridPlan, Tiling, head_group_ranks, make_hybrid_plan
from mesh_cp.core.options import PHASES, Backward, Layout, Schedule, check_option
from mesh_cp.core.schedule import RINGS
from mesh_cp.sim.model import PhaseResult, SimResult, Traffic, group_links, next_hops, simulate_phase
from mesh_cp.sim.topology import LinkClass, Topology
from mesh_cp.sim.ulysses import all_to_all_seconds


@dataclass(frozen=True, kw_only=True)
class MeshGroupTopology(Topology):
    """``topology`` as one mesh group sees it: mesh rank ``g`` lives on node ``nodes[g]`` (Note [Hybrid cost
    model]); the links and the kernel are the cluster's. Build it with :func:`mesh_group_topology`."""

    nodes: tuple[int, ...]
    """Node of each mesh rank, numbered in order of first appearance (equal placements compare equal)."""

    def node(self, rank: int) -> int:
        return self.nodes[rank]


def mesh_group_topology(topology: Topology, heads: int, world: int, offset: int) -> MeshGroupTopology:
    """The view of mesh group ``offset`` (CP ranks ``offset, u + offset, ...``) of ``world`` ranks on ``topology``."""
    names: dict[int, int] = {}
    nodes = tuple(names.setdefault(topology.node(g), len(names)) for g in range(offset, world, heads))
    base = {f.name: getattr(topology, f.name) for f in fields(Topology)}
    return MeshGroupTopology(**base, nodes=nodes)


@functools.lru_cache(maxsize=256)
def mesh_group_views(heads: int, world: int, topology: Topology) -> tuple[MeshGroupTopology, ...]:
    """The view of each mesh group, by offset ``i < u`` (equal placements give equal views)."""
    return tuple(mesh_group_topology(topology, heads, world, i) for i in range(heads))


def hybrid_group_links(heads: int, tiling: Tiling, topology: Topology) -> Mapping[str, LinkClass]:
    """Link class of the head group and of the inner Q and KV rings: ``"inter"`` if any group of that kind crosses
    nodes (keys ``"heads"``, ``"q"``, ``"kv"``)."""
    world = heads * tiling.world
    views = set(mesh_group_views(heads, world, topology))
    links = {
        ring: "inter" if any(group_links(tiling, v)[ring] == "inter" for v in views) else "intra" for ring in RINGS
    }
    groups = (head_group_ranks(world, heads, g * heads) for g in range(tiling.world))
    links["heads"] = "inter" if any(topology.ring_link(members) == "inter" for members in groups) else "intra"
    return types.MappingProxyType(links)


def hybrid_link_cost(heads: int, tiling: Tiling, topology: Topology) -> tuple[float, float]:
    """Relative seconds per byte on the inner Q ring and KV ring (the faster is 1): the ``link_cost`` of the inner
    plan, as :func:`mesh_cp.sim.model.ring_link_cost` gives it for a plain mesh; equal to it for ``heads = 1``."""
    links = hybrid_group_links(heads, tiling, topology)
    cost = [1.0 / topology.bandwidth(links[ring]) for ring in RINGS]
    return (cost[0] / min(cost), cost[1] / min(cost))


@dataclass(frozen=True)
class HybridPhaseResult(PhaseResult):
    """:class:`~mesh_cp.sim.model.PhaseResult` of a hybrid with the traffic split by what sends it."""

    a2a: Traffic
    """Bytes the reported rank sends in the head group's all-to-alls."""
    mesh: Traffic
    """Bytes the reported rank sends on its mesh group's Q and KV rings."""
    a2a_time: float
    """Seconds of the all-to-alls in :attr:`time` (the slowest rank's)."""


@dataclass(frozen=True)
class HybridResult(SimResult):
    """Prediction of one head-parallel x mesh attention call (forward and backward)."""

    heads: int
    """``u``: head-parallel ranks per head group."""
    tiling: Tiling
    """The inner ``a x b`` tiling of the ``P / u`` ranks of a mesh group."""

    @property
    def a2a(self) -> Traffic:
        """Bytes of the all-to-alls, forward plus backward, by link class."""
        return self.forward.a2a + self.backward.a2a

    @property
    def mesh(self) -> Traffic:
        """Bytes of the inner mesh, forward plus backward, by link class."""
        return self.forward.mesh + self.backward.mesh


def simulate_hybrid(
    heads: int,
    tiling: Tiling,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    schedule: Schedule = "overlap",
    backward: Backward = "regather",
) -> HybridResult:
    """Predict ``u = heads`` head-parallel ranks around the inner ``tiling`` (``P = u * tiling.world``) on
    ``topology``; ``shape`` holds the per-rank sizes of the inputs (``S / P`` tokens, all heads). See Note [Hybrid
    cost model]. ``heads=1`` predicts the plain mesh (as :func:`mesh_cp.sim.model.simulate` does). Raises
    ``ValueError`` with the fix when the hybrid cannot run ``shape`` (:func:`mesh_cp.core.make_hybrid_plan`).
    """
    for name, value in (("layout", layout), ("schedule", schedule), ("backward", backward)):
        check_option(name, value)
    plan = make_hybrid_plan(
        heads,
        tiling,
        shape,
        causal=causal,
        layout=layout,
        backward=backward,
        schedule=schedule,
        link_cost=hybrid_link_cost(heads, tiling, topology),
    )
    return simulate_hybrid_plan(plan, topology)


@functools.lru_cache(maxsize=512)
def simulate_hybrid_plan(plan: HybridPlan, topology: Topology) -> HybridResult:
    """Predict ``plan`` on ``topology`` (Note [Hybrid cost model])."""
    u, world = plan.heads, plan.world
    views = mesh_group_views(u, world, topology)
    mesh = {phase: [simulate_phase(plan.plan, view, phase) for view in dict.fromkeys(views)] for phase in PHASES}
    sends = {phase: _rank_sends(plan, topology, phase) for phase in PHASES}
    rank = max(range(world), key=lambda r: (sum(sends[p][r][1].inter + sends[p][r][2].inter for p in PHASES), -r))
    phases = {}
    for phase in PHASES:
        a2a_time = max(seconds for seconds, _, _ in sends[phase])
        _, a2a, rings = sends[phase][rank]
        phases[phase] = HybridPhaseResult(
            time=a2a_time + max(result.time for result in mesh[phase]),
            compute=max(result.compute for result in mesh[phase]),
            traffic=a2a + rings,
            memory=mesh[phase][0].memory + sum(nbytes for _, nbytes in plan.all_to_alls(phase)),
            a2a=a2a,
            mesh=rings,
            a2a_time=a2a_time,
        )
    name = f"{plan.tiling} {plan.plan.schedule}" if u == 1 else f"{u}x({plan.tiling}) {plan.plan.schedule}"
    return HybridResult(name=name, forward=phases["forward"], backward=phases["backward"], heads=u, tiling=plan.tiling)


def _rank_sends(plan: HybridPlan, topology: Topology, phase: str) -> list[tuple[float, Traffic, Traffic]]:
    """For every CP rank: seconds and traffic of its all-to-alls in ``phase``, and the traffic of its share of
    its mesh group's rings (by link class of its next hop on each, as :func:`mesh_cp.sim.model.rank_traffic`)."""
    u, world = plan.heads, plan.world
    views = mesh_group_views(u, world, topology)
    ring_bytes = {ring: plan.plan.bytes_sent(phase, group=ring) for ring in RINGS}
    a2a_memo: dict[int, tuple[float, Traffic]] = {}  # an all-to-all depends on how many peers share the rank's node
    sends = []
    for rank in range(world):
        members = head_group_ranks(world, u, rank)
        shared = sum(topology.node(g) == topology.node(rank) for g in members)
        if shared not in a2a_memo:
            timed = [all_to_all_seconds(nbytes // u, members, topology, rank) for _, nbytes in plan.all_to_alls(phase)]
            a2a_memo[shared] = (sum(t for t, _ in timed), sum((sent for _, sent in timed), Traffic()))
        hops = next_hops(plan.tiling, views[rank % u], rank // u)
        rings = sum((Traffic(**{hops[ring]: ring_bytes[ring]}) for ring in RINGS), Traffic())
        sends.append((*a2a_memo[shared], rings))
    return sends
