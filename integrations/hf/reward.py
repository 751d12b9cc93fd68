"""Sequence classification (reward models) under CP: a transformers ``...ForSequenceClassification`` called with full
rows, its pooled logits computed over the mesh.

::

    shard_classification_calls(model, mesh)      # attaches model to mesh, then shards its calls
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)   # full (B, S) rows, the same on every CP rank
    out.logits                                   # (B, num_labels): transformers' pooled logits, the same on every rank

Note [Pooled scores under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A sequence classifier scores every token with its head (``score``: hidden state -> ``num_labels``) and keeps one
token's scores per row: the rightmost token whose id is not ``config.pad_token_id`` (transformers'
``GenericForSequenceClassification``; with ``pad_token_id == eos_token_id`` that is the token before the trailing
end-of-sequence tokens, as in one process). On a CP rank the model would pool its own shard, so the call is sharded
around the model (Note [Whole sequences under CP] in :mod:`mesh_cp.integrations.hf.scores`): a forward pre-hook
picks each row's pooled position on the full rows (transformers' rule, the same code), cuts the rows into this
rank's shard (:func:`~mesh_cp.runtime.batch.shard_batch`: global positions, left padding as a mask), and the model
runs the shard. A hook on the head keeps the shard's per-token scores ``(B, S_local, num_labels)``, the model's own
pooling of the shard is discarded, and a forward hook gathers the per-token scores to the full rows
(:func:`~mesh_cp.runtime.sharding.gather_sequence`, a few floats per token) and takes the pooled positions. Every
rank of the group gets the same logits; the gather's backward hands each rank the gradient of its own tokens
(``grad_scale`` times), so the gradients summed over the CP group are one process's.

The pooled token must be a real token (``attention_mask`` 1 there): a padding token's hidden state is computed
another way under CP (padding attends to padding). Rows are checked to be the same on every rank of the group.

TRL's ``RewardTrainer`` under a DP x CP layout (``hf.mesh_cp_trainer_class(trl.RewardTrainer)``,
:class:`MeshCPRewardMixin`)::

    RewardTrainer = hf.mesh_cp_trainer_class(trl.RewardTrainer)
    trainer = RewardTrainer(model=model, args=RewardConfig(..., use_cpu=True), train_dataset=pairs,
                            processing_class=tokenizer, parallel=parallel)

Every CP rank of a DP replica collates the replica's pairs with TRL's collator (chosen rows, then rejected rows); the
model's calls are sharded as above, so TRL's loss (with ``margin`` and ``center_rewards_coefficient``), accuracy,
margin and reward statistics are its own code on the pooled rewards, the same on every rank of the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from mesh_cp.integrations.hf.attach import attach
from mesh_cp.integrations.hf.scores import check_same_rows
from mesh_cp.integrations.hf.sequence_trainer import MeshCPSequenceTrainerMixin
from mesh_cp.runtime.batch import shard_batch
from mesh_cp.runtime.device_checks import check_on_device
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.sharding import gather_sequence

CLASSIFICATION_CALL_KEYWORDS: dict[str, str] = {
    "input_ids": "(batch, seq) token ids of the full rows, the same on every CP rank",
    "attention_mask": "(batch, seq) padding: one run of ones per row (left or right padding)",
    "use_cache": "False (a scoring forward keeps no cache)",
    "return_dict": "True (the model's output class)",
    "output_attentions": "False",
    "output_hidden_states": "False",
}
"""The keywords a sharded classification call takes (:func:`shard_classification_calls`), with the values taken;
any other keyword (or value) is refused by name, a keyword given ``None`` counts as not given."""

_TAKEN_FLAGS = {"use_cache": False, "return_dict": True, "output_attentions": False, "output_hidden_states": False}

REFUSED_CALL_KEYWORDS: dict[str, str] = {
    "labels": "call the model without labels and compute the loss from the pooled logits (TRL's RewardTrainer does)",
    "inputs_embeds": "pass input_ids: the pooled token is found from the ids",
    "position_ids": "leave them unset: the shard's global positions are made from the full rows",
    "cache": "a scoring forward keeps no cache; leave it unset (use_cache=False)",
    "past_key_values": "a scoring forward keeps no cache; leave it unset (use_cache=False)",
    "use_cache": "pass use_cache=False: a scoring forward keeps no cache",
    "return_dict": "leave return_dict unset (or True): the logits are returned in the model's output class",
    "output_attentions": "the attention maps of a shard are not gathered; leave output_attentions unset",
    "output_hidden_states": "the hidden states of a shard are not gathered; leave output_hidden_states unset",
}
"""Why a keyword (or value) of a classification call is refused, and the fix."""

POOLED_CALLS_SHARDED = "mesh_cp_pooled_calls"
"""The attribute :func:`shard_classification_calls` sets on a model: :func:`~mesh_cp.integrations.hf.attach.attach`
then takes its pooled head (its calls are sharded around it)."""


def shard_classification_calls(
    model: torch.nn.Module,
    mesh: CPMesh,
    *,
    grad_scale: float = 1.0,
    ignored: Iterable[str] = (),
    schedule: str = "overlap",
    backward: str = "regather",
) -> tuple[Any, ...]:
    """Attach ``model`` (a transformers ``GenericForSequenceClassification`` model: Llama, Qwen2/3, Mistral, Gemma,
    ...) to ``mesh`` (:func:`~mesh_cp.integrations.hf.attach.attach` with ``schedule`` and ``backward``) and make it
    take full rows: ``model(input_ids=(B, S), attention_mask=(B, S), use_cache=False)``, the same rows on every rank
    of ``mesh``, runs this rank's shard and returns the model's output class with ``logits`` ``(B, num_labels)``
    pooled as one process pools them, the same on every rank (Note [Pooled scores under CP]). ``grad_scale``: what the
    gather's backward multiplies each rank's gradient by (``mesh.size`` when the gradients are averaged over the CP
    group). ``ignored``: call keywords dropped before the model sees them (ones the model ignores, as TRL's
    ``margin``). Other keywords than :data:`CLASSIFICATION_CALL_KEYWORDS` are refused by name. Returns the handles of
    the three hooks (``.remove()`` each to undo the sharding; the model stays attached)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    name = type(model).__name__
    if not isinstance(model, GenericForSequenceClassification) or not isinstance(
        getattr(model, "score", None), torch.nn.Module
    ):
        raise NotImplementedError(
            f"{name} is not a transformers GenericForSequenceClassification model with a score head; mesh_cp shards "
            f"the calls of those (Llama, Qwen2/3, Mistral, Gemma, ... ForSequenceClassification), whose pooling it "
            f"repeats; other heads pool their own way"
        )
    if model.__dict__.get(POOLED_CALLS_SHARDED):
        raise ValueError(f"{name}'s classification calls are sharded already; shard them once")
    setattr(model, POOLED_CALLS_SHARDED, True)
    try:
        attach(model, mesh, schedule=schedule, backward=backward, layout="zigzag")
    except Exception:
        del model.__dict__[POOLED_CALLS_SHARDED]
        raise
    calls = _ClassificationCalls(mesh, grad_scale, frozenset(ignored))
    return (
        model.register_forward_pre_hook(calls.before, with_kwargs=True, prepend=True),
        model.score.register_forward_hook(calls.scored),
        model.register_forward_hook(calls.after, with_kwargs=True, prepend=True),
    )


