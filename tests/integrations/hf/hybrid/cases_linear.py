"""Tiny configs of the hybrid families whose mixers are Gated DeltaNet (Qwen3.5, Qwen3.5 MoE, OLMo Hybrid) and
KDA (Kimi Linear)."""

from __future__ import annotations

from typing import Any

from mesh_cp.testing.models import SPECIAL_TOKENS, TINY

BASE = {**TINY, "num_key_value_heads": 2, **SPECIAL_TOKENS}
LAYERS = ["linear_attention", "full_attention"]
GDN = {"linear_key_head_dim": 8, "linear_value_head_dim": 8}


def _qwen3_5(keys: int, values: int):
    import transformers as tf

    return tf.Qwen3_5TextConfig(
        **BASE, head_dim=8, layer_types=LAYERS, linear_num_key_heads=keys, linear_num_value_heads=values, **GDN
    )


def _kimi_linear(heads: int):
    import transformers as tf

    return tf.KimiLinearConfig(
        **{**BASE, "num_key_value_heads": 4},  # MLA: as many key and value heads as query heads
        layer_types=LAYERS,
        linear_attn_config={"head_dim": 8, "num_heads": heads, "short_conv_kernel_size": 4},
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_token=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )


def configs() -> dict[str, Any]:
    """Family -> a tiny config with one mixer layer and one attention layer (heads that split over 4 ranks; key
    heads fewer than 4 ranks, each shared by the ranks of its value heads, in Qwen3.5 and Qwen3.5 MoE)."""
    import transformers as tf

    return {
        "qwen3_5": _qwen3_5(keys=2, values=4),
        "qwen3_5_moe": tf.Qwen3_5MoeTextConfig(
            **BASE,
            head_dim=8,
            layer_types=LAYERS,
            linear_num_key_heads=1,
            linear_num_value_heads=8,
            num_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **GDN,
        ),
        "olmo_hybrid": tf.OlmoHybridConfig(
            **BASE, layer_types=LAYERS, linear_num_key_heads=4, linear_num_value_heads=8, **GDN
        ),
        "kimi_linear": _kimi_linear(heads=4),
    }


def too_few_heads() -> dict[str, Any]:
    """Family -> a tiny config whose mixer heads do not split over 4 ranks (refused by name at P = 4)."""
    return {"qwen3_5": _qwen3_5(keys=1, values=2), "kimi_linear": _kimi_linear(heads=2)}
