"""The only part of mesh_cp that uses torch.distributed: the mesh, schedules, sharding, accounting."""

from mesh_cp.runtime.accounting import CommCounter, CommRecord
from mesh_cp.runtime.attention import MeshAttnFunc, mesh_attn_func
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.schedules import SCHEDULES, CollectiveSchedule, get_schedule
from mesh_cp.runtime.sharding import position_ids, shard_sequence, unshard_sequence

__all__ = [
    "SCHEDULES",
    "CPMesh",
    "CollectiveSchedule",
    "CommCounter",
    "CommRecord",
    "MeshAttnFunc",
    "get_schedule",
    "mesh_attn_func",
    "new_subgroups",
    "position_ids",
    "shard_sequence",
    "unshard_sequence",
]
