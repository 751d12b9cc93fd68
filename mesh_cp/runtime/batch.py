"""Causal-LM batches over a CP mesh: labels shifted on the full sequence, this rank's shard, its loss share.

::

    batch = shard_batch(input_ids, mesh=mesh)          # this rank's input_ids, global position_ids, shift_labels
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids)
    loss = causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()                                    # then sum parameter gradients over the CP group

Each rank's ``loss`` is its share of the global mean (token losses summed over its shard, divided by
the label count of the whole sequence), so the loss is the sum over the CP group and so is every
parameter gradient (:func:`mesh_cp.runtime.parallel.reduce_gradients`). Labels are shifted on the *full*
sequence before sharding, so the last token of every shard keeps its label. Framework-agnostic: the
adapters and examples of every framework use these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mesh_cp.core.options import Layout, check_layout
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.sharding import position_ids, shard_sequence

IGNORE_INDEX = -100
"""The label of a token that does not count in the loss (PyTorch's and transformers' convention)."""


@dataclass(frozen=True)
class ShardedBatch:
    """One CP rank's share of a causal-LM batch."""

    input_ids: Tensor
    """``(batch, seq_local)`` token ids of this rank's shard."""
    position_ids: Tensor
    """``(batch, seq_local)`` global positions (pass them to the model: it would number the shard from 0)."""
    shift_labels: Tensor
    """``(batch, seq_local)`` next-token labels, shifted on the full sequence; ``-100`` where none."""
    num_items_in_batch: int
    """Labels that count in the whole batch (every shard of this CP group together)."""


def shard_batch(
    input_ids: Tensor,
    *,
    mesh: CPMesh,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    layout: Layout = "zigzag",
    device: torch.device | str | None = None,
) -> ShardedBatch:
    """Shift labels on the full ``(batch, seq)`` sequence, then give this rank its shard (see module doc).

    ``labels`` default to ``input_ids``; ``-100`` marks tokens without a label. A right-padding
    ``attention_mask`` (ones then zeros per row) is exact under causal attention: the padded tokens
    get no label and no real token attends to them. Left or inner padding is refused.

    ``device``: where the returned tensors go (the device the training loop runs the model on);
    ``None`` keeps the input's device. The labels are counted and the shard cut where the inputs
    are, so inputs on the CPU (a ``DataLoader``'s) cost the accelerator no host synchronisation and
    only this rank's shard is copied.
    """
    check_layout(layout)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    labels = labels.clone()
    if attention_mask is not None:
        labels[~_right_padding(attention_mask, input_ids.shape)] = IGNORE_INDEX
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    device = input_ids.device if device is None else torch.device(device)
    positions = position_ids(input_ids.shape[1], mesh=mesh, layout=layout, device=device)
    return ShardedBatch(
        input_ids=shard_sequence(input_ids, mesh=mesh, dim=1, layout=layout).to(device),
        position_ids=positions.unsqueeze(0).expand(input_ids.shape[0], -1),
        shift_labels=shard_sequence(shift, mesh=mesh, dim=1, layout=layout).to(device),
        num_items_in_batch=int((shift != IGNORE_INDEX).sum()),
    )


def _right_padding(attention_mask: Tensor, shape: torch.Size) -> Tensor:
    """The boolean mask of real tokens; raise unless every row is ones then zeros."""
    if attention_mask.shape != shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(shape)}"
        )
    keep = attention_mask.bool()
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask pads on the left or inside a sequence; mesh_cp supports right padding only "
            "(tokenizer padding_side='right')"
        )
    return keep


class ShardingCollator:
    """``DataLoader`` collate function: right-pad examples to a length the layout accepts, shift labels
    on the full sequences, and return this CP rank's shard, ready for ``model(**batch)``.

    Every rank of a CP group must see the same examples (same sampler seed, no DP split inside the
    group). The batch holds ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (both the
    shifted labels: transformers' causal-LM loss uses ``shift_labels`` when given) and
    ``num_items_in_batch``, so a transformers model's own ``loss`` is this rank's share of the global mean.
    ``device``: where the batch's tensors go (``None``: the CPU, where the collator builds them).
    """

    def __init__(
        self,
        mesh: CPMesh,
        *,
        pad_token_id: int,
        layout: Layout = "zigzag",
        pad_to_multiple_of: int = 1,
        device: torch.device | str | None = None,
    ):
        if not isinstance(mesh, CPMesh):
            raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.mesh, self.pad_token_id, self.layout = mesh, pad_token_id, check_layout(layout)
        self.device = None if device is None else torch.device(device)
        parts = 2 * mesh.size if layout == "zigzag" else mesh.size
        self.multiple = math.lcm(parts, pad_to_multiple_of)

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]] | Sequence[int]]) -> dict[str, Tensor]:
        ids = [torch.as_tensor(e["input_ids"] if isinstance(e, Mapping) else e, dtype=torch.long) for e in examples]
        labels = [
            torch.as_tensor(e["labels"], dtype=torch.long) if isinstance(e, Mapping) and "labels" in e else i
            for e, i in zip(examples, ids, strict=True)
        ]
        length = -(-max(len(i) for i in ids) // self.multiple) * self.multiple
        input_ids = torch.full((len(ids), length), self.pad_token_id, dtype=torch.long)
        label_ids = torch.full_like(input_ids, IGNORE_INDEX)
        mask = torch.zeros_like(input_ids)
        for row, (i, lab) in enumerate(zip(ids, labels, strict=True)):
            input_ids[row, : len(i)], label_ids[row, : len(lab)], mask[row, : len(i)] = i, lab, 1
        batch = shard_batch(
            input_ids, mesh=self.mesh, labels=label_ids, attention_mask=mask, layout=self.layout, device=self.device
        )
        return {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            "labels": batch.shift_labels,
            "shift_labels": batch.shift_labels,
            "num_items_in_batch": torch.tensor(batch.num_items_in_batch, device=batch.input_ids.device),
        }


def causal_lm_loss(logits: Tensor, shift_labels: Tensor, num_items_in_batch: int) -> Tensor:
    """This rank's share of the mean next-token loss: its token losses summed, over the global count."""
    if num_items_in_batch < 1:
        raise ValueError(f"num_items_in_batch must be >= 1 (labels that count in the batch), got {num_items_in_batch}")
    summed = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return summed / num_items_in_batch
