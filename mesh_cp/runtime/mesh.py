"""The CP mesh: a context-parallel process group, its tiling, and its Q-group / KV-group subgroups."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core.plan import AttentionShape, Tiling
from mesh_cp.runtime.comm import all_gather

if TYPE_CHECKING:
    from mesh_cp.sim import Topology

logger = logging.getLogger("mesh_cp")


@dataclass(frozen=True, eq=False)
class CPMesh:
    """A context-parallel group of ``P`` ranks tiled ``a x b``; see Note [Mesh tiling] in
    :mod:`mesh_cp.core.plan`.

    Build it with :meth:`create` (collective over ``group``) or :meth:`from_device_mesh`; pass it
    explicitly to :func:`mesh_cp.mesh_attn_func`. There is no default: ``None`` never means "world".
    """

    group: ProcessGroup
    """The CP process group (rank order = sequence-chunk order)."""
    q_group: ProcessGroup
    """This rank's Q-group: the ``a`` CP ranks whose Q rows it computes."""
    kv_group: ProcessGroup
    """This rank's KV-group: the ``b`` CP ranks whose KV columns it computes."""
    tiling: Tiling
    """The ``a x b`` tiling of the CP group."""
    rank: int
    """This process's rank within the CP group."""
    global_ranks: tuple[int, ...]
    """Global ranks of the CP group, indexed by CP rank."""
    link_cost: tuple[float, float] = (1.0, 1.0)
    """Relative seconds per byte on the Q ring and the KV ring (orders the overlapped schedule)."""
    reason: str = ""
    """Why ``tile="auto"`` chose this tile (empty for an explicit tile)."""

    @property
    def size(self) -> int:
        return self.tiling.world

    @property
    def tile(self) -> tuple[int, int]:
        return self.tiling.shape

    @classmethod
    def create(
        cls,
        group: ProcessGroup,
        *,
        tile: tuple[int, int] | str,
        topology: Topology | str | None = None,
        shape: AttentionShape | None = None,
        memory_budget: int | None = None,
    ) -> CPMesh:
        """Tile the CP process group ``group`` as ``tile = (a, b)`` (or ``"axb"``), ``a * b = group size``.

        ``tile="auto"`` picks the tile the cost model predicts fastest for ``topology`` (a
        :class:`mesh_cp.sim.Topology` or a preset name such as ``"h100"``) and ``shape`` (the per-rank
        :class:`mesh_cp.core.AttentionShape` of the attention calls), within ``memory_budget`` bytes per
        rank, and logs why (logger ``mesh_cp``; also in :attr:`reason`). With a topology the
        overlapped schedule orders its moves by the two rings' link speeds (Q-groups of
        consecutive ranks sit inside a node when ``a`` divides the ranks per node).

        Collective: every rank of ``group`` must call it with the same tile. It creates this rank's
        Q-group and KV-group as new process groups among their members only, so several CP groups
        (for example one per data-parallel replica) can build their meshes at the same time.
        """
        if group is None:
            raise ValueError(
                "group=None is not accepted: pass the context-parallel process group explicitly "
                "(for example torch.distributed.group.WORLD, or the CP group of your DP x CP layout)"
            )
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call init_process_group() first")
        cp_rank = dist.get_rank(group)
        if cp_rank < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the CP group it passed "
                f"(members {dist.get_process_group_ranks(group)}); pass the group this rank belongs to"
            )
        world = dist.get_world_size(group)
        if isinstance(topology, str):
            from mesh_cp.sim import Topology

            topology = Topology.preset(topology, head_dim=shape.head_dim if shape else 128)
        reason = ""
        if tile == "auto":
            if topology is None or shape is None:
                raise ValueError(
                    "tile='auto' needs topology= (a mesh_cp.sim.Topology or a preset name such as 'h100') and "
                    "shape= (mesh_cp.core.AttentionShape of the per-rank attention inputs) to choose from"
                )
            from mesh_cp.sim import choose_tile

            tiling, reason = choose_tile(world, shape, topology, memory_budget=memory_budget)
            if cp_rank == 0:
                logger.info("mesh_cp: %s", reason)
        else:
            tiling = Tiling.parse(tile, world)
        _check_same_tile(group, tiling)
        link_cost = (1.0, 1.0)
        if topology is not None:
            from mesh_cp.sim import ring_link_cost

            link_cost = ring_link_cost(tiling, topology)
        global_ranks = tuple(dist.get_process_group_ranks(group))
        backend = dist.get_backend(group)
        # Every member creates its Q-group first, then its KV-group. Q-groups are disjoint, and so
        # are KV-groups, so the member-local handshakes of new_group cannot wait on each other.
        q_group = dist.new_group(
            [global_ranks[r] for r in tiling.q_group(cp_rank)], backend=backend, use_local_synchronization=True
        )
        kv_group = dist.new_group(
            [global_ranks[r] for r in tiling.kv_group(cp_rank)], backend=backend, use_local_synchronization=True
        )
        return cls(
            group=group,
            q_group=q_group,
            kv_group=kv_group,
            tiling=tiling,
            rank=cp_rank,
            global_ranks=global_ranks,
            link_cost=link_cost,
            reason=reason,
        )

    @classmethod
    def from_device_mesh(cls, device_mesh, axis: str | int, *, tile: tuple[int, int] | str) -> CPMesh:
        """Tile the process group of one axis (name or index) of a ``torch.distributed.DeviceMesh``."""
        if axis is None:
            raise ValueError("axis=None is not accepted: name the DeviceMesh dimension that is context-parallel")
        names = device_mesh.mesh_dim_names
        if isinstance(axis, str) and (names is None or axis not in names):
            raise ValueError(f"DeviceMesh has no dimension {axis!r}; its dimensions are {names}")
        return cls.create(device_mesh.get_group(axis), tile=tile)

    def role_of(self, group_name: str) -> str | None:
        """``"q"``, ``"kv"`` or ``"cp"`` for this mesh's process-group names, ``None`` for others."""
        for role, pg in (("q", self.q_group), ("kv", self.kv_group), ("cp", self.group)):
            if pg.group_name == group_name:
                return role
        return None

    def __str__(self) -> str:
        a, b = self.tile
        q = [self.global_ranks[r] for r in self.tiling.q_group(self.rank)]
        kv = [self.global_ranks[r] for r in self.tiling.kv_group(self.rank)]
        return f"CP({a}x{b}) rank {self.rank}: Q-group {q}, KV-group {kv}"


def _check_same_tile(group: ProcessGroup, tiling: Tiling) -> None:
    """Raise on every rank when the members of ``group`` asked for different tiles."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([tiling.a, tiling.b], dtype=torch.int64, device=device)
    tiles = [tuple(pair) for pair in all_gather(mine, group).tolist()]
    if len(set(tiles)) != 1:
        listing = ", ".join(f"rank {r}: {a}x{b}" for r, (a, b) in enumerate(tiles))
        raise ValueError(
            f"ranks of the CP group asked for different tiles ({listing}); pass the same tile on every rank"
        )
