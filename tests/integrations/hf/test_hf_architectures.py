"""Many tiny transformers causal-LM architectures through ``hf.attach`` at P = 4: each is exact or refused.

Every architecture runs with its distinctive feature on (qk-norm, partial rotary, attention sinks, RoPE
scalings, layers without RoPE, sliding windows, softcapping, multi-head latent attention, learned
absolute positions, ALiBi, MoE, Granite's multipliers, models without transformers' AttentionInterface: which
those are is read from the installed transformers, where GPT-J moved to it in 5.24).
Exact means: this rank's logits and every parameter gradient (summed over the CP group) within 1e-5 of
the single-process model (SDPA, or eager where the model has no SDPA path) in fp32. Refused means: an
error whose message names the feature. The test asserts the whole table of outcomes against
``EXPECTED`` and prints the table on any mismatch: no architecture may be silently wrong.

One spawned group of 4 gloo ranks runs every architecture (tile 2x2; 1x4 for a few). Hybrid models whose mixer
layers mesh_cp runs (Gated DeltaNet, Mamba, ...) are in ``test_hybrid.py``; one whose mixer it does not run
(RecurrentGemma's RG-LRU) is refused here.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")

import mesh_cp  # noqa: E402
from mesh_cp.testing import spawn_gloo  # noqa: E402
from mesh_cp.testing.models import SPECIAL_TOKENS, TINY, VOCAB  # noqa: E402

TOL = 1e-5
SEQ = 32
BATCH = 2
WORLD = 4

# How a refusal names its feature: the outcome "refused:<feature>" needs a message matching the pattern.
FEATURES = {
    "AttentionInterface": r"kept its attention implementation .* AttentionInterface",
    "attn_temperature_tuning": r"attn_temperature_tuning scales the queries",
    "other sequence mixers": r"mixes the sequence outside attention",
}


def _through_attention_interface(model_type: str) -> str:
    """``"exact"`` where the installed transformers computes ``model_type``'s attention through its
    AttentionInterface (GPT-J does from transformers 5.24), else ``"refused:AttentionInterface"``."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return "exact" if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module) else "refused:AttentionInterface"


# Architecture -> (tile, expected outcome). Exact unless the feature cannot be computed over the mesh.
EXPECTED = {
    "qwen3 (qk-norm)": ("2x2", "exact"),
    "olmo2 (qk-norm over all heads)": ("2x2", "exact"),
    "cohere (qk-norm, parallel block)": ("2x2", "exact"),
    "phi (partial rotary, qk layernorm)": ("2x2", "exact"),
    "stablelm (partial rotary 1/4, qk layernorm)": ("2x2", "exact"),
    "gpt_neox (rotary_pct 1/2)": ("1x4", "exact"),
    "glm (partial rotary)": ("2x2", "exact"),
    "gpt_oss (attention sinks, MoE, window >= sequence)": ("2x2", "exact"),
    "llama rope llama3": ("2x2", "exact"),
    "llama rope yarn": ("2x2", "exact"),
    "llama rope linear": ("2x2", "exact"),
    "llama rope dynamic (sequence 32 > max_position_embeddings 16)": ("2x2", "exact"),
    "phi3 rope longrope (sequence 32 > original max 24)": ("1x4", "exact"),
    "smollm3 (no_rope_layers)": ("2x2", "exact"),
    "cohere2 (layers without RoPE, window >= sequence)": ("2x2", "exact"),
    "deepseek_v3 (MLA: v head dim != qk head dim, yarn, MoE)": ("1x4", "exact"),
    "gpt2 (learned absolute positions)": ("2x2", "exact"),
    "mixtral (MoE)": ("2x2", "exact"),
    "qwen3_moe (MoE, qk-norm)": ("2x2", "exact"),
    "granite (attention/embedding/residual multipliers)": ("2x2", "exact"),
    "gemma2 (softcap 2, sliding window 8 < 32 on alternate layers)": ("2x2", "exact"),
    "gemma3 (sliding window 6 < 8 tokens a shard, mixed with full layers)": ("1x4", "exact"),
    "mistral (sliding window 8 < 32)": ("2x2", "exact"),
    "qwen2_moe (sliding window 8 < 32, in the mask only)": ("2x2", "exact"),
    "llama4 (attn_temperature_tuning, chunked attention)": ("2x2", "refused:attn_temperature_tuning"),
    "falcon (its own attention code)": ("2x2", _through_attention_interface("falcon")),
    "gptj (AttentionInterface from transformers 5.24)": ("2x2", _through_attention_interface("gptj")),
    "bloom (ALiBi, no AttentionInterface)": ("2x2", "refused:AttentionInterface"),
    "mpt (ALiBi, no AttentionInterface)": ("2x2", "refused:AttentionInterface"),
    "recurrent_gemma (RG-LRU recurrent blocks)": ("2x2", "refused:other sequence mixers"),
}


