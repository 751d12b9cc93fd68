"""Plan (pure data) and numerics (torch tensors) of Mesh-Attention; no torch.distributed here.

``tiling`` (who computes which block) -> ``layout`` (which tokens a rank holds) -> ``blocks`` (what part of a
block is computed) -> ``plan`` (the head exchange, blocks, transfers, bytes: one object per call) -> ``schedule``
(the overlapped schedule as data); ``head_parallel`` holds the groups and checks of the head-parallel degree;
``options`` names the choices and ``numerics`` holds the one LSE merge.
"""

from mesh_cp.core.blocks import BlockWork, MaskKind, block_work, mask_kind
from mesh_cp.core.decode import DecodeReduction, DecodeShape
from mesh_cp.core.head_parallel import (
    HeadCounts,
    check_head_parallel,
    head_group_ranks,
    head_parallel_unavailable,
    mesh_group_ranks,
    mesh_shape,
    valid_head_parallel,
)
from mesh_cp.core.layout import check_seq_len, chunk_ranges, layout_permutation, local_positions
from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.options import BACKWARD_MODES, LAYOUTS, SCHEDULES, check_layout, check_option, positive_int
from mesh_cp.core.plan import AttentionPlan, Transfer, make_plan
from mesh_cp.core.shape import AttentionShape
from mesh_cp.core.tiling import Tiling, factorizations, most_square_tile

__all__ = [
    "BACKWARD_MODES",
    "AttentionMask",
    "LAYOUTS",
    "SCHEDULES",
    "AttentionPlan",
    "AttentionShape",
    "BlockWork",
    "DecodeReduction",
    "DecodeShape",
    "HeadCounts",
    "MaskKind",
    "Tiling",
    "Transfer",
    "block_work",
    "check_head_parallel",
    "check_layout",
    "check_option",
    "check_seq_len",
    "chunk_ranges",
    "factorizations",
    "head_group_ranks",
    "head_parallel_unavailable",
    "layout_permutation",
    "local_positions",
    "make_plan",
    "mask_kind",
    "mesh_group_ranks",
    "mesh_shape",
    "most_square_tile",
    "positive_int",
    "valid_head_parallel",
]
