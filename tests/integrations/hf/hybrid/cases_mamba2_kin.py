"""Tiny configs of the hybrid families whose mixers are Mamba 2 layers named as Bamba's (Nemotron-H, Granite 4,
Zamba2) or with multipliers (Falcon-H1), and Bamba with 2 and 4 groups of heads (B and C shared by a group spanning
ranks, and one group per rank)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE

MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 8}


def configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "nemotron_h": tf.NemotronHConfig(
            **BASE,
            head_dim=8,
            layers_block_type=["mamba", "attention"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=2,
            chunk_size=8,
        ),
        "granitemoehybrid": tf.GraniteMoeHybridConfig(
            **BASE,
            layer_types=["mamba", "attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            **MAMBA,
            mamba_n_groups=1,
        ),
        "falcon_h1": tf.FalconH1Config(
            **BASE,
            head_dim=8,
            **MAMBA,
            mamba_d_ssm=64,
            mamba_n_groups=1,
            mamba_rms_norm=False,
            ssm_multipliers=[0.5, 2.0, 1.5, 0.7, 1.3],
            ssm_in_multiplier=0.8,
            mamba_proj_bias=True,
        ),
        "falcon_h1 rms_norm": tf.FalconH1Config(
            **BASE,
            head_dim=8,
            **MAMBA,
            mamba_d_ssm=64,
            mamba_n_groups=2,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            ssm_multipliers=[0.5, 2.0, 1.5, 0.7, 1.3],
            ssm_in_multiplier=0.8,
        ),
        "zamba2": tf.Zamba2Config(
            **BASE,
            layers_block_type=["mamba", "hybrid"],
            hybrid_layer_ids=[1],
            n_mamba_heads=4,
            mamba_headdim=16,
            mamba_d_state=8,
            chunk_size=8,
            attention_head_dim=8,
            num_query_groups=4,
        ),
        "bamba 2 groups": tf.BambaConfig(**BASE, attn_layer_indices=[1], **MAMBA, mamba_n_groups=2),
        "bamba 4 groups": tf.BambaConfig(**BASE, attn_layer_indices=[1], **MAMBA, mamba_n_groups=4),
    }


def too_few_heads() -> dict[str, Any]:
    """Bamba with 2 heads: they do not split over 4 ranks."""
    import transformers as tf

    return {
        "bamba": tf.BambaConfig(**BASE, attn_layer_indices=[1], **{**MAMBA, "mamba_n_heads": 2, "mamba_d_head": 32})
    }
