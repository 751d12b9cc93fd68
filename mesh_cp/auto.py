"""A CP mesh tiled by the cost model: :func:`auto_mesh` joins :mod:`mesh_cp.sim` (which tile, and how many
head-parallel ranks) and :mod:`mesh_cp.runtime` (the process groups), so that neither imports the other."""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core import AttentionShape, Tiling
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.sim import Topology, choose_hybrid, choose_tile, hybrid_link_cost

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
    heads: int | None = None,
    memory_budget: int | None = None,
    timeout: datetime.timedelta | None = None,
    debug: bool = False,
) -> CPMesh:
    """The mesh over ``group`` for a cluster of ``topology`` (a :class:`mesh_cp.sim.Topology` or a preset name
    such as ``"h100"``); collective over ``group``.

    ``tile="auto"`` takes the head-parallel degree ``u`` and the tile the cost model predicts fastest for the
    per-rank ``shape`` within ``memory_budget`` bytes per rank (:func:`mesh_cp.sim.choose_hybrid`: plain meshes,
    head-parallel x mesh hybrids, USP and Ulysses), and logs why (logger ``mesh_cp``; also in ``mesh.reason``).
    ``heads`` fixes ``u`` (``heads=1``: a plain mesh only); ``None`` lets ``tile="auto"`` choose it and means 1
    with an explicit tile, which then tiles the ``P / heads`` ranks of a mesh group. Any tile gets the overlapped
    schedule's move order from the two rings' link speeds on ``topology``.
    """
    if topology is None or (tile == "auto" and shape is None):
        raise ValueError(_NEEDS)
    if isinstance(topology, str):
        topology = Topology.preset(topology, head_dim=shape.head_dim if shape else 128)
    world = dist.get_world_size(group)
    reason = ""
    if tile == "auto":
        if heads == 1:
            tiling, reason = choose_tile(world, shape, topology, memory_budget=memory_budget)
        else:
            heads, tiling, reason = choose_hybrid(world, shape, topology, memory_budget=memory_budget, heads=heads)
        if dist.get_rank(group) == 0:
            logger.info("mesh_cp: %s", reason)
    else:
        if memory_budget is not None:
            raise ValueError(f"memory_budget= is what tile='auto' chooses within; tile {tile!r} was given")
        heads = 1 if heads is None else heads
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or world % heads:
            raise ValueError(
                f"heads={heads!r} must be a positive divisor of the CP group size {world} (the head-parallel "
                f"degree u of P = u x mesh ranks); heads=1 is plain Mesh-Attention"
            )
        tiling = Tiling.parse(tile, world // heads)
    return CPMesh.from_tiling(
        group,
        tiling,
        heads=heads,
        link_cost=hybrid_link_cost(heads, tiling, topology),
        reason=reason,
        timeout=timeout,
        debug=debug,
    )