class _ClassificationCalls:
    """The hooks of :func:`shard_classification_calls`: the call in flight (full length and pooled positions) and
    the shard's per-token scores of its head."""

    def __init__(self, mesh: CPMesh, grad_scale: float, ignored: frozenset[str]) -> None:
        self.mesh, self.grad_scale, self.ignored = mesh, grad_scale, ignored
        self.call: dict[str, Any] | None = None

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.call = None
        kwargs = {k: v for k, v in kwargs.items() if k not in self.ignored}
        check_classification_call(module, args, kwargs)
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        check_same_rows(ids, ids if mask is None else mask, self.mesh, what=f"{type(module).__name__}'s call")
        seq = ids.shape[1]
        pooled = pooled_positions(module, ids)
        if mask is not None:
            check_on_device(
                mask.gather(1, pooled.long().unsqueeze(1)).bool().all(),
                ValueError(
                    f"{type(module).__name__} pools the rightmost token that is not pad_token_id "
                    f"({module.config.get_text_config().pad_token_id}), and in some row that token is padding "
                    f"(attention_mask 0), whose hidden state mesh_cp computes another way than one process; pad "
                    f"input_ids with config.pad_token_id (and give no row without a real token)"
                ),
            )
        extra = -seq % self.mesh.seq_multiple("zigzag")
        if extra:  # the mesh's length multiple: right padding, never pooled
            mask = torch.nn.functional.pad(torch.ones_like(ids) if mask is None else mask, (0, extra), value=0)
            ids = torch.nn.functional.pad(ids, (0, extra))
        shard = shard_batch(ids, mesh=self.mesh, attention_mask=mask)
        call = {"input_ids": shard.input_ids, "position_ids": shard.position_ids, "use_cache": False}
        if shard.mask is not None:
            call["mesh_cp_mask"] = shard.mask
        self.call = {"seq": seq, "pooled": pooled, "scores": None}
        return (), call

    def scored(self, module: torch.nn.Module, args: tuple, output: Tensor) -> None:
        if self.call is not None:
            self.call["scores"] = output

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call, self.call = self.call, None
        if call is None:
            return None
        scores = call["scores"]
        if scores is None:
            raise RuntimeError(f"{type(module).__name__}'s score head was not called in its forward")
        full = gather_sequence(scores, mesh=self.mesh, dim=1, layout="zigzag", grad_scale=self.grad_scale)
        full = full[:, : call["seq"]]
        pooled = call["pooled"].to(full.device)
        logits = full[torch.arange(full.shape[0], device=full.device), pooled]
        return type(output)(logits=logits)


