"""Predicted time, traffic and memory of an attention plan on a :class:`Topology`: every plan, from the plain mesh
(``u = 1``) through the head-parallel x mesh plans and USP (``a = 1``) to Ulysses (``m = 1``).

Pure Python (no torch): reads the same :class:`~mesh_cp.core.AttentionPlan` the executor runs.

Note [Simulator cost model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
*Plan.* ``P = u x m`` CP ranks (Note [Head-parallel x mesh plan] in :mod:`mesh_cp.core.head_parallel`): CP rank
``r = g * u + i`` is rank ``i`` of head group ``g`` and mesh rank ``g`` of mesh group ``i``. A phase is the head
exchange (none for ``u = 1``) and the mesh of each mesh group (none to speak of for ``m = 1``, Ulysses).

*Compute.* A rank runs its blocks one at a time. A block of ``p`` pairs (``BlockWork.pairs``, per
head and batch element) takes ``p * batch * heads / pairs_per_second`` seconds (``heads`` of
``plan.mesh_shape``, ``H / u``), times ``backward_factor`` in backward.

*Links.* Each rank has one intra-node link (NVLink, shared by all it sends inside its node) and one
NIC (shared by all it sends to other nodes); both are full duplex, so receiving never slows sending.
A transfer queues on its link (first come, first served): it starts when it is launched and the link
is free, and takes ``latency + bytes / bandwidth``. Ring steps run in lockstep, so a ring's steps use
the class of its slowest hop (see :meth:`Topology.ring_link`); when both rings cross nodes they
share the NIC. That is exact when ``a`` divides ``ranks_per_node`` or the other way round (the rank
at a node boundary sends both rings over its NIC) and pessimistic otherwise.

*Head exchange.* Each tensor of ``plan.all_to_alls(phase)`` is one direct all-to-all over the head group's ``u``
consecutive ranks (:func:`all_to_all_seconds`): ``X / u`` bytes to each peer, those in the node over NVLink, the
others over the NIC, both at once. They run one after the other and overlap nothing: the inputs' before the mesh,
the outputs' after it. With ``u | ranks_per_node`` every head group is inside a node.

*Mesh groups.* Each mesh group is simulated on the topology as it sees it (:class:`MeshGroupTopology`: mesh rank
``g`` lives on the node of CP rank ``g * u + i``; for ``u = 1`` the topology itself). Mesh ranks are ``u`` CP ranks
apart, so with ``u | ranks_per_node`` a node holds ``ranks_per_node / u`` consecutive mesh ranks and a Q ring stays
inside it only when ``a`` divides that; at ``u = ranks_per_node`` every hop of both rings crosses nodes. Mesh groups
placed alike are simulated once, and the slowest counts. The overlapped schedule's move order is the plan's
``link_cost`` (:func:`mesh_cp.sim.link_cost`: one order for every mesh group, as the runtime builds one plan).

*Overlapped schedule.* Replays ``plan.overlap(phase).actions``: ``compute`` advances the rank's
clock by the block time, ``launch`` queues the ring step (``plan.step_bytes``), ``wait`` advances the
clock to the step's end. A transfer also costs the rank ``host_seconds_per_byte`` of compute per byte
sent and received, owed by the next block (a rank that waits pays nothing: the host is idle).
Every rank runs the same relative schedule, so when every rank has the same
block costs per ring offset (zig-zag layout or no mask: the only diagonal block is offset ``(0, 0)``)
all timelines are equal and mesh rank 0 stands for all. Otherwise (contiguous causal) every mesh rank is replayed
alone and the slowest is taken; that ignores how a slow rank delays its ring neighbours (a lower bound).

*Collective schedule.* Every collective of ``plan.transfers(phase)`` runs as a ring algorithm over
its group, ``(n - 1) * (latency + piece / bandwidth)`` on the group's ring class, one after the
other, then all blocks are computed (nothing overlaps).

*Time* of a phase: the slowest rank's all-to-alls plus the slowest mesh group's mesh (an all-to-all waits for its
whole head group; exact when all head groups and mesh groups are placed alike, an upper bound otherwise).

*Traffic* per rank and link class: bytes a rank sends over hops of that class: to each peer of its all-to-alls, and
on each ring of its mesh group to the ring's next member. Ranks differ (with the 1 x P ring only the ranks at a node
boundary send across nodes); results report the rank that sends the most across nodes over forward and backward
(the first of them), whole and split into ``a2a`` and ``mesh``. Every rank sends ``plan.bytes_sent(phase)``.

*Memory* per rank is :func:`mesh_cp.sim.memory.peak_bytes`: bytes held at the phase's peak beyond the inputs (the
mesh's, plus the head-layout copy of every tensor the phase's all-to-alls move).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from mesh_cp.core import AttentionPlan, BlockWork, Tiling, head_group_ranks
from mesh_cp.core.options import PHASES, Phase
from mesh_cp.core.schedule import RINGS
from mesh_cp.sim.memory import peak_bytes
from mesh_cp.sim.placement import mesh_group_views, next_hops, ring_links
from mesh_cp.sim.topology import LINK_CLASSES, Topology


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends, by link class."""

    intra: int = 0
    inter: int = 0

    @property
    def total(self) -> int:
        return self.intra + self.inter

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(intra=self.intra + other.intra, inter=self.inter + other.inter)


