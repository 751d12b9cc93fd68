"""Model features :func:`~mesh_cp.integrations.hf.attach.attach` refuses by name: what a CP rank cannot compute
exactly from its shard."""

from __future__ import annotations

import torch


def refuse_temperature_tuning(models: list[torch.nn.Module]) -> None:
    """Llama 4's ``attn_temperature_tuning`` scales queries by positions counted from 0 on each shard."""
    for m in models:
        if getattr(m.config, "attn_temperature_tuning", False):
            raise NotImplementedError(
                f"{type(m).__name__}: attn_temperature_tuning scales the queries of layers without RoPE by positions "
                f"counted from 0 on each rank's shard, which mesh_cp cannot make exact; set "
                f"config.attn_temperature_tuning=False"
            )


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
"""``config.layer_types`` entries of layers whose sequence mixing is attention (a sliding window is checked per call)."""

_OTHER_MIXERS = ("Mamba", "GatedDeltaNet", "ShortConv", "LinearAttention", "Rwkv", "RecurrentBlock", "SSM")
"""Class-name parts of sequence-mixing modules other than attention (state-space, linear attention, convolutions)."""


def refuse_other_sequence_mixers(model: torch.nn.Module, models: list[torch.nn.Module]) -> None:
    """Hybrid models mix the sequence in layers other than attention too (Mamba, linear attention, short
    convolutions): on a rank those would run over its shard alone, so they are refused by name."""
    found = []
    for m in models:
        config = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
        for key in ("layer_types", "layers_block_type"):
            kinds = getattr(config, key, None)
            other = sorted({k for k in kinds if k not in ATTENTION_LAYER_TYPES}) if isinstance(kinds, list) else []
            if other:
                found.append(f"config.{key} {other}")
        if getattr(config, "hybrid_override_pattern", None):
            found.append(f"config.hybrid_override_pattern {config.hybrid_override_pattern!r}")
    found += sorted({type(m).__name__ for m in model.modules() if any(p in type(m).__name__ for p in _OTHER_MIXERS)})
    found = list(dict.fromkeys(found))
    if found:
        raise NotImplementedError(
            f"{type(model).__name__} mixes the sequence outside attention ({', '.join(found[:6])}): on a CP rank those "
            f"layers would see its shard alone; mesh_cp runs models whose every sequence-mixing layer is attention"
        )


def refuse_router_loss(model: torch.nn.Module, kwargs: dict) -> None:
    """MoE routers' auxiliary (load-balancing) loss is a product of means over the batch's tokens: over a shard it
    is another number, and it counts padding (the model is called without ``attention_mask``). Refused where a loss
    is made (labels given, or training); the router logits themselves are per token, so exact."""
    given = kwargs.get("output_router_logits")
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    routed = given if given is not None else getattr(config, "output_router_logits", False)
    if routed and (model.training or kwargs.get("labels") is not None):
        raise NotImplementedError(
            f"{type(model).__name__} with output_router_logits=True: its router auxiliary loss is a product of means "
            f"over the batch's tokens, which a rank's shard does not give; set config.output_router_logits=False (and "
            f"do not pass output_router_logits=True)"
        )


_ABSOLUTE_POSITIONS = ("wpe", "embed_positions", "position_embeddings")
"""Names of learned absolute position-embedding tables (GPT-2's ``wpe``, OPT's ``embed_positions``, ...)."""


def absolute_position_tables(model: torch.nn.Module) -> list[str]:
    """The learned absolute position-embedding tables of ``model``."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _ABSOLUTE_POSITIONS
    ]


def refuse_left_padding(model: torch.nn.Module, tables: list[str], mask) -> None:
    """Training with left padding numbers a row's tokens from its first column in one process (the model's own
    ``arange``), mesh_cp from its first real token: the same under RoPE, not with learned absolute positions."""
    if not tables or mask is None or mask.documents is None or mask.parts is not None:
        return
    padded = [row for row, spans in enumerate(mask.documents) if spans and spans[0][0] > 0]
    if padded:
        raise NotImplementedError(
            f"{type(model).__name__} has learned absolute positions ({tables[0]}) and rows {padded[:8]} are padded on "
            f"the left: one process numbers them from the first column, mesh_cp from the first real token; pad on "
            f"the right (tokenizer.padding_side='right') to train it"
        )
