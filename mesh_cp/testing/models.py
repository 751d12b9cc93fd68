"""The tiny transformers model shapes the tests and the GPU check share (2 layers, width 32, 4 heads).

Configs are built on first use (transformers is imported only then)::

    config = tiny_config("LlamaConfig", num_key_value_heads=2)
"""

from __future__ import annotations

from typing import Any

VOCAB = 96
"""Vocabulary of every tiny model."""

TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "attention_dropout": 0.0,
}
"""The shape of every tiny model (a config class's own keyword names; overrides replace them)."""

SPECIAL_TOKENS: dict[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(config_class: str | type, **overrides: Any):
    """``config_class`` (a transformers config class or its name in ``transformers``) with :data:`TINY` and
    ``overrides``."""
    if isinstance(config_class, str):
        import transformers

        config_class = getattr(transformers, config_class)
    return config_class(**{**TINY, **overrides})


def tiny_causal_lms() -> dict[str, Any]:
    """The four causal LMs the Hugging Face tests compare with the stock SDPA model: Llama (MHA and GQA),
    Qwen2 and Mistral (GQA, no sliding window)."""
    return {
        "llama": tiny_config("LlamaConfig", num_key_value_heads=4),
        "llama-gqa": tiny_config("LlamaConfig", num_key_value_heads=2),
        "qwen2": tiny_config("Qwen2Config", num_key_value_heads=2, use_sliding_window=False),
        "mistral": tiny_config("MistralConfig", num_key_value_heads=2, sliding_window=None),
    }
