"""A CP mesh tiled by the cost model: :func:`auto_mesh` joins :mod:`mesh_cp.sim` (which tile, and how many
head-parallel ranks) and :mod:`mesh_cp.runtime` (the process groups), so that neither imports the other."""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core import AttentionShape, Tiling, check_head_parallel
from mesh_cp.core.options import refuse_keywords
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.sim import Topology, choose, link_cost

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
    head_parallel: int | None = None,
    memory_budget: int | None = None,
    timeout: datetime.timedelta | None = None,
    debug: bool = False,
    **renamed,
) -> CPMesh:
    """The mesh over ``group`` for a cluster of ``topology`` (a :class:`mesh_cp.sim.Topology` or a preset name
    such as ``"h100"``); collective over ``group``.

    ``tile="auto"`` takes the head-parallel degree ``u`` and the tile the cost model predicts fastest for the
    per-rank ``shape`` within ``memory_budget`` bytes per rank (:func:`mesh_cp.sim.choose`: plain meshes,
    head-parallel x mesh plans, USP and Ulysses), and logs why (logger ``mesh_cp``; also in ``mesh.reason``).
    ``head_parallel`` fixes ``u`` (``1``: a plain mesh only); ``None`` lets ``tile="auto"`` choose it and means 1
    with an explicit tile, which then tiles the ``P / head_parallel`` ranks of a mesh group. Any tile gets the
    overlapped schedule's move order from the two rings' link speeds on ``topology`` (:func:`mesh_cp.sim.link_cost`).
    """
    refuse_keywords(renamed, where="auto_mesh")
    if topology is None or (tile == "auto" and shape is None):
        raise ValueError(_NEEDS)
    if isinstance(topology, str):
        topology = Topology.preset(topology, head_dim=shape.head_dim if shape else 128)
    world = dist.get_world_size(group)
    reason = ""
    if tile == "auto":
        u, tiling, reason = choose(world, shape, topology, memory_budget=memory_budget, head_parallel=head_parallel)
        if dist.get_rank(group) == 0:
            logger.info("mesh_cp: %s", reason)
    else:
        if memory_budget is not None:
            raise ValueError(f"memory_budget= is what tile='auto' chooses within; tile {tile!r} was given")
        u = check_head_parallel(world, 1 if head_parallel is None else head_parallel, shape)
        tiling = Tiling.parse(tile, world // u)
    return CPMesh.from_tiling(
        group,
        tiling,
        head_parallel=u,
        link_cost=link_cost(u, tiling, topology),
        reason=reason,
        timeout=timeout,
        debug=debug,
    )
