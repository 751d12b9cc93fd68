"""Decoding with a sharded K/V cache on a :class:`Topology`: Tree-Attention against passing or gathering the cache
(no torch).

::

    shape = DecodeShape(batch=1, new_tokens=1, heads=32, kv_heads=8, head_dim=128, context=65536, itemsize=2)
    costs = simulate_decode(shape, 16, Topology.h100_infiniband())   # {"tree": DecodeCost, "ring": ..., ...}
    print(format_decode_table(decode_table(shape, 16, Topology.h100_infiniband(), [4096, 65536])))

Note [Decode cost model]
~~~~~~~~~~~~~~~~~~~~~~~~
One attention call of one layer decoding ``k`` new tokens (:class:`~mesh_cp.core.decode.DecodeShape`) with a cache
of ``S`` tokens sharded over ``P`` CP ranks (the largest shard has ``ceil(S / P)`` tokens); the queries are
replicated. Compute of ``T`` cache tokens is ``B * Hq * k * T`` query-key pairs at ``topology.pairs_per_second``.

``"tree"`` (Note [Tree decoding], what :mod:`mesh_cp.runtime.decode` runs): every rank attends to its own shard,
``compute = B Hq k ceil(S / P) / pairs_per_second``, then the collectives of
``DecodeReduction.for_tile(a, b).collectives(shape)`` one after another, one all-gather per level: over the
Q-group (``a`` consecutive ranks), then the KV-group (ranks ``g % a + j a``), each member's piece the packed ``[o,
lse]`` (``shape.piece_bytes``; the local merge after each is not charged). Each is a ring all-gather of ``n``
members on its level's link: ``n - 1`` messages of one piece, ``(n - 1) (latency + piece / bandwidth)``. A level's
link is ``"inter"`` if any of its groups crosses nodes (:meth:`Topology.ring_link`). Default tile: ``a = gcd(P,
ranks_per_node)`` (node-local Q-groups), ``b = P / a``. ``"tree flat"`` is the tile ``1 x P``: one all-gather
over the whole group. Bytes per rank are ``DecodeReduction.bytes_by_level``: independent of ``S``.

``"ring"`` (Ring-Attention decoding): the K/V shards go around a ring of all ``P`` ranks, ``P - 1`` steps of one
shard (``shape.shard_bytes(P)``) on the ring's slowest link; the compute of a shard overlaps the next transfer::

    time = step_compute + (P - 1) * max(step_compute, latency + shard / bandwidth)

Every rank computes over the whole cache (the queries are replicated). A rank holds its shard and two in-flight
buffers (the one it sends and the one it receives). Bytes: ``(P - 1) * shard`` per rank, growing with ``S``.

``"gather"``: a ring all-gather of the cache to every rank, ``(P - 1) * (latency + shard / bandwidth)`` on the
group's slowest link, then attention over the whole cache on every rank (nothing overlaps); each rank holds the
whole cache (``shape.shard_bytes(1)``).

Traffic is that of the rank that sends the most across nodes, by the link class of its hops (as in Note [Simulator
cost model]): with a node-local tile a tree rank sends its Q level inside its node and its KV level across nodes;
ring and gather send on the link of the rank's next hop, ``"inter"`` as soon as the ring spans nodes.

Ignored: decode kernels are bound by memory bandwidth (reading the cache), not by the prefill kernel's pair rate,
so compute is underestimated for every method alike; kernel launch and merge arithmetic (the ``exp`` and divide of
the tree's local merges); NCCL's low-latency protocols for small collectives (a ring all-gather of a few KiB is
latency-bound, which this model charges in full); the K/V append of the new tokens, the q projection and sampling;
contention between the concurrent groups of one level (each rank has its own NIC, as :class:`Topology` assumes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from mesh_cp.core.decode import DecodeReduction, DecodeShape
from mesh_cp.core.options import positive_int
from mesh_cp.core.tiling import factorizations
from mesh_cp.sim.topology import LinkClass, Topology

DECODE_METHODS: tuple[str, ...] = ("tree", "tree flat", "ring", "gather")
"""The keys of :func:`simulate_decode`, in the order it returns them."""


@dataclass(frozen=True)
class DecodeLevel:
    """One level of a tree reduction: its groups' size, their link class and the bytes a rank sends there."""

    members: int
    link: LinkClass
    bytes_sent: int
    """Bytes one rank sends per call at this level (its all-gather)."""


