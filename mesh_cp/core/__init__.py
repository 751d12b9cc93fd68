"""Plan (pure data) and numerics (torch tensors) of Mesh-Attention; no torch.distributed here.

``tiling`` (who computes which block) -> ``layout`` (which tokens a rank holds) -> ``plan`` (blocks,
transfers, bytes) -> ``schedule`` (the overlapped schedule as data); ``hybrid`` wraps a plan in the
all-to-alls of head-parallel ranks; ``options`` names the choices and ``numerics`` holds the one LSE merge.
"""

from mesh_cp.core.decode import DecodeReduction, DecodeShape
from mesh_cp.core.hybrid import (
    HybridPlan,
    head_group_ranks,
    hybrid_unavailable,
    inner_shape,
    make_hybrid_plan,
    mesh_group_ranks,
    valid_heads,
)
from mesh_cp.core.layout import check_seq_len, chunk_ranges, layout_permutation, local_positions
from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.options import BACKWARD_MODES, LAYOUTS, SCHEDULES, check_layout, check_option
from mesh_cp.core.plan import (
    AttentionPlan,
    AttentionShape,
    BlockWork,
    MaskKind,
    Transfer,
    block_work,
    make_plan,
    mask_kind,
)
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
    "HybridPlan",
    "MaskKind",
    "Tiling",
    "Transfer",
    "block_work",
    "check_layout",
    "check_option",
    "check_seq_len",
    "chunk_ranges",
    "factorizations",
    "head_group_ranks",
    "hybrid_unavailable",
    "inner_shape",
    "layout_permutation",
    "local_positions",
    "make_hybrid_plan",
    "make_plan",
    "mask_kind",
    "mesh_group_ranks",
    "most_square_tile",
    "valid_heads",
]
