"""Tiny configs beside those of ``cases_lightning``, ``cases_mamba1`` and ``cases_conv``: MiniMax with two
lightning heads a rank (its decay buffers sliced over several heads), Jamba without a convolution bias and with an
odd ``dt_rank`` and kernel width, and an LFM2-MoE whose convolution channels do not split over 4 ranks."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE
from tests.integrations.hf.hybrid.cases_mamba1 import JAMBA


def configs() -> dict[str, Any]:
    """Family variant -> a tiny config with one mixer layer and one attention layer (splits over 4 ranks)."""
    import transformers as tf

    return {
        "minimax_2_heads_a_rank": tf.MiniMaxConfig(
            **{**BASE, "num_attention_heads": 8},
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=4,
        ),
        "jamba_no_conv_bias": tf.JambaConfig(
            **BASE, **{**JAMBA, "mamba_dt_rank": 3}, mamba_conv_bias=False, mamba_d_conv=3
        ),
    }


def too_few_heads() -> dict[str, Any]:
    """LFM2-MoE of width 30: its 30 convolution channels do not split over 4 ranks (refused by name at P = 4)."""
    import transformers as tf

    return {
        "lfm2_moe": tf.Lfm2MoeConfig(
            **{**BASE, "hidden_size": 30, "num_attention_heads": 3, "num_key_value_heads": 1},
            layer_types=["conv", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_dense_layers=1,
        )
    }