@dataclass(frozen=True)
class DecodeCost:
    """Predicted cost of one decode attention call of one layer on one rank (the slowest)."""

    method: str
    """One of :data:`DECODE_METHODS`."""
    bytes_intra: int
    """Bytes the reported rank sends inside its node."""
    bytes_inter: int
    """Bytes the reported rank sends to other nodes."""
    messages: int
    """Latency terms paid one after another."""
    compute_s: float
    """Seconds of attention compute (all of it, overlapped or not)."""
    comm_s: float
    """Seconds of communication (all of it, overlapped or not)."""
    time_s: float
    """Predicted seconds of the call."""
    kv_bytes_per_rank: int
    """K/V cache bytes a rank holds during the call (its shard, buffers in flight or the gathered cache)."""
    tile: tuple[int, int] | None = None
    """``(a, b)`` of a tree method, ``None`` otherwise."""
    levels: tuple[DecodeLevel, ...] = ()
    """The tree's levels in the order they run (``()`` for other methods and one rank)."""

    @property
    def bytes_total(self) -> int:
        """Bytes the reported rank sends, both link classes."""
        return self.bytes_intra + self.bytes_inter


# ----------------------------------------------------------------------------------------------
# Validation and placement


def _check_world(world: int) -> int:
    return positive_int("world", world, what="CP ranks the cache is sharded over")


def _check_inputs(shape: DecodeShape, topology: Topology) -> None:
    if not isinstance(shape, DecodeShape):
        raise TypeError(f"shape must be a mesh_cp.core.DecodeShape, got {type(shape).__name__}: {shape!r}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a mesh_cp.sim.Topology (e.g. Topology.h100_infiniband()), got {topology!r}")


def check_tile(tile: object, world: int) -> tuple[int, int]:
    """``tile`` as ``(a, b)`` if it is two positive ints with ``a * b == world``; else ``ValueError`` with the
    factorizations of ``world`` to choose from."""
    choices = ", ".join(f"({a}, {b})" for a, b in factorizations(world))
    ok = (
        isinstance(tile, (tuple, list))
        and len(tile) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in tile)
    )
    if not ok or tile[0] * tile[1] != world:
        raise ValueError(
            f"tile {tile!r} must be two positive ints (a, b) with a * b == world={world}; choose one of {choices}"
        )
    return (tile[0], tile[1])


