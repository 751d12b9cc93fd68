"""Tiny configs of the hybrid families whose mixers are Gated DeltaNet (Qwen3-Next) and Mamba 2 (Bamba)."""

from __future__ import annotations

from typing import Any

from mesh_cp.testing.models import SPECIAL_TOKENS, TINY

BASE = {**TINY, "num_key_value_heads": 2, **SPECIAL_TOKENS}


def configs() -> dict[str, Any]:
    """Family -> a tiny config with one mixer layer and one attention layer (heads that split over 4 ranks)."""
    import transformers as tf

    return {
        "qwen3_next": tf.Qwen3NextConfig(
            **BASE,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_experts=2,
            num_experts_per_tok=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        "bamba": tf.BambaConfig(
            **BASE,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
        ),
    }


def too_few_heads() -> dict[str, Any]:
    """Family -> a tiny config whose mixer has fewer heads than 4 ranks (refused by name at P = 4)."""
    import transformers as tf

    return {
        "qwen3_next": tf.Qwen3NextConfig(
            **BASE,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_experts=2,
            num_experts_per_tok=2,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
    }
