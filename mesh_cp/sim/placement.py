"""Where the groups of a plan sit on a :class:`Topology`: the head groups, each mesh group's Q and KV rings, and the
link class each crosses (no torch). See Note [Simulator cost model] in :mod:`mesh_cp.sim.model`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields

from mesh_cp.core import Tiling, head_group_ranks
from mesh_cp.core.schedule import RINGS
from mesh_cp.sim.topology import LinkClass, Topology

_WHERE = {"intra": "inside a node", "inter": "across nodes"}


@dataclass(frozen=True, kw_only=True)
class MeshGroupTopology(Topology):
    """``topology`` as one mesh group sees it: mesh rank ``g`` lives on node ``nodes[g]`` (Note [Simulator cost
    model]); the links and the kernel are the cluster's. Build it with :func:`mesh_group_topology`."""

    nodes: tuple[int, ...]
    """Node of each mesh rank, numbered in order of first appearance (equal placements compare equal)."""

    def node(self, rank: int) -> int:
        return self.nodes[rank]


def mesh_group_topology(topology: Topology, head_parallel: int, world: int, offset: int) -> MeshGroupTopology:
    """The view of mesh group ``offset`` (CP ranks ``offset, u + offset, ...``) of ``world`` ranks on ``topology``."""
    names: dict[int, int] = {}
    nodes = tuple(names.setdefault(topology.node(g), len(names)) for g in range(offset, world, head_parallel))
    base = {f.name: getattr(topology, f.name) for f in fields(Topology)}
    return MeshGroupTopology(**base, nodes=nodes)


@functools.lru_cache(maxsize=256)
def mesh_group_views(head_parallel: int, world: int, topology: Topology) -> tuple[Topology, ...]:
    """The view of each mesh group, by offset ``i < u`` (equal placements give equal views); for ``u = 1`` the one
    mesh group is the whole CP group, which sees ``topology`` itself."""
    if head_parallel == 1:
        return (topology,)
    return tuple(mesh_group_topology(topology, head_parallel, world, i) for i in range(head_parallel))


@functools.lru_cache(maxsize=256)
def ring_links(tiling: Tiling, topology: Topology) -> Mapping[str, LinkClass]:
    """Link class of the Q ring and of the KV ring of ``tiling`` on ``topology`` (one mesh group's view):
    ``"inter"`` if any ring of that kind crosses nodes."""
    groups = {"q": tiling.q_groups(), "kv": tiling.kv_groups()}
    links = {
        ring: "inter" if any(topology.ring_link(g) == "inter" for g in groups[ring]) else "intra" for ring in RINGS
    }
    return types.MappingProxyType(links)  # cached: read-only


@functools.lru_cache(maxsize=256)
def group_links(head_parallel: int, tiling: Tiling, topology: Topology) -> Mapping[str, LinkClass]:
    """Link class of the head groups and of the Q and KV rings of ``u = head_parallel`` around ``tiling``:
    ``"inter"`` if any group of that kind crosses nodes, over every mesh group (keys ``"heads"``, ``"q"``,
    ``"kv"``; head groups of one rank are ``"intra"``)."""
    world = head_parallel * tiling.world
    views = dict.fromkeys(mesh_group_views(head_parallel, world, topology))
    links = {ring: "inter" if any(ring_links(tiling, v)[ring] == "inter" for v in views) else "intra" for ring in RINGS}
    groups = (head_group_ranks(world, head_parallel, g * head_parallel) for g in range(tiling.world))
    links["heads"] = "inter" if any(topology.ring_link(members) == "inter" for members in groups) else "intra"
    return types.MappingProxyType(links)  # cached: read-only


def link_cost(head_parallel: int, tiling: Tiling, topology: Topology) -> tuple[float, float]:
    """Relative seconds per byte on the Q ring and the KV ring (the faster is 1): the plan's ``link_cost``, which
    orders the overlapped schedule's moves (one order for every mesh group, as the runtime builds one plan)."""
    links = group_links(head_parallel, tiling, topology)
    cost = [1.0 / topology.bandwidth(links[ring]) for ring in RINGS]
    return (cost[0] / min(cost), cost[1] / min(cost))


def describe_links(head_parallel: int, tiling: Tiling, topology: Topology) -> str:
    """``"head groups inside a node, Q ring across nodes, KV ring across nodes"``; without head groups for ``u = 1``
    (``"Q ring inside a node, KV ring across nodes"``); a ring of one rank is ``"unused"``."""
    links = group_links(head_parallel, tiling, topology)
    parts = [f"head groups {_WHERE[links['heads']]}"] if head_parallel > 1 else []
    parts += [
        f"{name} ring {_WHERE[links[ring]] if size > 1 else 'unused'}"
        for name, ring, size in (("Q", "q", tiling.a), ("KV", "kv", tiling.b))
    ]
    return ", ".join(parts)


def next_hops(tiling: Tiling, topology: Topology, rank: int) -> dict[str, LinkClass]:
    """Link class of mesh rank ``rank``'s own sends on ``topology`` (a mesh group's view): to the next member of its
    Q ring and of its KV ring.

    The Q ring of ``rank`` is ``a`` consecutive mesh ranks (the next one wraps inside the group); its KV ring steps
    by ``a`` (the next one wraps modulo the mesh). See Note [Mesh tiling].
    """
    a = tiling.a
    q_next = rank - rank % a + (rank % a + 1) % a
    kv_next = (rank + a) % tiling.world
    return {"q": topology.hop(rank, q_next), "kv": topology.hop(rank, kv_next)}
