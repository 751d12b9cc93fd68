"""DeepSpeed-Ulysses attention on a :class:`Topology`, for comparison with the mesh (no torch).

*Ulysses* (DeepSpeed-style sequence parallelism, for comparison): all-to-alls re-shard q, k, v from
sequence to heads and o back; backward sends dO in and dq, dk, dv out. Each is a direct all-to-all:
a rank sends one piece to every peer, those inside its node over NVLink while those on other nodes
go over its NIC. Each rank then computes the full-sequence attention of ``heads / P`` heads.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh_cp.core import AttentionShape
from mesh_cp.core.options import PHASES
from mesh_cp.sim.model import PhaseResult, SimResult, Traffic
from mesh_cp.sim.topology import Topology


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


def all_to_all_seconds(piece: float, members: Sequence[int], topology: Topology, rank: int) -> tuple[float, Traffic]:
    """Time and traffic of a direct all-to-all among the CP ranks ``members`` sending ``piece`` bytes from
    ``rank`` to each of its peers: those inside its node over its NVLink, the others over its NIC, both at once
    (the slower link sets the time). Also the head group's all-to-alls of :mod:`mesh_cp.sim.hybrid`."""
    node = topology.node(rank)
    intra_peers = sum(1 for g in members if g != rank and topology.node(g) == node)
    peers = {"intra": intra_peers, "inter": len(members) - 1 - intra_peers}
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
            seconds, sent = all_to_all_seconds(piece, range(world), topology, rank)
            comm, traffic = comm + seconds, traffic + sent
        phases[phase] = PhaseResult(time=comm + compute, compute=compute, traffic=traffic, memory=memory)
    return SimResult(name="ulysses", forward=phases["forward"], backward=phases["backward"])
