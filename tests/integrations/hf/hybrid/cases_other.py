"""Tiny configs of the hybrid families whose mixers are short convolutions (LFM2, LFM2-MoE), Mamba 1 (Jamba) and
lightning attention (MiniMax): the families' cases of ``cases_conv``, ``cases_mamba1`` and ``cases_lightning`` (the
same keys: the suite runs each once), and variants beside them: MiniMax with two lightning heads a rank (its decay
buffers sliced over several heads), Jamba without a convolution bias and with an odd ``dt_rank`` and kernel width,
and LFM2-MoE with biases and a kernel of 5 (its convolution's bias sliced, and B, C and x all biased)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid import cases_conv, cases_lightning, cases_mamba1
from tests.integrations.hf.hybrid.cases_core import BASE
from tests.integrations.hf.hybrid.cases_mamba1 import JAMBA

_FAMILIES = (cases_conv, cases_mamba1, cases_lightning)


def configs() -> dict[str, Any]:
    """Family (or variant) -> a tiny config with one mixer layer and one attention layer (splits over 4 ranks)."""
    import transformers as tf

    out: dict[str, Any] = {}
    for module in _FAMILIES:
        out.update(module.configs())
    out.update(
        {
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
            "lfm2_moe_bias": tf.Lfm2MoeConfig(
                **BASE,
                layer_types=["conv", "full_attention"],
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                num_dense_layers=1,
                conv_bias=True,
                conv_L_cache=5,
            ),
        }
    )
    return out


def too_few_heads() -> dict[str, Any]:
    """Family -> a config whose mixer does not split over 4 ranks (refused by name at P = 4): those of the families'
    modules, and LFM2-MoE of width 30 (30 convolution channels)."""
    import transformers as tf

    out: dict[str, Any] = {}
    for module in _FAMILIES:
        out.update(module.too_few_heads())
    out["lfm2_moe"] = tf.Lfm2MoeConfig(
        **{**BASE, "hidden_size": 30, "num_attention_heads": 3, "num_key_value_heads": 1},
        layer_types=["conv", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_dense_layers=1,
    )
    return out
