"""mesh_cp: Mesh-Attention context parallelism for long-context training.

Public API::

    mesh = mesh_cp.CPMesh.create(cp_group, tile=(2, 2))        # or mesh_cp.auto_mesh(cp_group, topology=..., shape=...)
    q_local = mesh_cp.shard_sequence(q, mesh=mesh, dim=1, layout="zigzag")
    out = mesh_cp.mesh_attn_func(q_local, k_local, v_local, mesh=mesh, causal=True)

The package reads top-down: ``core`` (plan, as data) -> ``kernels`` (block attention) -> ``runtime``
(executors over process groups) -> ``integrations`` (framework adapters); ``sim`` times plans. ``mesh_cp.core``
and ``mesh_cp.sim`` import no torch.distributed; the names below are loaded on first use, so importing
``mesh_cp.core`` alone stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "mesh_cp.runtime": {
        "CPMesh",
        "DataContextParallel",
        "MeshAttnFunc",
        "ShardedBatch",
        "ShardingCollator",
        "causal_lm_loss",
        "data_parallel",
        "decode_attn_func",
        "gather_sequence",
        "mesh_attn_func",
        "overlap_gradients",
        "position_ids",
        "reduce_gradients",
        "shard_batch",
        "shard_sequence",
        "unshard_sequence",
    },
    "mesh_cp.core": {"AttentionMask", "AttentionPlan", "AttentionShape", "MaskKind", "Tiling", "make_plan"},
    "mesh_cp.auto": {"auto_mesh"},
    "mesh_cp.config": {"MeshConfig"},
    "mesh_cp.debug": {"CommCounter"},
}
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'mesh_cp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
