"""Plan (pure data) and numerics (torch tensors) of Mesh-Attention; no torch.distributed here."""

from mesh_cp.core.plan import (
    BACKWARD_MODES,
    LAYOUTS,
    AttentionPlan,
    AttentionShape,
    BlockWork,
    MaskKind,
    Tiling,
    Transfer,
    block_work,
    check_seq_len,
    chunk_ranges,
    factorizations,
    layout_permutation,
    local_positions,
    make_plan,
    mask_kind,
)

__all__ = [
    "BACKWARD_MODES",
    "LAYOUTS",
    "AttentionPlan",
    "AttentionShape",
    "BlockWork",
    "MaskKind",
    "Tiling",
    "Transfer",
    "block_work",
    "check_seq_len",
    "chunk_ranges",
    "factorizations",
    "layout_permutation",
    "local_positions",
    "make_plan",
    "mask_kind",
]
