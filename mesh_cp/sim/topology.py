"""The hardware a plan runs on, as a cost model: links, latencies, kernel speed, rank placement.

Pure Python (no torch). See Note [Simulator cost model] in :mod:`mesh_cp.sim.model` for how the
simulator uses these numbers.

Placement: CP rank ``g`` lives on node ``g // ranks_per_node``. A Q-group is ``a`` consecutive ranks,
so with ``ranks_per_node % a == 0`` it sits inside one node and only the KV ring (stride ``a``)
crosses nodes::

    P = 16, 4 ranks per node, tile 4 x 4        Q ring: 0 -> 1 -> 2 -> 3 -> 0   (inside node 0)
      node 0: ranks  0  1  2  3                 KV ring: 0 -> 4 -> 8 -> 12 -> 0  (every hop crosses)
      node 1: ranks  4  5  6  7
      node 2: ranks  8  9 10 11
      node 3: ranks 12 13 14 15
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Literal

from mesh_cp.core.options import positive_int

LinkClass = Literal["intra", "inter"]
LINK_CLASSES: tuple[LinkClass, ...] = ("intra", "inter")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A cluster of nodes with ``ranks_per_node`` GPUs each; every GPU has its own network card.

    Bandwidths are bytes per second *per rank and direction*: what one GPU can send while it also
    receives as much (NVLink and InfiniBand are full duplex).
    """

    ranks_per_node: int
    """GPUs per node; CP rank ``g`` lives on node ``g // ranks_per_node``."""
    intra_bandwidth: float
    """Bytes/s one rank sends to ranks of its own node (NVLink), all peers together."""
    inter_bandwidth: float
    """Bytes/s one rank sends to other nodes (its own NIC), all peers together."""
    pairs_per_second: float
    """Query-key pairs per second of the forward block kernel, counted per head and batch element
    (a full ``L x L`` block with batch ``B`` and ``H`` heads is ``B * H * L * L`` pairs)."""
    intra_latency: float = 0.0
    """Seconds per message inside a node."""
    inter_latency: float = 0.0
    """Seconds per message between nodes."""
    backward_factor: float = 2.5
    """Backward block time divided by forward block time (flash-attention's backward does 2.5x the
    matmul FLOPs of its forward)."""
    host_seconds_per_byte: float = 0.0
    """Compute time a rank loses per byte it sends or receives while it computes: the processor time
    of the network stack on a CPU host, the SMs of communication kernels on a GPU. 0 in the presets
    (GPU NICs move data by DMA); measured by scripts/emulated_cluster.py for its CPU host."""

    def __post_init__(self) -> None:
        positive_int("Topology.ranks_per_node", self.ranks_per_node, what="GPUs per node")
        positive = ("intra_bandwidth", "inter_bandwidth", "pairs_per_second", "backward_factor")
        for name in positive + ("intra_latency", "inter_latency", "host_seconds_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"Topology.{name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and name in positive):
                bound = "> 0" if name in positive else ">= 0"
                raise ValueError(f"Topology.{name} must be {bound}, got {value!r}; pass the measured value")

    # ------------------------------------------------------------------------------------------
    # Presets

    @classmethod
    def h100_infiniband(cls, *, head_dim: int = 128, ranks_per_node: int = 8) -> Topology:
        """DGX H100-like nodes: NVLink 4 and one 400 Gb/s NDR InfiniBand NIC per GPU.

        Assumptions: NVLink 900 GB/s bidirectional per GPU = 450e9 B/s per direction; NDR 400 Gb/s =
        50e9 B/s per direction; p2p latency about 5 us inside a node and 10 us across nodes (NCCL
        small-message figures); bf16 attention kernel sustaining 4e14 FLOP/s (FlashAttention-2/3
        on H100 SXM runs at 350-700 TFLOP/s). A query-key pair costs ``4 * head_dim`` FLOP forward
        (``QK^T`` and ``PV``, two multiply-adds per element), so pairs/s = FLOP/s / (4 * head_dim).
        """
        return cls(
            ranks_per_node=ranks_per_node,
            intra_bandwidth=450e9,
            inter_bandwidth=50e9,
            intra_latency=5e-6,
            inter_latency=1e-5,
            pairs_per_second=4e14 / (4 * _check_head_dim(head_dim)),
        )

    @classmethod
    def a100_infiniband(cls, *, head_dim: int = 128, ranks_per_node: int = 8) -> Topology:
        """DGX A100-like nodes: NVLink 3 and one 200 Gb/s HDR InfiniBand NIC per GPU.

        Assumptions: NVLink 600 GB/s bidirectional = 300e9 B/s per direction; HDR 200 Gb/s = 25e9
        B/s; latencies as :meth:`h100_infiniband`; bf16 attention at 2e14 FLOP/s (FlashAttention-2
        on A100 reaches 60-70% of the 312 TFLOP/s peak).
        """
        return cls(
            ranks_per_node=ranks_per_node,
            intra_bandwidth=300e9,
            inter_bandwidth=25e9,
            intra_latency=5e-6,
            inter_latency=1e-5,
            pairs_per_second=2e14 / (4 * _check_head_dim(head_dim)),
        )

    @classmethod
    def preset(cls, name: str, *, head_dim: int = 128, ranks_per_node: int = 8) -> Topology:
        """A preset by name (see :data:`PRESETS`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; choose one of {sorted(PRESETS)} or a JSON file")
        return PRESETS[name](head_dim=head_dim, ranks_per_node=ranks_per_node)

    # ------------------------------------------------------------------------------------------
    # JSON

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict with the field names as keys (the inverse of :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        """Build from a dict with the keys of :meth:`to_dict`; optional fields may be left out."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown Topology keys {unknown}; the keys are {sorted(names)}")
        required = sorted(f.name for f in fields(cls) if f.default is MISSING)
        missing = [name for name in required if name not in d]
        if missing:
            raise ValueError(f"Topology dict is missing {missing}; give every one of {required}")
        return cls(**d)

    # ------------------------------------------------------------------------------------------
    # Placement and links

    def node(self, rank: int) -> int:
        """Node of CP rank ``rank``."""
        return rank // self.ranks_per_node

    def hop(self, src: int, dst: int) -> LinkClass:
        """Link class of a message from rank ``src`` to rank ``dst``."""
        return "intra" if self.node(src) == self.node(dst) else "inter"

    def ring_link(self, members: Sequence[int]) -> LinkClass:
        """Slowest hop of a ring ``members[p] -> members[p + 1]``: ``"inter"`` if any hop crosses nodes.

        Ring steps run in lockstep, so a step takes as long as the ring's slowest hop.
        """
        n = len(members)
        crosses = any(self.hop(members[p], members[(p + 1) % n]) == "inter" for p in range(n))
        return "inter" if crosses else "intra"

    def bandwidth(self, link: LinkClass) -> float:
        return self.intra_bandwidth if link == "intra" else self.inter_bandwidth

    def latency(self, link: LinkClass) -> float:
        return self.intra_latency if link == "intra" else self.inter_latency

    def transfer_time(self, link: LinkClass, nbytes: float, messages: int = 1) -> float:
        """Seconds to send ``nbytes`` in ``messages`` messages over one rank's ``link``."""
        return messages * self.latency(link) + nbytes / self.bandwidth(link)


def _check_head_dim(head_dim: int) -> int:
    return positive_int("head_dim", head_dim, what="the kernel's FLOP per pair scale")


PRESETS: dict[str, Callable[..., Topology]] = {
    "a100": Topology.a100_infiniband,
    "h100": Topology.h100_infiniband,
}
"""Topology presets by name; each takes ``head_dim`` and ``ranks_per_node`` keywords."""
