"""Model features :func:`~mesh_cp.integrations.hf.attach.attach` refuses by name (what a CP rank cannot compute
exactly from its shard), and what it changes on a model so that it stays exact: the checks of its loss, its own
configs."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

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


def refuse_other_sequence_mixers(model: torch.nn.Module, models: list[torch.nn.Module], handled: set[str]) -> None:
    """Hybrid models mix the sequence in layers other than attention too (Mamba, linear attention, short
    convolutions). Layers of the classes in ``handled`` run head-parallel (:mod:`~mesh_cp.integrations.hf.hybrid`);
    any other such layer would see its rank's shard alone, so it is refused by name, and so is a model whose config
    names non-attention layers but that has no handled layer."""
    found = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(p in type(m).__name__ for p in _OTHER_MIXERS)
            and type(m).__name__ not in handled
            and not any(type(c).__name__ in handled for c in m.modules())
            and not (hasattr(m, "is_causal") and hasattr(m, "config"))  # attention (Kimi's KimiLinearAttention: MLA)
        }
    )
    if not found and not any(type(m).__name__ in handled for m in model.modules()):
        for m in models:
            config = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
            for key in ("layer_types", "layers_block_type"):
                kinds = getattr(config, key, None)
                other = sorted({k for k in kinds if k not in ATTENTION_LAYER_TYPES}) if isinstance(kinds, list) else []
                if other:
                    found.append(f"config.{key} {other}")
            if getattr(config, "hybrid_override_pattern", None):
                found.append(f"config.hybrid_override_pattern {config.hybrid_override_pattern!r}")
    found = list(dict.fromkeys(found))
    if found:
        raise NotImplementedError(
            f"{type(model).__name__} mixes the sequence outside attention ({', '.join(found[:6])}) in layers mesh_cp "
            f"does not run: on a CP rank those layers would see its shard alone; mesh_cp runs attention and the "
            f"mixer layers {sorted(handled)}"
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


POOLED_HEADS: tuple[str, ...] = (
    "ForSequenceClassification",
    "ForMultipleChoice",
    "ForQuestionAnswering",
    "ForNextSentencePrediction",
    "ForPreTraining",
    "DoubleHeadsModel",
    "ForAudioClassification",
    "ForImageClassification",
    "ForVideoClassification",
)
"""Class-name endings (and ``loss_type``) of heads that read across the sequence: they pool one token (the last real
one, or the first), or take a softmax over the positions (question answering)."""


def refuse_pooled_heads(model: torch.nn.Module, models: list[torch.nn.Module]) -> None:
    """A head that pools over the sequence (sequence classification and reward models pool the last real token) would
    pool each rank's own shard: refused by name. Per-token heads (causal LM, token classification) are exact, and so
    is a sequence classifier whose calls :func:`~mesh_cp.integrations.hf.reward.shard_classification_calls` shards
    (it marks ``model`` with ``mesh_cp_pooled_calls``)."""
    sharded = model if model.__dict__.get("mesh_cp_pooled_calls") else None
    found = [
        f"{type(m).__name__}{f' (loss_type {m.loss_type})' if m.loss_type and m.loss_type in POOLED_HEADS else ''}"
        for m in models
        if (type(m).__name__.endswith(POOLED_HEADS) or getattr(m, "loss_type", None) in POOLED_HEADS)
        and m is not sharded
    ]
    poolers = [
        f"{name} ({type(m).__name__})" for name, m in model.named_modules() if type(m).__name__.endswith("Pooler")
    ]
    if found or poolers:
        fix = " (build a base model without its pooler: add_pooling_layer=False)" if poolers and not found else ""
        raise NotImplementedError(
            f"{type(model).__name__} has a head that reads across the sequence ({', '.join((found + poolers)[:4])}): "
            f"on a CP rank it would pool (or take a softmax over) its own shard of every row; mesh_cp runs per-token "
            f"heads (causal LM, token classification), and sequence classifiers through "
            f"mesh_cp.integrations.hf.reward.shard_classification_calls{fix}"
        )


LOSS_KEYWORDS: tuple[str, ...] = ("shift_labels", "num_items_in_batch")
"""What a loss under CP needs beside ``labels``: the labels shifted on the whole sequence (this rank's shard of them)
and the label count of the whole batch (so a rank's loss is its share of the batch's mean)."""

_CP_LABELS = (
    "pass the batch of ShardingCollator / hf.ShardCollated as it is (model(**batch): it holds labels, shift_labels "
    "and num_items_in_batch; a ShardedBatch of shard_batch as model(**ShardingCollator.batch_dict(batch))), or call "
    "the model without labels and take hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)"
)


def refuse_labels_of_one_process(model: torch.nn.Module, labels: object, kwargs: dict, loss_function: Any) -> None:
    """``labels`` given to an attached model, where a loss is made: it needs ``shift_labels`` (transformers would
    shift this rank's shard of the labels on its own, pairing tokens wrongly at the seams of the chunks) and
    ``num_items_in_batch`` (the loss would be the mean over the shard, its sum over the ranks P times too large); a
    loss function that takes neither (token classification) is refused with the way to compute it (``None``: the
    model has none)."""
    if labels is None:
        return
    takes = inspect.signature(loss_function).parameters if loss_function is not None else LOSS_KEYWORDS
    name = getattr(loss_function, "__name__", type(loss_function).__name__)
    if not set(LOSS_KEYWORDS) <= set(takes):
        raise NotImplementedError(
            f"{type(model).__name__} was given labels, and its loss ({name}) takes no shift_labels and "
            f"num_items_in_batch: on a CP rank it would be the mean over this rank's shard; call the model without "
            f"labels (its logits are per token, exact) and sum the loss over the shard's labels, divided by the label "
            f"count of the whole batch"
        )
    missing = [k for k in LOSS_KEYWORDS if kwargs.get(k) is None]
    if "shift_labels" in missing:  # labels and shift_labels (mesh_cp's batches): the loss reads shift_labels
        raise ValueError(
            f"{type(model).__name__} was given labels without shift_labels: transformers would shift this rank's "
            f"shard of the labels itself (one process's way), pairing tokens wrongly at the seams of the chunks; under "
            f"CP the labels are shifted on the whole sequence before sharding (shift_labels) and the loss is divided by "
            f"the label count of the whole batch (num_items_in_batch): {_CP_LABELS}"
        )
    if missing:
        raise ValueError(
            f"{type(model).__name__} was given labels without num_items_in_batch: its loss would be the mean over this "
            f"rank's shard, and its sum over the P ranks (data_parallel, DDP) up to P times the batch's; {_CP_LABELS}"
        )


class LossCheck:
    """A model's ``loss_function`` under :func:`~mesh_cp.integrations.hf.attach.attach`: every call must get
    :data:`LOSS_KEYWORDS` (a forward that drops them, or a loss that takes neither, would make the shard's own mean).
    ``calls`` counts the calls (reset by the attached model's forward, which refuses labels whose loss was made
    elsewhere)."""

    def __init__(self, function: object, previous: object):
        self.function, self.previous, self.calls = function, previous, 0

    def __call__(self, *args, **kwargs):
        missing = [k for k in LOSS_KEYWORDS if kwargs.get(k) is None]
        if missing:
            name = getattr(self.function, "__name__", type(self.function).__name__)
            raise NotImplementedError(
                f"the model's loss ({name}) was called without {' and '.join(missing)}: under CP it would be the mean "
                f"over this rank's shard; call the model without labels (its logits are per token, exact) and take "
                f"hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)"
            )
        self.calls += 1
        return self.function(*args, **kwargs)


def check_losses(models: list[torch.nn.Module]) -> list[LossCheck]:
    """Put a :class:`LossCheck` in place of the ``loss_function`` of every model in ``models`` that makes a loss: its
    forward takes ``labels``, or it has a loss of its own or of its ``loss_type`` (the outermost first). A head whose
    class name matches no ``loss_type`` (``GPT2LMHeadModel``) gets transformers' default, ``ForCausalLMLoss``.
    :func:`restore_loss` undoes it. A model without labels or a loss (a base model) makes none; one that does all the
    same is refused by :func:`refuse_loss_elsewhere`."""
    checks = []
    for m in models:
        takes_labels = "labels" in inspect.signature(m.forward).parameters
        if m.__dict__.get("_loss_function") is None and getattr(m, "loss_type", None) is None and not takes_labels:
            continue
        check = LossCheck(m.loss_function, m.__dict__.get("_loss_function"))
        m.loss_function = check
        checks.append(check)
    return checks


def restore_loss(module: torch.nn.Module) -> None:
    """Give ``module`` back the ``loss_function`` it had before :func:`check_losses`."""
    check = module.__dict__.get("_loss_function")
    if isinstance(check, LossCheck):
        if check.previous is None:
            del module.__dict__["_loss_function"]
        else:
            module.__dict__["_loss_function"] = check.previous


FUSED_LOSS = "fused_lm_head"
"""The keyword of TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``): called with it true, the model's
forward makes its loss itself, from ``shift_labels`` (not shifted again) divided by ``num_items_in_batch``."""


def refuse_loss_elsewhere(model: torch.nn.Module, kwargs: dict, output: object, checks: list[LossCheck]) -> None:
    """A forward given ``labels`` that made a loss other than through the ``loss_function`` of its models (``checks``,
    which check what the loss gets) or TRL's fused LM head (:data:`FUSED_LOSS`): refused."""
    made = output.get("loss") is not None if isinstance(output, Mapping) else isinstance(output, tuple)
    labels = kwargs.get("labels") is not None and not kwargs.get(FUSED_LOSS)
    if labels and made and not any(check.calls for check in checks):
        raise NotImplementedError(
            f"{type(model).__name__} was given labels and made its loss without transformers' loss_function, which "
            f"mesh_cp checks gets shift_labels and num_items_in_batch; call the model without labels (its logits are "
            f"per token, exact) and take hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)"
        )


def own_configs(model: torch.nn.Module) -> None:
    """Give ``model``'s modules their own copies of the configs they hold (shared among them as before):
    ``set_attn_implementation`` writes the config, which another model built from the same config object (a policy
    and its reference) reads too."""
    from transformers import PretrainedConfig

    copies: dict[int, Any] = {}  # deepcopy's memo: every config (and sub-config) copied once
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig):
                module.__dict__[name] = copy.deepcopy(value, copies)
