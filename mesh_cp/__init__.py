"""mesh_cp: Mesh-Attention context parallelism for long-context training.

Public API::

    mesh = mesh_cp.CPMesh.create(cp_group, tile=(2, 2))
    q_local = mesh_cp.shard_sequence(q, mesh=mesh, dim=1, layout="zigzag")
    out = mesh_cp.mesh_attn_func(q_local, k_local, v_local, mesh=mesh, causal=True)

``mesh_cp.core`` (plan and numerics) imports no torch.distributed; the runtime names below are
loaded on first use, so importing ``mesh_cp.core`` alone stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_RUNTIME = {
    "CPMesh",
    "CommCounter",
    "MeshAttnFunc",
    "mesh_attn_func",
    "position_ids",
    "shard_sequence",
    "unshard_sequence",
}
_CORE = {"AttentionPlan", "AttentionShape", "MaskKind", "Tiling", "make_plan"}

__all__ = sorted(_RUNTIME | _CORE)


def __getattr__(name: str):
    if name in _RUNTIME:
        return getattr(importlib.import_module("mesh_cp.runtime"), name)
    if name in _CORE:
        return getattr(importlib.import_module("mesh_cp.core"), name)
    raise AttributeError(f"module 'mesh_cp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
