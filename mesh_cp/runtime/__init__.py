"""The only part of mesh_cp that uses torch.distributed.

``mesh`` (the CP group tiled ``a x b``) -> ``executors`` (run a plan: the collective and the overlapped
schedule) -> ``attention`` (``mesh_attn_func``); ``decode`` (Tree-Attention decoding, ``decode_attn_func``); ``comm`` (flat collectives, ring steps), ``groups``
(subgroups), ``sharding`` (sequences), ``batch`` (causal-LM batches and loss shares), ``parallel`` (DP x CP)
with ``gradients`` (torch's DDP over CP or DP x CP, with mesh_cp's scaling).
"""

from mesh_cp.runtime.attention import MeshAttnFunc, mesh_attn_func
from mesh_cp.runtime.batch import IGNORE_INDEX, ShardedBatch, ShardingCollator, causal_lm_loss, shard_batch
from mesh_cp.runtime.decode import decode_attn_func
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.parallel import DataContextParallel, data_parallel, overlap_gradients, reduce_gradients
from mesh_cp.runtime.sharding import gather_sequence, position_ids, shard_sequence, unshard_sequence

__all__ = [
    "IGNORE_INDEX",
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
    "new_subgroups",
    "overlap_gradients",
    "position_ids",
    "reduce_gradients",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
]