def architectures() -> dict:
    """Tiny configs (2 layers, width 32-64) with each architecture's distinctive feature on."""
    import transformers as tf

    base = {**TINY, "num_key_value_heads": 2, **SPECIAL_TOKENS}
    ids = SPECIAL_TOKENS
    moe = dict(num_experts_per_tok=2)

    def llama_rope(**rope):
        return tf.LlamaConfig(**base, rope_parameters={"rope_theta": 10000.0, **rope})

    return {
        "qwen3 (qk-norm)": tf.Qwen3Config(**base, head_dim=8, use_sliding_window=False),
        "olmo2 (qk-norm over all heads)": tf.Olmo2Config(**base),
        "cohere (qk-norm, parallel block)": tf.CohereConfig(**base, use_qk_norm=True),
        "phi (partial rotary, qk layernorm)": tf.PhiConfig(
            **base, partial_rotary_factor=0.5, qk_layernorm=True, resid_pdrop=0.0, embd_pdrop=0.0
        ),
        "stablelm (partial rotary 1/4, qk layernorm)": tf.StableLmConfig(
            **base, partial_rotary_factor=0.25, qk_layernorm=True
        ),
        "gpt_neox (rotary_pct 1/2)": tf.GPTNeoXConfig(
            **{k: v for k, v in base.items() if k != "num_key_value_heads"}, rotary_pct=0.5, hidden_dropout=0.0
        ),
        "glm (partial rotary)": tf.GlmConfig(**base, head_dim=8, partial_rotary_factor=0.5),
        "gpt_oss (attention sinks, MoE, window >= sequence)": tf.GptOssConfig(
            **{**base, "intermediate_size": 32}, head_dim=8, num_local_experts=4, **moe, sliding_window=SEQ
        ),
        "llama rope llama3": llama_rope(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        "llama rope yarn": llama_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        "llama rope linear": llama_rope(rope_type="linear", factor=2.0),
        "llama rope dynamic (sequence 32 > max_position_embeddings 16)": tf.LlamaConfig(
            **{**base, "max_position_embeddings": 16},
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        "phi3 rope longrope (sequence 32 > original max 24)": tf.Phi3Config(
            **{**base, "max_position_embeddings": 64},
            original_max_position_embeddings=24,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.2, 1.3],
                "long_factor": [2.0, 3.0, 5.0, 8.0],
                "original_max_position_embeddings": 24,
            },
        ),
        "smollm3 (no_rope_layers)": tf.SmolLM3Config(**base, no_rope_layers=[1, 0]),
        "cohere2 (layers without RoPE, window >= sequence)": tf.Cohere2Config(**base, sliding_window=SEQ),
        "deepseek_v3 (MLA: v head dim != qk head dim, yarn, MoE)": tf.DeepseekV3Config(
            **{**base, "num_key_value_heads": 4},
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=4,
            n_routed_experts=4,
            **moe,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        "gpt2 (learned absolute positions)": tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            **ids,
        ),
        "mixtral (MoE)": tf.MixtralConfig(**base, num_local_experts=4, **moe, sliding_window=None),
        "qwen3_moe (MoE, qk-norm)": tf.Qwen3MoeConfig(
            **base, head_dim=8, num_experts=4, **moe, moe_intermediate_size=16
        ),
        "granite (attention/embedding/residual multipliers)": tf.GraniteConfig(
            **base, attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0
        ),
        "gemma2 (softcap 2, sliding window 8 < 32 on alternate layers)": tf.Gemma2Config(
            **base, head_dim=8, sliding_window=8, attn_logit_softcapping=2.0
        ),
        "gemma3 (sliding window 6 < 8 tokens a shard, mixed with full layers)": tf.Gemma3TextConfig(
            **base, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
        ),
        "mistral (sliding window 8 < 32)": tf.MistralConfig(**base, sliding_window=8),
        "qwen2_moe (sliding window 8 < 32, in the mask only)": tf.Qwen2MoeConfig(
            **base,
            num_experts=4,
            **moe,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "llama4 (attn_temperature_tuning, chunked attention)": tf.Llama4TextConfig(
            **{**base, "intermediate_size": 32},
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=16,
            attn_temperature_tuning=True,
        ),
        "falcon (its own attention code)": tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **ids
        ),
        "gptj (AttentionInterface from transformers 5.24)": tf.GPTJConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256, **ids
        ),
        "bloom (ALiBi, no AttentionInterface)": tf.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **ids
        ),
        "mpt (ALiBi, no AttentionInterface)": tf.MptConfig(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=256, **ids
        ),
        "recurrent_gemma (RG-LRU recurrent blocks)": tf.RecurrentGemmaConfig(
            **{k: v for k, v in base.items() if k != "max_position_embeddings"},
            lru_width=32,
            attention_window_size=16,
            block_types=["recurrent", "attention"],
        ),
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _outcome(err: Exception) -> str:
    for feature, pattern in FEATURES.items():
        if re.search(pattern, str(err)):
            return f"refused:{feature}"
    return f"raised {type(err).__name__}: {err}"


