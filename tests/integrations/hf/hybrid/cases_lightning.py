"""Tiny configs of the hybrid family whose mixer is lightning attention (MiniMax)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE


def configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "minimax": tf.MiniMaxConfig(
            **BASE,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=8,
        ),
    }


def too_few_heads() -> dict[str, Any]:
    """MiniMax with 6 heads: they do not split over 4 ranks."""
    import transformers as tf

    return {
        "minimax": tf.MiniMaxConfig(
            **{**BASE, "num_attention_heads": 6},
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=8,
        ),
    }