def default_decode_tile(world: int, topology: Topology) -> tuple[int, int]:
    """The node-local tile: ``a`` the largest divisor of ``world`` that divides ``ranks_per_node``, ``b = world / a``."""
    a = math.gcd(_check_world(world), topology.ranks_per_node)
    return (a, world // a)


def tree_level_links(tile: tuple[int, int], topology: Topology) -> tuple[LinkClass, ...]:
    """Link class of each level of ``DecodeReduction.for_tile(*tile)``: the Q level is ``"inter"`` if any Q-group
    (ranks ``g // a * a + i``) crosses nodes, the KV level if any KV-group (ranks ``g % a + j * a``) does."""
    a, b = tile
    q_groups = ([q * a + i for i in range(a)] for q in range(b))
    kv_groups = ([r + j * a for j in range(b)] for r in range(a))
    links: list[LinkClass] = []
    for size, groups in ((a, q_groups), (b, kv_groups)):
        if size > 1:
            links.append("inter" if any(topology.ring_link(g) == "inter" for g in groups) else "intra")
    return tuple(links)


def _split(nbytes: int, link: LinkClass) -> dict[str, int]:
    return {"bytes_intra": nbytes if link == "intra" else 0, "bytes_inter": nbytes if link == "inter" else 0}


def _compute_seconds(shape: DecodeShape, tokens: int, topology: Topology) -> float:
    return shape.batch * shape.heads * shape.new_tokens * tokens / topology.pairs_per_second


# ----------------------------------------------------------------------------------------------
# The methods


def tree_cost(shape: DecodeShape, world: int, topology: Topology, tile: tuple[int, int], method: str) -> DecodeCost:
    """Tree decoding over the ``a x b`` ``tile`` of ``world`` ranks; see Note [Decode cost model]."""
    reduction = DecodeReduction.for_tile(*tile)
    links = tree_level_links(tile, topology)
    levels = tuple(
        DecodeLevel(n, link, nbytes)
        for n, link, nbytes in zip(reduction.levels, links, reduction.bytes_by_level(shape), strict=True)
    )
    comm, messages = 0.0, 0
    for (_, n, piece), link in zip(reduction.collectives(shape), links, strict=True):
        comm += topology.transfer_time(link, (n - 1) * piece, messages=n - 1)
        messages += n - 1
    compute = _compute_seconds(shape, -(-shape.context // world), topology)
    return DecodeCost(
        method=method,
        bytes_intra=sum(lv.bytes_sent for lv in levels if lv.link == "intra"),
        bytes_inter=sum(lv.bytes_sent for lv in levels if lv.link == "inter"),
        messages=messages,
        compute_s=compute,
        comm_s=comm,
        time_s=compute + comm,
        kv_bytes_per_rank=shape.shard_bytes(world),
        tile=tile,
        levels=levels,
    )


def ring_cost(shape: DecodeShape, world: int, topology: Topology) -> DecodeCost:
    """Ring-Attention decoding: the shards go around all ``world`` ranks, compute overlapping the next transfer."""
    shard = shape.shard_bytes(world)
    link = topology.ring_link(range(world))
    step_compute = _compute_seconds(shape, -(-shape.context // world), topology)
    step_comm = topology.transfer_time(link, shard) if world > 1 else 0.0
    return DecodeCost(
        method="ring",
        **_split((world - 1) * shard, link),
        messages=world - 1,
        compute_s=world * step_compute,
        comm_s=(world - 1) * step_comm,
        time_s=step_compute + (world - 1) * max(step_compute, step_comm),
        kv_bytes_per_rank=shard * (3 if world > 1 else 1),
    )


def gather_cost(shape: DecodeShape, world: int, topology: Topology) -> DecodeCost:
    """All-gather the cache to every rank, then attend to all of it on each."""
    shard = shape.shard_bytes(world)
    link = topology.ring_link(range(world))
    comm = topology.transfer_time(link, (world - 1) * shard, messages=world - 1) if world > 1 else 0.0
    compute = _compute_seconds(shape, shape.context, topology)
    return DecodeCost(
        method="gather",
        **_split((world - 1) * shard, link),
        messages=world - 1,
        compute_s=compute,
        comm_s=comm,
        time_s=compute + comm,
        kv_bytes_per_rank=shape.shard_bytes(1),
    )


def simulate_decode(
    shape: DecodeShape, world: int, topology: Topology, *, tile: tuple[int, int] | None = None
) -> dict[str, DecodeCost]:
    """Predict one decode attention call of one layer with the cache of ``shape.context`` tokens sharded over
    ``world`` CP ranks, for each of :data:`DECODE_METHODS` (Note [Decode cost model]). ``tile`` is the ``(a, b)``
    of ``"tree"`` (default: :func:`default_decode_tile`, node-local Q-groups); ``"tree flat"`` is always
    ``(1, world)``. Raises ``ValueError`` for a ``world`` that is not a positive int or a ``tile`` that does not
    multiply to it."""
    _check_inputs(shape, topology)
    _check_world(world)
    tile = default_decode_tile(world, topology) if tile is None else check_tile(tile, world)
    return {
        "tree": tree_cost(shape, world, topology, tile, "tree"),
        "tree flat": tree_cost(shape, world, topology, (1, world), "tree flat"),
        "ring": ring_cost(shape, world, topology),
        "gather": gather_cost(shape, world, topology),
    }


# ----------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class DecodeRow:
    """One row of :func:`decode_table`: one context length, every method."""

    context: int
    costs: dict[str, DecodeCost]

    def fastest(self) -> str:
        """The method with the least predicted time (the first of :data:`DECODE_METHODS` on a tie)."""
        return min(DECODE_METHODS, key=lambda m: self.costs[m].time_s)


def decode_table(
    shape: DecodeShape,
    world: int,
    topology: Topology,
    contexts: Iterable[int],
    *,
    tile: tuple[int, int] | None = None,
) -> list[DecodeRow]:
    """:func:`simulate_decode` of ``shape`` at each cache length in ``contexts`` (``shape.context`` is replaced)."""
    _check_inputs(shape, topology)
    rows = []
    for context in contexts:
        rows.append(DecodeRow(context, simulate_decode(replace(shape, context=context), world, topology, tile=tile)))
    return rows


def format_decode_table(rows: Sequence[DecodeRow], methods: Sequence[str] = DECODE_METHODS) -> str:
    """Plain-text table of :func:`decode_table`'s rows: per method, microseconds per call and KiB sent per rank
    (``intra + inter``), then the fastest method."""
    unknown = [m for m in methods if m not in DECODE_METHODS]
    if unknown:
        raise ValueError(f"unknown decode methods {unknown}; choose from {list(DECODE_METHODS)}")
    head = ["context"] + [f"{m} us" for m in methods] + [f"{m} KiB" for m in methods] + ["fastest"]
    lines = [head]
    for row in rows:
        times = [f"{row.costs[m].time_s * 1e6:.1f}" for m in methods]
        kib = [f"{row.costs[m].bytes_intra / 1024:.0f}+{row.costs[m].bytes_inter / 1024:.0f}" for m in methods]
        lines.append([str(row.context), *times, *kib, row.fastest()])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
