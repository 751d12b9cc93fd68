"""Predicted time, traffic and memory of an attention plan on a :class:`Topology`; tile choice.

Pure Python (no torch): reads the same :class:`~mesh_cp.core.AttentionPlan` the executor runs.

Note [Simulator cost model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
*Compute.* A rank runs its blocks one at a time. A block of ``p`` pairs (``BlockWork.pairs``, per
head and batch element) takes ``p * batch * heads / pairs_per_second`` seconds, times
``backward_factor`` in backward.

*Links.* Each rank has one intra-node link (NVLink, shared by all it sends inside its node) and one
NIC (shared by all it sends to other nodes); both are full duplex, so receiving never slows sending.
A transfer queues on its link (first come, first served): it starts when it is launched and the link
is free, and takes ``latency + bytes / bandwidth``. Ring steps run in lockstep, so a ring's steps use
the class of its slowest hop (see :meth:`Topology.ring_link`); when both rings cross nodes they
share the NIC. That is exact when ``a`` divides ``ranks_per_node`` or the other way round (the rank
at a node boundary sends both rings over its NIC) and pessimistic otherwise.

*Overlapped schedule.* Replays ``plan.overlap(phase).actions``: ``compute`` advances the rank's
clock by the block time, ``launch`` queues the ring step (``plan.step_bytes``), ``wait`` advances the
clock to the step's end. A transfer also costs the rank ``host_seconds_per_byte`` of compute per byte
sent and received, owed by the next block (a rank that waits pays nothing: the host is idle).
Every rank runs the same relative schedule, so when every rank has the same
block costs per ring offset (zig-zag layout or no mask: the only diagonal block is offset ``(0, 0)``)
all timelines are equal and rank 0 stands for all. Otherwise (contiguous causal) every rank is replayed
alone and the slowest is taken; that ignores how a slow rank delays its ring neighbours (a lower bound).

*Collective schedule.* Every collective of ``plan.transfers(phase)`` runs as a ring algorithm over
its group, ``(n - 1) * (latency + piece / bandwidth)`` on the group's ring class, one after the
other, then all blocks are computed (nothing overlaps).

*Traffic* per rank and link class: bytes a rank sends over hops of that class (each ring step sends
to the next member of the ring). Ranks differ (with the 1 x P ring only the ranks at a node boundary
send across nodes); results report the rank that sends the most across nodes, which is the one the
timing above stands for. Every rank sends ``plan.bytes_sent(phase)`` in total.

*Memory* per rank is :func:`mesh_cp.sim.memory.peak_bytes`: bytes held at the phase's peak beyond the inputs.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass

from mesh_cp.core import AttentionPlan, AttentionShape, BlockWork, Tiling, make_plan
from mesh_cp.core.options import Backward, Layout, Schedule, check_option
from mesh_cp.core.schedule import RINGS
from mesh_cp.sim.memory import peak_bytes
from mesh_cp.sim.topology import LINK_CLASSES, LinkClass, Topology


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
    """Prediction for one phase (forward or backward) on one rank."""

    time: float
    """Predicted seconds of the phase (the slowest rank)."""
    compute: float
    """Seconds of block compute in it (no communication)."""
    traffic: Traffic
    """Bytes sent by the rank that sends the most across nodes."""
    memory: int
    """Peak bytes a rank holds beyond its inputs."""


@dataclass(frozen=True)
class SimResult:
    """Prediction for one forward and backward of an attention call."""

    name: str
    """``"AxB overlap"``, ``"AxB collective"`` or ``"ulysses"``."""
    forward: PhaseResult
    backward: PhaseResult

    @property
    def time(self) -> float:
        """Predicted seconds of forward plus backward."""
        return self.forward.time + self.backward.time

    @property
    def traffic(self) -> Traffic:
        """Bytes sent in forward plus backward, by link class."""
        return self.forward.traffic + self.backward.traffic

    @property
    def memory(self) -> int:
        """Peak bytes beyond the inputs, the larger of the two phases."""
        return max(self.forward.memory, self.backward.memory)


# ----------------------------------------------------------------------------------------------
# Placement


@functools.lru_cache(maxsize=256)
def group_links(tiling: Tiling, topology: Topology) -> Mapping[str, LinkClass]:
    """Link class of the Q ring and of the KV ring: ``"inter"`` if any ring of that kind crosses nodes."""
    groups = {"q": tiling.q_groups(), "kv": tiling.kv_groups()}
    links = {
        ring: "inter" if any(topology.ring_link(g) == "inter" for g in groups[ring]) else "intra" for ring in RINGS
    }
    return types.MappingProxyType(links)  # cached: read-only


def next_hops(tiling: Tiling, topology: Topology, rank: int) -> dict[str, LinkClass]:
    """Link class of ``rank``'s own sends: to the next member of its Q ring and of its KV ring.

    The Q ring of ``rank`` is ``a`` consecutive ranks (the next one wraps inside the group); its KV
    ring steps by ``a`` (the next one wraps modulo the world). See Note [Mesh tiling].
    """
    a = tiling.a
    q_next = rank - rank % a + (rank % a + 1) % a
    kv_next = (rank + a) % tiling.world
    return {"q": topology.hop(rank, q_next), "kv": topology.hop(rank, kv_next)}


@functools.lru_cache(maxsize=256)
def bottleneck_rank(tiling: Tiling, topology: Topology) -> int:
    """The first rank with the most rings whose next hop leaves its node (the slowest rank to send)."""

    def inter_rings(rank: int) -> int:
        hops = next_hops(tiling, topology, rank)
        return sum(hops[ring] == "inter" and size > 1 for ring, size in zip(RINGS, tiling.shape, strict=True))

    return max(range(tiling.world), key=lambda g: (inter_rings(g), -g))


def rank_traffic(plan: AttentionPlan, topology: Topology, phase: str, rank: int) -> dict[str, Traffic]:
    """Bytes ``rank`` sends in ``phase`` on its Q ring and on its KV ring, by link class of its hop."""
    hops = next_hops(plan.tiling, topology, rank)
    traffic = {}
    for ring in RINGS:
        nbytes = plan.bytes_sent(phase, group=ring)
        traffic[ring] = Traffic(intra=nbytes) if hops[ring] == "intra" else Traffic(inter=nbytes)
    return traffic


# ----------------------------------------------------------------------------------------------
# Compute


def block_seconds(work: BlockWork, shape: AttentionShape, topology: Topology, phase: str) -> float:
    """Seconds of one block kernel call in ``phase``."""
    seconds = work.pairs * shape.batch * shape.heads / topology.pairs_per_second
    return seconds * (topology.backward_factor if phase == "backward" else 1.0)


def timed_ranks(plan: AttentionPlan) -> range:
    """Ranks to replay: rank 0 stands for all when every rank has equal block costs per offset (no mask, and
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
# Schedules


def _overlap_seconds(plan: AttentionPlan, topology: Topology, phase: str, rank: int) -> float:
    """Replay the overlapped schedule's actions on ``rank``; see Note [Simulator cost model]."""
    nbytes, links = plan.step_bytes(phase), group_links(plan.tiling, topology)
    clock, link_free = 0.0, dict.fromkeys(LINK_CLASSES, 0.0)
    ends = {}
    host = 0.0  # compute time owed to transfers in flight (paid by the next block)
    for act in plan.overlap(phase).actions:
        if act.op == "compute":
            work = plan.block_at(rank, *act.block)
            clock += host + (0.0 if work is None else block_seconds(work, plan.shape, topology, phase))
            host = 0.0
        elif act.op == "launch":
            link, size = links[act.step.ring], nbytes[(act.step.ring, act.step.kind)]
            start = max(clock, link_free[link])
            link_free[link] = ends[act.step] = start + topology.transfer_time(link, size)
            host += 2 * size * topology.host_seconds_per_byte  # every rank sends and receives one
        else:
            clock = max(clock, ends.pop(act.step))
    assert not ends, f"steps launched but never waited for: {sorted(ends, key=str)}"
    return clock


def _compute_seconds(plan: AttentionPlan, topology: Topology, phase: str, rank: int) -> float:
    return sum(block_seconds(w, plan.shape, topology, phase) for w in plan.blocks(rank))


def _collective_comm_seconds(plan: AttentionPlan, topology: Topology, phase: str) -> float:
    links = group_links(plan.tiling, topology)
    return sum(
        topology.transfer_time(links[t.group], t.bytes_sent, messages=t.group_size - 1) for t in plan.transfers(phase)
    )


def simulate_phase(plan: AttentionPlan, topology: Topology, phase: str) -> PhaseResult:
    """Predicted time, compute, traffic and memory of one phase; see Note [Simulator cost model]."""
    check_option("phase", phase)
    ranks = timed_ranks(plan)
    compute = max(_compute_seconds(plan, topology, phase, g) for g in ranks)
    if plan.schedule == "overlap":
        time = max(_overlap_seconds(plan, topology, phase, g) for g in ranks)
    else:
        time = compute + _collective_comm_seconds(plan, topology, phase)
    by_ring = rank_traffic(plan, topology, phase, bottleneck_rank(plan.tiling, topology))
    return PhaseResult(time=time, compute=compute, traffic=by_ring["q"] + by_ring["kv"], memory=peak_bytes(plan, phase))


def simulate(plan: AttentionPlan, topology: Topology) -> SimResult:
    """Predict forward and backward of ``plan`` on ``topology`` (its ``schedule`` decides how)."""
    return SimResult(
        name=f"{plan.tiling} {plan.schedule}",
        forward=simulate_phase(plan, topology, "forward"),
        backward=simulate_phase(plan, topology, "backward"),
    )


def plan_for_topology(
    tiling: Tiling,
    shape: AttentionShape,
    topology: Topology,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    backward: Backward = "regather",
    schedule: Schedule = "overlap",
) -> AttentionPlan:
    """The plan with the overlapped schedule's greedy path ordered by the topology's link speeds."""
    return make_plan(
        tiling,
        shape,
        causal=causal,
        layout=layout,
        backward=backward,
        schedule=schedule,
        link_cost=ring_link_cost(tiling, topology),
    )


def ring_link_cost(tiling: Tiling, topology: Topology) -> tuple[float, float]:
    """Relative seconds per byte on the Q ring and the KV ring under ``topology`` (the faster is 1)."""
    links = group_links(tiling, topology)
    cost = [1.0 / topology.bandwidth(links[ring]) for ring in RINGS]
    return (cost[0] / min(cost), cost[1] / min(cost))