@dataclass(frozen=True)
class PhaseResult:
    """Prediction for one phase (forward or backward)."""

    time: float
    """Predicted seconds of the phase (the slowest rank)."""
    compute: float
    """Seconds of block compute in it (no communication)."""
    traffic: Traffic
    """Bytes sent by the rank that sends the most across nodes: :attr:`a2a` plus :attr:`mesh`."""
    memory: int
    """Peak bytes a rank holds beyond its inputs."""
    a2a: Traffic
    """Bytes the reported rank sends in its head group's all-to-alls (none for ``u = 1``)."""
    mesh: Traffic
    """Bytes the reported rank sends on its mesh group's Q and KV rings."""
    a2a_time: float
    """Seconds of the all-to-alls in :attr:`time` (the slowest rank's; 0 for ``u = 1``)."""


@dataclass(frozen=True)
class SimResult:
    """Prediction for one forward and backward of an attention call."""

    name: str
    """``"AxB overlap"`` (``u = 1``) or ``"Ux(AxB) collective"`` (``u > 1``)."""
    forward: PhaseResult
    backward: PhaseResult
    head_parallel: int
    """``u``: ranks per head group (1: the plain mesh)."""
    tiling: Tiling
    """The ``a x b`` tiling of the ``P / u`` ranks of a mesh group."""

    @property
    def time(self) -> float:
        """Predicted seconds of forward plus backward."""
        return self.forward.time + self.backward.time

    @property
    def traffic(self) -> Traffic:
        """Bytes sent in forward plus backward, by link class."""
        return self.forward.traffic + self.backward.traffic

    @property
    def a2a(self) -> Traffic:
        """Bytes of the all-to-alls, forward plus backward, by link class."""
        return self.forward.a2a + self.backward.a2a

    @property
    def mesh(self) -> Traffic:
        """Bytes of the mesh, forward plus backward, by link class."""
        return self.forward.mesh + self.backward.mesh

    @property
    def memory(self) -> int:
        """Peak bytes beyond the inputs, the larger of the two phases."""
        return max(self.forward.memory, self.backward.memory)


# ----------------------------------------------------------------------------------------------
# Traffic


def all_to_all_seconds(piece: float, members: Sequence[int], topology: Topology, rank: int) -> tuple[float, Traffic]:
    """Time and traffic of a direct all-to-all among the CP ranks ``members`` sending ``piece`` bytes from
    ``rank`` to each of its peers: those inside its node over its NVLink, the others over its NIC, both at once
    (the slower link sets the time)."""
    node = topology.node(rank)
    intra_peers = sum(1 for g in members if g != rank and topology.node(g) == node)
    peers = {"intra": intra_peers, "inter": len(members) - 1 - intra_peers}
    time = max(topology.transfer_time(link, n * piece, messages=n) if n else 0.0 for link, n in peers.items())
    return time, Traffic(intra=round(peers["intra"] * piece), inter=round(peers["inter"] * piece))


