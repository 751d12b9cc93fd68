"""Tiny configs of the hybrid families whose mixers are Mamba 2 layers beside Bamba's: Nemotron-H, Granite 4, Zamba2
(its shared attention block in two hybrid layers) and Falcon-H1 (its multipliers, without and with its gated norm),
and Bamba with 2 groups of 4 heads; B and C of a group spanning two ranks (2 groups), one group a rank (4 groups)
and two groups a rank (8 groups)."""

from __future__ import annotations

from typing import Any

from tests.integrations.hf.hybrid.cases_core import BASE as CORE

BASE = {**CORE, "initializer_range": 0.1}
"""Weights 5x the default's spread: at 0.02 the mixer's share of the logits is so small that a multiplier or a
group of B and C read wrong moves them by less than the suite's 1e-5 (fp32 rounding stays near 1e-6 at 0.1)."""
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 8}
FALCON = {
    "head_dim": 8,
    "mamba_d_state": 8,
    "mamba_chunk_size": 8,
    "ssm_multipliers": [0.5, 2.0, 1.5, 0.7, 1.3],
    "ssm_in_multiplier": 0.8,
}


def configs() -> dict[str, Any]:
    """Family -> a tiny config with two layers, the mixer's heads splitting over 4 ranks."""
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
            use_bias=True,
        ),
        "granitemoehybrid": tf.GraniteMoeHybridConfig(
            **BASE,
            layer_types=["mamba", "attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            **MAMBA,
            mamba_n_groups=4,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
        ),
        "falcon_h1": tf.FalconH1Config(
            **BASE,
            **FALCON,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_ssm=64,
            mamba_n_groups=1,
            mamba_rms_norm=False,
            mamba_proj_bias=True,
            projectors_bias=True,
        ),
        "falcon_h1 rms_norm": tf.FalconH1Config(
            **BASE,
            **FALCON,
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_d_ssm=64,
            mamba_n_groups=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            mamba_conv_bias=False,
        ),
        "zamba2": tf.Zamba2Config(
            **{**BASE, "num_key_value_heads": 4},  # the adapters of k and v: as wide as the attention's input
            layers_block_type=["hybrid", "hybrid"],
            n_mamba_heads=4,
            mamba_headdim=16,
            mamba_d_state=8,
            mamba_ngroups=2,
            chunk_size=8,
            attention_head_dim=16,
            use_shared_attention_adapter=True,
            adapter_rank=4,
            use_mem_rope=True,
        ),
        "bamba_groups2": tf.BambaConfig(
            **BASE,
            attn_layer_indices=[1],
            **{**MAMBA, "mamba_n_heads": 8, "mamba_d_head": 8},
            mamba_n_groups=2,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
        ),
    }


def too_few_heads() -> dict[str, Any]:
    """Zamba2 with 2 Mamba heads: they do not split over 4 ranks."""
    import transformers as tf

    return {
        "zamba2": tf.Zamba2Config(
            **BASE,
            layers_block_type=["mamba", "hybrid"],
            n_mamba_heads=2,
            mamba_headdim=32,
            mamba_d_state=8,
            chunk_size=8,
            attention_head_dim=8,
        )
    }