def pooled_positions(model: torch.nn.Module, ids: Tensor) -> Tensor:
    """The position each row of ``ids`` ``(batch, seq)`` is pooled at, as transformers'
    ``GenericForSequenceClassification`` picks it: the rightmost token that is not ``pad_token_id`` (the first
    position for a row of padding only); without a ``pad_token_id``, the last position of a batch of one row (more
    rows raise transformers' error). Returns ``(batch,)`` integer positions."""
    pad = model.config.get_text_config().pad_token_id
    batch, seq = ids.shape
    if pad is None:
        if batch != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        return torch.full((1,), seq - 1, dtype=torch.int64, device=ids.device)
    non_pad = (ids != pad).to(torch.int32)
    return (torch.arange(seq, device=ids.device, dtype=torch.int32) * non_pad).argmax(-1)


def check_classification_call(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Refuse, by name and with the fix, a classification call :func:`shard_classification_calls` cannot shard
    exactly: positional arguments, keywords (or values) outside :data:`CLASSIFICATION_CALL_KEYWORDS`, ``input_ids``
    that are not ``(batch, seq)`` integers, an ``attention_mask`` of another shape."""
    name = type(module).__name__
    if args:
        raise ValueError(
            f"{name}'s call under CP takes keywords only (input_ids=..., attention_mask=...), got {len(args)} "
            f"positional"
        )
    for key, value in kwargs.items():
        taken = key in ("input_ids", "attention_mask") or (key in _TAKEN_FLAGS and value is _TAKEN_FLAGS[key])
        if value is None or taken:
            continue
        fix = REFUSED_CALL_KEYWORDS.get(key, "mesh_cp does not split it over the CP ranks; call without it")
        shown = f"{key}={value!r}" if isinstance(value, (bool, int, float, str)) else key
        raise NotImplementedError(
            f"{name}'s call under CP was given {shown}: {fix} (a sharded classification call takes "
            f"{sorted(CLASSIFICATION_CALL_KEYWORDS)})"
        )
    ids = kwargs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"{name}'s call under CP needs input_ids of shape (batch, seq), got {_shape(ids)}")
    mask = kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, Tensor) or mask.shape != ids.shape):
        raise ValueError(f"attention_mask of shape {_shape(mask)} must match input_ids {tuple(ids.shape)}")


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__


class MeshCPRewardMixin(MeshCPSequenceTrainerMixin):
    """What :func:`~mesh_cp.integrations.hf.mesh_cp_trainer_class` adds to TRL's ``RewardTrainer`` (module doc): the
    model's calls sharded by :func:`shard_classification_calls` (gradients scaled by ``cp_size``: accelerate's DDP
    averages them over every DP x CP rank), TRL's ``margin`` column left out of the model's call as one process's
    model ignores it. A PEFT adapter is refused by name."""

    mesh_cp_pairs = True

    def mesh_cp_before_init(self, kwargs: dict[str, Any]) -> None:
        """Refuse a PEFT model or ``peft_config`` (PEFT calls the classifier's ``forward`` itself, past the hooks
        that shard it)."""
        model = kwargs.get("model")
        if kwargs.get("peft_config") is not None or hasattr(model, "peft_config"):
            raise NotImplementedError(
                f"{type(self).__name__}: a PEFT adapter calls the classifier's forward directly, past the hooks that "
                f"shard its calls over the CP ranks; train the reward model without a PEFT adapter under CP (all its "
                f"weights), or with the adapter without CP"
            )

    def mesh_cp_attach(self) -> None:
        """Attach the reward model to the mesh with its calls sharded (:func:`shard_classification_calls`), once."""
        mesh = self.parallel.mesh
        model = self.accelerator.unwrap_model(self.model)
        if id(model) in self._mesh_cp_attached:
            return
        shard_classification_calls(model, mesh, grad_scale=mesh.size, ignored=("margin",))
        self._mesh_cp_attached.add(id(model))