def _head_exchange(plan: AttentionPlan, topology: Topology, phase: Phase, rank: int) -> tuple[float, Traffic]:
    """Seconds and traffic of CP rank ``rank``'s all-to-alls in ``phase``, one after the other."""
    members = head_group_ranks(plan.world, plan.head_parallel, rank)
    timed = [all_to_all_seconds(t.piece_bytes, members, topology, rank) for t in plan.all_to_alls(phase)]
    return sum(t for t, _ in timed), sum((sent for _, sent in timed), Traffic())


def _ring_traffic(plan: AttentionPlan, topology: Topology, rank: int, ring_bytes: dict[str, int]) -> dict[str, Traffic]:
    """``ring_bytes`` of each ring, by link class of CP rank ``rank``'s next hop on it in its mesh group."""
    u = plan.head_parallel
    hops = next_hops(plan.tiling, mesh_group_views(u, plan.world, topology)[rank % u], rank // u)
    return {ring: Traffic(**{hops[ring]: ring_bytes[ring]}) for ring in RINGS}


def rank_traffic(plan: AttentionPlan, topology: Topology, phase: Phase, rank: int) -> dict[str, Traffic]:
    """Bytes CP rank ``rank`` sends in ``phase``, by link class: in its head group's all-to-alls (``"heads"``) and on
    its mesh group's Q ring and KV ring (``"q"``, ``"kv"``, by link class of its next hop)."""
    ring_bytes = {ring: plan.bytes_sent(phase, group=ring) for ring in RINGS}
    return {"heads": _head_exchange(plan, topology, phase, rank)[1], **_ring_traffic(plan, topology, rank, ring_bytes)}


def _rank_sends(plan: AttentionPlan, topology: Topology, phase: Phase) -> list[tuple[float, Traffic, Traffic]]:
    """For every CP rank: seconds and traffic of its all-to-alls in ``phase``, and the traffic of its share of its
    mesh group's rings (as :func:`rank_traffic`)."""
    ring_bytes = {ring: plan.bytes_sent(phase, group=ring) for ring in RINGS}
    memo: dict[int, tuple[float, Traffic]] = {}  # an all-to-all depends on how many peers share the rank's node
    sends = []
    for rank in range(plan.world):
        members = head_group_ranks(plan.world, plan.head_parallel, rank)
        shared = sum(topology.node(g) == topology.node(rank) for g in members)
        if shared not in memo:
            memo[shared] = _head_exchange(plan, topology, phase, rank)
        rings = _ring_traffic(plan, topology, rank, ring_bytes)
        sends.append((*memo[shared], rings["q"] + rings["kv"]))
    return sends


# ----------------------------------------------------------------------------------------------
# Compute


def block_seconds(work: BlockWork, plan: AttentionPlan, topology: Topology, phase: Phase) -> float:
    """Seconds of one block kernel call of ``plan`` in ``phase`` (on the plan's ``mesh_shape``)."""
    s = plan.mesh_shape
    seconds = work.pairs * s.batch * s.heads / topology.pairs_per_second
    return seconds * (topology.backward_factor if phase == "backward" else 1.0)


def timed_ranks(plan: AttentionPlan) -> range:
    """Mesh ranks to replay: rank 0 stands for all when every rank has equal block costs per offset (no mask, and
    the zig-zag layout or full attention)."""
    equal = plan.mask is None and (plan.layout == "zigzag" or not plan.causal)
    return range(1) if equal else range(plan.tiling.world)


def compute_imbalance(plan: AttentionPlan) -> float:
    """The most query-key pairs a rank computes over the mean of all ranks (1.0: balanced). The zig-zag layout
    balances a causal row exactly; a batch's documents, padding or window (``plan.mask``) may not."""
    pairs = [plan.pairs(rank) for rank in range(plan.tiling.world)]
    mean = sum(pairs) / len(pairs)
    return max(pairs) / mean if mean else 1.0


# ----------------------------------------------------------------------------------------------
# The mesh of one mesh group


def _overlap_seconds(plan: AttentionPlan, view: Topology, phase: Phase, rank: int) -> float:
    """Replay the overlapped schedule's actions on mesh rank ``rank``; see Note [Simulator cost model]."""
    nbytes, links = plan.step_bytes(phase), ring_links(plan.tiling, view)
    clock, link_free = 0.0, dict.fromkeys(LINK_CLASSES, 0.0)
    ends = {}
    host = 0.0  # compute time owed to transfers in flight (paid by the next block)
    for act in plan.overlap(phase).actions:
        if act.op == "compute":
            work = plan.block_at(rank, *act.block)
            clock += host + (0.0 if work is None else block_seconds(work, plan, view, phase))
            host = 0.0
        elif act.op == "launch":
            link, size = links[act.step.ring], nbytes[(act.step.ring, act.step.kind)]
            start = max(clock, link_free[link])
            link_free[link] = ends[act.step] = start + view.transfer_time(link, size)
            host += 2 * size * view.host_seconds_per_byte  # every rank sends and receives one
        else:
            clock = max(clock, ends.pop(act.step))
    assert not ends, f"steps launched but never waited for: {sorted(ends, key=str)}"
    return clock


def _mesh_seconds(plan: AttentionPlan, view: Topology, phase: Phase) -> tuple[float, float]:
    """``(time, compute)`` of the mesh of one mesh group placed as ``view`` says, the slowest mesh rank's."""
    ranks = timed_ranks(plan)
    compute = max(sum(block_seconds(w, plan, view, phase) for w in plan.blocks(g)) for g in ranks)
    if plan.schedule == "overlap":
        return max(_overlap_seconds(plan, view, phase, g) for g in ranks), compute
    links = ring_links(plan.tiling, view)
    comm = sum(
        view.transfer_time(links[t.group], t.bytes_sent, messages=t.group_size - 1) for t in plan.transfers(phase)
    )
    return compute + comm, compute


# ----------------------------------------------------------------------------------------------
# The call


@functools.lru_cache(maxsize=512)
def simulate(plan: AttentionPlan, topology: Topology) -> SimResult:
    """Predict forward and backward of ``plan`` on ``topology`` (its ``schedule`` decides how), for every plan: the
    plain mesh (``head_parallel = 1``), the head-parallel x mesh plans, USP and Ulysses; see Note [Simulator cost
    model]."""
    u = plan.head_parallel
    views = dict.fromkeys(mesh_group_views(u, plan.world, topology))
    sends = {phase: _rank_sends(plan, topology, phase) for phase in PHASES}
    rank = max(range(plan.world), key=lambda r: (sum(sends[p][r][1].inter + sends[p][r][2].inter for p in PHASES), -r))
    phases = {}
    for phase in PHASES:
        mesh = [_mesh_seconds(plan, view, phase) for view in views]
        a2a_time = max(seconds for seconds, _, _ in sends[phase])
        _, a2a, rings = sends[phase][rank]
        phases[phase] = PhaseResult(
            time=a2a_time + max(time for time, _ in mesh),
            compute=max(compute for _, compute in mesh),
            traffic=a2a + rings,
            memory=peak_bytes(plan, phase),
            a2a=a2a,
            mesh=rings,
            a2a_time=a2a_time,
        )
    name = f"{plan.tiling} {plan.schedule}" if u == 1 else f"{u}x({plan.tiling}) {plan.schedule}"
    return SimResult(name, phases["forward"], phases["backward"], head_parallel=u, tiling=plan.tiling)
