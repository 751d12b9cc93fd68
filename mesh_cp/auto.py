"""A CP mesh tiled by the cost model: :func:`auto_mesh` joins :mod:`mesh_cp.sim` (which tile) and
:mod:`mesh_cp.runtime` (the process groups), so that neither imports the other."""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core import AttentionShape, Tiling
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.sim import Topology, choose_tile, ring_link_cost

logger = logging.getLogger("mesh_cp")

_NEEDS = (
    "tile='auto' needs topology= (a mesh_cp.sim.Topology or a preset name such as 'h100') and "
    "shape= (mesh_cp.core.AttentionShape of the per-rank attention inputs) to choose from"
)


def auto_mesh(
    group: ProcessGroup,
    *,
    topology: Topology | str,
    shape: AttentionShape | None = None,
    tile: tuple[int, int] | str = "auto",
    memory_budget: int | None = None,
    timeout: datetime.timedelta | None = None,
    debug: bool = False,
) -> CPMesh:
    """The mesh over ``group`` for a cluster of ``topology`` (a :class:`mesh_cp.sim.Topology` or a preset name
    such as ``"h100"``); collective over ``group``.

    ``tile="auto"`` takes the tile the cost model predicts fastest for the per-rank ``shape`` within
    ``memory_budget`` bytes per rank, and logs why (logger ``mesh_cp``; also in ``mesh.reason``). Any tile
    gets the overlapped schedule's move order from the two rings' link speeds on ``topology``.
    """
    if topology is None or (tile == "auto" and shape is None):
        raise ValueError(_NEEDS)
    if isinstance(topology, str):
        topology = Topology.preset(topology, head_dim=shape.head_dim if shape else 128)
    world = dist.get_world_size(group)
    reason = ""
    if tile == "auto":
        tiling, reason = choose_tile(world, shape, topology, memory_budget=memory_budget)
        if dist.get_rank(group) == 0:
            logger.info("mesh_cp: %s", reason)
    else:
        if memory_budget is not None:
            raise ValueError(f"memory_budget= is what tile='auto' chooses within; tile {tile!r} was given")
        tiling = Tiling.parse(tile, world)
    return CPMesh.from_tiling(
        group, tiling, link_cost=ring_link_cost(tiling, topology), reason=reason, timeout=timeout, debug=debug
    )