def run_architecture(config, mesh) -> str:
    """``"exact"``, ``"refused:<feature>"``, or what went wrong (errors above TOL, another exception)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError:  # no SDPA path (softcapping, sinks): the eager model is the reference
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model = copy.deepcopy(ref)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    logits = ref(input_ids=ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    try:
        hf.attach(model, mesh)
        # gradients summed over the CP group; a parameter the stock model leaves unused keeps none here too
        ddp = hf.data_parallel(model, mesh=mesh, find_unused_parameters=True)
        batch = hf.shard_batch(ids, mesh=mesh)
        local = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        hf.causal_lm_loss(local, batch.shift_labels, batch.num_items_in_batch).backward()
    except Exception as err:  # noqa: BLE001 - a refusal, or a failure to report
        return _outcome(err)
    errors = {
        "logits": _max_err(local.detach(), mesh_cp.shard_sequence(logits.detach(), mesh=mesh, dim=1, layout="zigzag"))
    }
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return f"gradient of {name} is {'missing' if p.grad is None else 'unexpected'}"
        if p.grad is not None:
            errors[name] = _max_err(p.grad, q.grad)
    worst = max(errors, key=errors.get)
    dist.barrier(group=mesh.group)
    return "exact" if errors[worst] <= TOL else f"wrong: {worst} error {errors[worst]:.2e}"


def architectures_worker(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    meshes = {f"{a}x{b}": mesh_cp.CPMesh.create(dist.group.WORLD, tile=(a, b)) for a, b in ((2, 2), (1, 4))}
    return {name: run_architecture(config, meshes[EXPECTED[name][0]]) for name, config in architectures().items()}


def test_architectures_are_exact_or_refused_by_name() -> None:
    assert len([n for n, (_, outcome) in EXPECTED.items() if not n.startswith(("llama rope", "mistral"))]) >= 15
    per_rank = spawn_gloo(architectures_worker, WORLD)
    expected = {name: outcome for name, (_, outcome) in EXPECTED.items()}
    table = "\n".join(
        f"{name:58} {EXPECTED[name][0]:4} expected {expected[name]:28} got "
        + " | ".join(sorted({res.get(name, "not run") for res in per_rank}))
        for name in expected
    )
    assert all(res == expected for res in per_rank), "architecture outcomes differ from the expected table:\n" + table
