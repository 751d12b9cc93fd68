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

*Ulysses* (DeepSpeed-style sequence parallelism, for comparison): all-to-alls re-shard q, k, v from
sequence to heads and o back; backward sends dO in and dq, dk, dv out. Each is a direct all-to-all:
a rank sends one piece to every peer, those inside its node over NVLink while those on other nodes
go over its NIC. Each rank then computes the full-sequence attention of ``heads / P`` heads.

*Traffic* per rank and link class: bytes a rank sends over hops of that class (each ring step sends
to the next member of the ring). Ranks differ (with the 1 x P ring only the ranks at a node boundary
send across nodes); results report the rank that sends the most across nodes, which is the one the
timing above stands for. Every rank sends ``plan.bytes_sent(phase)`` in total.

*Memory* per rank is ``plan.peak_bytes(phase)``: bytes held at the phase's peak beyond the inputs.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass

from mesh_cp.core import AttentionPlan, AttentionShape, BlockWork, Tiling, check_seq_len, factorizations, make_plan
from mesh_cp.sim.topology import LINK_CLASSES, LinkClass, Topology

PHASES = ("forward", "backward")
RINGS = ("q", "kv")


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
    """Ranks to replay: rank 0 stands for all when every rank has equal block costs per offset."""
    equal = plan.layout == "zigzag" or not plan.causal
    return range(1) if equal else range(plan.tiling.world)


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
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} must be one of {PHASES}")
    ranks = timed_ranks(plan)
    compute = max(_compute_seconds(plan, topology, phase, g) for g in ranks)
    if plan.schedule == "overlap":
        time = max(_overlap_seconds(plan, topology, phase, g) for g in ranks)
    else:
        time = compute + _collective_comm_seconds(plan, topology, phase)
    by_ring = rank_traffic(plan, topology, phase, bottleneck_rank(plan.tiling, topology))
    return PhaseResult(time=time, compute=compute, traffic=by_ring["q"] + by_ring["kv"], memory=plan.peak_bytes(phase))


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
    layout: str = "zigzag",
    backward: str = "regather",
    schedule: str = "overlap",
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


# ----------------------------------------------------------------------------------------------
# Ulysses


def ulysses_unavailable(world: int, shape: AttentionShape) -> str | None:
    """Why Ulysses cannot run ``shape`` on ``world`` ranks, or ``None`` when it can.

    Heads are split over the ranks, so ``world`` must divide ``heads``. K/V heads are split the same
    way when ``world`` divides ``kv_heads``; when ``world > kv_heads`` they are replicated instead
    (each rank receives the one K/V head its query heads use), which needs ``kv_heads`` to divide
    ``world``.
    """
    if shape.heads % world:
        return f"Ulysses splits heads over ranks: P={world} does not divide heads={shape.heads}"
    kv = shape.kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        return f"Ulysses splits or replicates K/V heads: P={world} and kv_heads={kv} must divide one another"
    return None


def _all_to_all_seconds(piece: float, world: int, topology: Topology, rank: int) -> tuple[float, Traffic]:
    """Time and traffic of a direct all-to-all sending ``piece`` bytes from ``rank`` to each peer."""
    node = topology.node(rank)
    intra_peers = sum(1 for g in range(world) if g != rank and topology.node(g) == node)
    peers = {"intra": intra_peers, "inter": world - 1 - intra_peers}
    time = max(topology.transfer_time(link, n * piece, messages=n) if n else 0.0 for link, n in peers.items())
    return time, Traffic(intra=round(peers["intra"] * piece), inter=round(peers["inter"] * piece))


def simulate_ulysses(world: int, shape: AttentionShape, topology: Topology, *, causal: bool = True) -> SimResult:
    """Predict DeepSpeed-Ulysses attention: all-to-all over heads, full-sequence attention per rank.

    ``shape`` holds the per-rank sizes of the sequence-sharded inputs. Forward sends q, k, v in and o
    out, backward dO in and dq, dk, dv out, all in the input dtype; each q-sized tensor sends
    ``(P-1)/P`` of itself, a K or V sends one ``1/min(P, kv_heads)`` piece to each peer (K/V heads
    replicated when ``P > kv_heads``). Memory: the head-sharded copies of the four tensors of each
    phase and one statistics tensor (lse or delta). Raises ``NotImplementedError`` with the reason
    when :func:`ulysses_unavailable` says so.
    """
    reason = ulysses_unavailable(world, shape)
    if reason is not None:
        raise NotImplementedError(reason)
    q_bytes = shape.chunk_elems * shape.itemsize
    kv_bytes = q_bytes * shape.kv_heads // shape.heads  # one of K or V
    # Forward q, k, v in and o out; backward dO, dk, dv and dq have the same sizes.
    kv_piece = kv_bytes / min(world, shape.kv_heads)
    pieces = (q_bytes / world, kv_piece, kv_piece, q_bytes / world)
    rank = world - 1  # on the last node, which is the smallest: the most peers across nodes
    seq = shape.seq_local * world
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    heads_per_rank = shape.heads // world
    memory = 2 * q_bytes + 2 * kv_bytes * max(1, world // shape.kv_heads) + shape.stats_elems * shape.acc_itemsize
    phases = {}
    for phase in PHASES:
        compute = pairs * shape.batch * heads_per_rank / topology.pairs_per_second
        compute *= topology.backward_factor if phase == "backward" else 1.0
        comm, traffic = 0.0, Traffic()
        for piece in pieces:
            seconds, sent = _all_to_all_seconds(piece, world, topology, rank)
            comm, traffic = comm + seconds, traffic + sent
        phases[phase] = PhaseResult(time=comm + compute, compute=compute, traffic=traffic, memory=memory)
    return SimResult(name="ulysses", forward=phases["forward"], backward=phases["backward"])


# ----------------------------------------------------------------------------------------------
# Tile choice


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
    layout: str = "zigzag",
    backward: str = "regather",
    schedule: str = "overlap",
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
    layout: str = "zigzag",
    backward: str = "regather",
    memory_budget: int | None = None,
    schedule: str = "overlap",
) -> tuple[Tiling, str]:
    """The tile with the fastest predicted forward + backward within ``memory_budget``, and why.

    Simulates every factorisation ``a x b`` of ``world`` with ``schedule``; drops tiles whose peak
    memory per rank (:meth:`AttentionPlan.peak_bytes`) exceeds ``memory_budget`` bytes (``None``:
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
