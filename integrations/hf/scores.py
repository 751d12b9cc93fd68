"""Per-token scores of whole sequences under CP: TRL's fused LM head called with full rows, computed over the mesh.

::

    trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    hf.attach(model, mesh)
    shard_fused_calls(model, mesh)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)   # full (B, S) rows
    out.log_probs                        # (B, S - 1): every row's per-token log-probs, the same on every CP rank

Note [Whole sequences under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Preference and RL losses (DPO's, GRPO's, a reward model's) compare whole sequences: each sequence's summed
log-probability, its pooled score, its tokens' ratios to a reference. They cannot be split into one share per rank
the way a token-mean loss is. So every CP rank of a DP replica holds the replica's full batch, as one process
would, and only the model call is sharded: a forward pre-hook (run before the attachment's own) cuts the call's
full rows into this rank's shard (:func:`~mesh_cp.runtime.batch.shard_batch`: labels shifted on the full rows,
global positions, padding as a mask), the model runs its shard with TRL's fused LM head (no ``[B, S, V]`` logits),
and a forward hook gathers every per-token field back to its full rows (:func:`~mesh_cp.runtime.sharding.
gather_sequence`: ``(B, S)`` floats, the ``[B, S]`` a single process has, never ``[B, S, V]``). The client's loss
and metrics then run unchanged on the same full tensors on every rank of the group. The gather's backward hands
each rank the gradient of its own tokens, so the parameter gradients summed over the CP group are the gradient of
the replica's loss; a framework that averages over all DP x CP ranks is given ``grad_scale = cp_size``.

The premise is that every rank of a CP group is given the same rows: a group whose ranks hold different rows would
train silently wrong, so every sharded call checks it (one all-reduce of two integers over the group).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.runtime.batch import IGNORE_INDEX, shard_batch
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.sharding import gather_sequence

FUSED_CALL_KEYWORDS: dict[str, str] = {
    "input_ids": "(batch, seq) token ids of the full rows, the same on every CP rank",
    "attention_mask": "(batch, seq) padding: one run of ones per row (left, right or both sides)",
    "labels": "(batch, seq) unshifted labels, -100 where none; shifted on the full rows",
    "fused_lm_head": "True: score the labels with TRL's fused LM head",
    "use_cache": "False (a training forward keeps no cache)",
}
"""The keywords a sharded fused call takes (:func:`shard_fused_calls`); any other is refused by name."""

PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of TRL's ``FusedCausalLMOutput``, gathered to the full rows."""


def shard_fused_calls(model: torch.nn.Module, mesh: CPMesh, *, grad_scale: float = 1.0) -> Any:
    """Make ``model`` (given TRL's fused LM head by ``trl.trainer.utils.add_fused_lm_head`` and attached to ``mesh``)
    take full rows in its fused calls: ``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)`` runs this
    rank's shard and returns TRL's ``FusedCausalLMOutput`` with every per-token field over the full rows, ``(batch,
    seq - 1)`` as one process gets it, the same on every rank of ``mesh`` (Note [Whole sequences under CP]). Calls
    without ``fused_lm_head`` (generation) are left as they are. ``grad_scale``: what the gather's backward
    multiplies each rank's gradient by (``mesh.size`` when the gradients are averaged over the CP group). Returns
    the handles of the two hooks (``.remove()`` each to undo)."""
    calls = _FusedCalls(mesh, grad_scale)
    return (
        model.register_forward_pre_hook(calls.before, with_kwargs=True, prepend=True),
        model.register_forward_hook(calls.after, with_kwargs=True, prepend=True),
    )


