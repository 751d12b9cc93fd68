"""Tiny configs of the hybrid families whose mixers are short convolutions (LFM2, LFM2-MoE)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE


def configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "lfm2": tf.Lfm2Config(**BASE, layer_types=["conv", "full_attention"], conv_bias=True),
        "lfm2_moe": tf.Lfm2MoeConfig(
            **BASE,
            layer_types=["conv", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_dense_layers=1,
        ),
    }


def too_few_heads() -> dict[str, Any]:
    """LFM2 of width 30: its 30 convolution channels do not split over 4 ranks."""
    import transformers as tf

    return {
        "lfm2": tf.Lfm2Config(
            **{**BASE, "hidden_size": 30, "num_attention_heads": 3, "num_key_value_heads": 1},
            layer_types=["conv", "full_attention"],
        )
    }
