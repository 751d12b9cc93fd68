"""Megatron's CP group tiled ``a x b`` as a :class:`~mesh_cp.CPMesh`, with Q-groups placed inside nodes when
the ranks per node are known."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch.distributed as dist

from mesh_cp.core import AttentionShape, factorizations, most_square_tile
from mesh_cp.core.head_parallel import check_head_parallel
from mesh_cp.runtime.mesh import CPMesh

logger = logging.getLogger("mesh_cp")


def cp_ranks_per_node(cp_ranks: tuple[int, ...], ranks_per_node: int) -> int | None:
    """How many consecutive CP ranks share a node of ``ranks_per_node`` GPUs (global rank // R is the
    node), when every node holds the same number of consecutive CP ranks; ``None`` otherwise."""
    nodes = [r // ranks_per_node for r in cp_ranks]
    runs: list[int] = []
    for i, node in enumerate(nodes):
        if i and node == nodes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs[0] if len(set(runs)) == 1 else None


def node_local_tile(cp_size: int, per_node: int) -> tuple[int, int]:
    """The most square ``a x b`` of ``cp_size`` whose Q-groups (``a`` consecutive CP ranks) fit in a node
    of ``per_node`` CP ranks: ``a`` divides ``per_node`` (the whole CP group when it fits in a node)."""
    if per_node >= cp_size:
        return most_square_tile(cp_size)
    fits = [t for t in factorizations(cp_size) if per_node % t[0] == 0]
    return min(fits, key=lambda t: (abs(math.log(t[0] / t[1])), -t[0]))


def build_mesh(
    cp_group: dist.ProcessGroup,
    *,
    tile: tuple[int, int] | str = "square",
    head_parallel: int | None = None,
    ranks_per_node: int | None = None,
    topology=None,
    shape: AttentionShape | None = None,
) -> CPMesh:
    """Tile Megatron's CP group ``a x b`` (collective over ``cp_group``); see :class:`MeshProvider`.

    With ``ranks_per_node`` (or a topology) the CP ranks per node are counted from the global ranks, a
    ``"square"`` tile keeps Q-groups inside a node, and an explicit tile whose Q-groups cross nodes is
    logged as a warning (the Q ring then runs over the inter-node network).

    ``head_parallel = u > 1``: the head-parallel x mesh hybrid (Note [Head-parallel x mesh] in
    :mod:`mesh_cp.runtime.heads`): groups of ``u`` consecutive CP ranks exchange heads, and
    ``tile`` tiles the ``CP / u`` ranks holding the same heads (``"square"``: the most square, node-local when the
    ranks per node are known). ``None``: 1, or with ``tile="auto"`` the cost model's choice (as
    :func:`mesh_cp.auto_mesh`).

    ``tile="auto"`` or a topology go through :func:`mesh_cp.auto_mesh` (the cost model's tile, or the given one
    with the schedule's link costs on that topology); otherwise :meth:`mesh_cp.CPMesh.create`.
    """
    if cp_group is None:
        raise ValueError("cp_group=None is not accepted: pass Megatron's context-parallel group")
    cp_size = dist.get_world_size(cp_group)
    if head_parallel is not None:
        check_head_parallel(cp_size, head_parallel)
    if topology is not None:
        from mesh_cp.sim import Topology

        if isinstance(topology, str):
            topology = Topology.preset(topology, ranks_per_node=ranks_per_node or 8)
        ranks_per_node = ranks_per_node or topology.ranks_per_node
    per_node = _cp_ranks_per_node(cp_group, ranks_per_node)
    if tile == "square":
        u = head_parallel or 1
        mesh_per_node = _mesh_ranks_per_node(per_node, u, cp_size)
        tile = node_local_tile(cp_size // u, mesh_per_node) if mesh_per_node else most_square_tile(cp_size // u)
    cp_topology = replace(topology, ranks_per_node=per_node) if topology is not None and per_node else None
    if tile == "auto" and cp_topology is None:
        raise ValueError(
            "tile='auto' needs topology= (a mesh_cp.sim.Topology or preset name such as 'h100') whose "
            "ranks_per_node places every CP rank on a node, and shape= (per-rank AttentionShape)"
        )
    if cp_topology is not None:
        from mesh_cp.auto import auto_mesh

        # shape= is read by tile='auto' only (the cost model's choice); a given tile takes the link costs alone.
        options = {"shape": shape} if tile == "auto" else {}
        mesh = auto_mesh(cp_group, topology=cp_topology, tile=tile, head_parallel=head_parallel, **options)
    else:
        mesh = CPMesh.create(cp_group, tile=tile, head_parallel=head_parallel or 1)
    if per_node:
        _warn_across_nodes(mesh, per_node)
    return mesh


def _cp_ranks_per_node(cp_group: dist.ProcessGroup, ranks_per_node: int | None) -> int | None:
    """How many consecutive CP ranks share a node of ``ranks_per_node`` GPUs; ``None`` when unknown or uneven
    (logged)."""
    if not ranks_per_node:
        return None
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    per_node = cp_ranks_per_node(ranks, ranks_per_node)
    if per_node is None:
        logger.warning(
            "mesh_cp: CP group %s does not hold the same number of consecutive ranks on every node of %d GPUs; "
            "Q-groups are not placed by node",
            list(ranks),
            ranks_per_node,
        )
    return per_node


def _mesh_ranks_per_node(per_node: int | None, u: int, cp_size: int) -> int | None:
    """How many consecutive ranks of each mesh group (CP ranks ``i, u + i, ...`` with ``head_parallel = u``; the CP
    group itself when ``u = 1``) share a node of ``per_node`` consecutive CP ranks; ``None`` when unknown, or when
    head groups cross nodes."""
    if not per_node or u == 1 or per_node >= cp_size:
        return per_node
    return per_node // u if per_node % u == 0 else None


def _warn_across_nodes(mesh: CPMesh, per_node: int) -> None:
    """Log head groups (``mesh.head_parallel`` consecutive CP ranks) or Q-groups that cross nodes of ``per_node`` CP
    ranks: their all-to-all or ring then runs over the inter-node network."""
    cp_size, u = mesh.size, mesh.head_parallel
    if per_node < cp_size and per_node % u:
        logger.warning(
            "mesh_cp: head groups of %d consecutive CP ranks cross nodes of %d CP ranks (their all-to-all runs over "
            "the inter-node network); choose head_parallel dividing %d",
            u,
            per_node,
            per_node,
        )
        return
    mesh_per_node, mesh_ranks, a = _mesh_ranks_per_node(per_node, u, cp_size), cp_size // u, mesh.tile[0]
    if mesh_per_node < mesh_ranks and mesh_per_node % a:
        logger.warning(
            "mesh_cp: tile %dx%d puts Q-groups of %d mesh ranks across nodes of %d mesh ranks; tile %s keeps them "
            "inside a node",
            *mesh.tile,
            a,
            mesh_per_node,
            "x".join(map(str, node_local_tile(mesh_ranks, mesh_per_node))),
        )
