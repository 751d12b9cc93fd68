"""Tiny configs of the hybrid family whose mixer is Mamba 1 (Jamba)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE

JAMBA = {
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    "mamba_expand": 2,
}


def configs() -> dict[str, Any]:
    import transformers as tf

    return {"jamba": tf.JambaConfig(**BASE, **JAMBA, mamba_proj_bias=True)}


def too_few_heads() -> dict[str, Any]:
    """Jamba with an inner width of 30 channels: they do not split over 4 ranks."""
    import transformers as tf

    return {
        "jamba": tf.JambaConfig(
            **{**BASE, "hidden_size": 30, "num_attention_heads": 3, "num_key_value_heads": 1},
            **{**JAMBA, "mamba_expand": 1},
        )
    }