class _FusedCalls:
    """The hooks of :func:`shard_fused_calls`: the full rows' length of the call in flight (one module's calls do not
    nest; a reference model's has its own hooks). Set by every sharded call, so a call that raised leaves nothing
    behind for the next."""

    def __init__(self, mesh: CPMesh, grad_scale: float) -> None:
        self.mesh, self.grad_scale = mesh, grad_scale
        self.seq: int | None = None

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("fused_lm_head") is not True:
            return None
        check_fused_call(module, args, kwargs)
        ids = kwargs["input_ids"]
        labels = kwargs.get("labels")
        labels = ids if labels is None else labels
        mask = kwargs.get("attention_mask")
        check_same_rows(ids, labels, self.mesh, what=f"{type(module).__name__}'s fused call")
        batch, seq = ids.shape
        extra = -seq % self.mesh.seq_multiple("zigzag")
        if extra:  # the mesh's length multiple: right padding, no label
            ids = torch.nn.functional.pad(ids, (0, extra))
            labels = torch.nn.functional.pad(labels, (0, extra), value=IGNORE_INDEX)
            mask = torch.nn.functional.pad(torch.ones_like(ids[:, :seq]) if mask is None else mask, (0, extra), value=0)
        shard = shard_batch(ids, mesh=self.mesh, labels=labels, attention_mask=mask)
        call = {"input_ids": shard.input_ids, "position_ids": shard.position_ids, "shift_labels": shard.shift_labels}
        if shard.mask is not None:
            call["mesh_cp_mask"] = shard.mask
        self.seq = seq
        return (), {**call, "fused_lm_head": True, "use_cache": False}

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if kwargs.get("fused_lm_head") is not True or self.seq is None:
            return None
        seq, self.seq = self.seq, None
        fields = {}
        for name in PER_TOKEN_FIELDS:
            local = getattr(output, name, None)
            if local is None:
                continue
            dtype = local.dtype
            if dtype == torch.bool:  # gloo gathers no booleans
                local = local.to(torch.uint8)
            full = gather_sequence(local, mesh=self.mesh, dim=1, layout="zigzag", grad_scale=self.grad_scale)
            fields[name] = full[:, : seq - 1].to(dtype)
        labelled = fields["label_mask"] if "label_mask" in fields else fields["log_probs"] != 0
        loss = -fields["log_probs"].sum() / labelled.sum().clamp(min=1)
        return type(output)(loss=loss, aux_loss=getattr(output, "aux_loss", None), **fields)


def check_fused_call(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Refuse, by name, a fused call :func:`shard_fused_calls` cannot shard exactly: positional arguments, keywords
    outside :data:`FUSED_CALL_KEYWORDS`, rows that are not ``(batch, seq)``."""
    name = type(module).__name__
    if args:
        raise ValueError(
            f"{name}'s fused call under CP takes keywords only (input_ids=..., labels=...), got {len(args)} positional"
        )
    unknown = sorted(k for k, v in kwargs.items() if k not in FUSED_CALL_KEYWORDS and v is not None)
    if kwargs.get("use_cache"):
        unknown.append("use_cache=True")
    if unknown:
        raise NotImplementedError(
            f"{name}'s fused call under CP was given {unknown}, which mesh_cp does not shard (it takes "
            f"{sorted(FUSED_CALL_KEYWORDS)}): MoE router logits, multimodal inputs, positions and caches of whole rows "
            f"are not split over the CP ranks; train without them, or without CP"
        )
    ids = kwargs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError(f"{name}'s fused call under CP needs input_ids of shape (batch, seq), got {_shape(ids)}")
    for key in ("attention_mask", "labels"):
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, Tensor) or value.shape != ids.shape):
            raise ValueError(f"{key} of shape {_shape(value)} must match input_ids {tuple(ids.shape)}")


def check_same_rows(ids: Tensor, labels: Tensor, mesh: CPMesh, *, what: str) -> None:
    """Raise unless every rank of ``mesh`` was given the same ``ids`` and ``labels`` (Note [Whole sequences under
    CP]): a fingerprint of both, its maximum and minimum over the group compared (one all-reduce)."""
    if mesh.size == 1:
        return
    weights = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64).view(ids.shape) % 1_000_003
    mine = int(((ids.long() * weights).sum() * 31 + (labels.long() * weights).sum() + ids.shape[1]) % (1 << 61))
    low, high = spread(mine, mesh.group, ids.device)
    if low != high:
        raise RuntimeError(
            f"{what}: the ranks of the CP group were given different rows (shape {tuple(ids.shape)} here); every CP "
            f"rank of a DP replica must hold the replica's whole batch (each replica's part of the global batch, the "
            f"same on its CP ranks, and the same random state for generation and shuffling)"
        )


def spread(value: int, group: dist.ProcessGroup, device: torch.device) -> tuple[int, int]:
    """The least and the greatest of every rank's ``value`` over ``group`` (one all-reduce of two integers)."""
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return -int(both[1]), int(both[0])


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__
