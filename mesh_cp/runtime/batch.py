"""Causal-LM batches over a CP mesh: labels shifted on the full sequence, this rank's shard, its loss share.

::

    batch = shard_batch(input_ids, mesh=mesh)          # this rank's input_ids, global position_ids, shift_labels
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids)
    loss = causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()                                    # through DDP: gradients summed over the CP group

Each rank's ``loss`` is its share of the global mean (token losses summed over its shard, divided by
the label count of the whole sequence), so the loss is the sum over the CP group and so is every
parameter gradient (:func:`mesh_cp.runtime.parallel.data_parallel`: torch's DDP summing over the group). Labels are shifted on the *full*
sequence before sharding, so the last token of every shard keeps its label. Framework-agnostic: the
adapters and examples of every framework use these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mesh_cp.core.balance import balance_documents
from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.numerics import document_ids
from mesh_cp.core.options import Layout, check_layout
from mesh_cp.core.split import split_documents
from mesh_cp.runtime.example_keys import IGNORE_INDEX, Example, read_example
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.sharding import position_ids, shard_sequence

BALANCE = (False, True, "order", "split")
"""What :class:`ShardingCollator`'s ``balance`` takes."""


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
    mask: AttentionMask | None = None
    """Documents and padding of the rows (packed rows, left padding), for ``mesh_attn_func(mask=...)`` or a
    transformers model's ``mesh_cp_mask=`` keyword; ``None``: one causal sequence per row."""


def shard_batch(
    input_ids: Tensor,
    *,
    mesh: CPMesh,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    layout: Layout = "zigzag",
    device: torch.device | str | None = None,
    documents: Sequence[Sequence[int]] | None = None,
    split: bool = False,
    causal: bool = True,
) -> ShardedBatch:
    """Shift labels on the full ``(batch, seq)`` sequence, then give this rank its shard (see module doc).

    ``labels`` default to ``input_ids``; ``-100`` marks tokens without a label. An ``attention_mask`` (one
    run of ones per row) pads: right padding is exact under causal attention as it is (the padded tokens get
    no label and no real token attends to them); a row padded on the left makes the batch carry a
    :attr:`ShardedBatch.mask` (its real tokens form one document) and position ids that start at 0 on the first
    real token. Inner padding is refused. ``causal=False`` (a model with full attention): every row's real tokens
    are one document of :attr:`ShardedBatch.mask`, right padding and the mesh's own included, so none attends padding.

    ``documents``: packed rows, the lengths of the documents laid back to back in each row (what follows the
    last is padding). No token attends across a document boundary (:attr:`ShardedBatch.mask`), a document's
    last token gets no label, and ``position_ids`` restart at 0 in every document (as transformers' padding-free
    packing numbers them).

    ``split``: lay the ``documents`` out split over the ranks (Note [Split documents] in :mod:`mesh_cp.core.split`):
    every rank then computes the same share of every document's pairs. Labels are shifted and positions counted in
    each document's own order, so every token's output and loss are those of the packed row.

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
    batch, seq = input_ids.shape
    mask = _batch_mask(attention_mask, documents, input_ids.shape, causal)
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    # The document of every token (-1: padding; right padding needs no mask, its real tokens are one document):
    # no label across a document boundary, none for padding.
    ids = None
    if mask is not None:
        ids = document_ids(mask, batch, seq)
    elif attention_mask is not None:
        ids = torch.where(attention_mask.bool(), 0, -1)
    if ids is not None:
        shift[:, :-1][ids[:, :-1] != ids[:, 1:]] = IGNORE_INDEX
        shift[ids < 0] = IGNORE_INDEX
    if split:
        input_ids, shift, mask = _split(input_ids, shift, documents, layout, mesh)
    device = input_ids.device if device is None else torch.device(device)
    if mask is None:
        positions = position_ids(seq, mesh=mesh, layout=layout, device=device).unsqueeze(0).expand(batch, -1)
    else:
        positions = document_positions(mask, batch, seq, mesh=mesh, layout=layout, device=device)
    return ShardedBatch(
        input_ids=shard_sequence(input_ids, mesh=mesh, dim=1, layout=layout).to(device),
        position_ids=positions,
        shift_labels=shard_sequence(shift, mesh=mesh, dim=1, layout=layout).to(device),
        num_items_in_batch=int((shift != IGNORE_INDEX).sum()),
        mask=mask,
    )


def _split(
    input_ids: Tensor, shift: Tensor, documents: Sequence[Sequence[int]] | None, layout: Layout, mesh: CPMesh
) -> tuple[Tensor, Tensor, AttentionMask]:
    """Token ids and shifted labels of packed rows moved to their places in the split layout, and its mask."""
    if documents is None or layout != "zigzag":
        raise ValueError(
            f"split=True lays out packed documents over the zig-zag layout's half-chunks; pass documents= with "
            f"layout='zigzag' (got documents={'None' if documents is None else 'given'}, layout={layout!r})"
        )
    mask, sources = split_documents(documents, seq_len=input_ids.shape[1], world=mesh.size)
    source = torch.tensor(sources, dtype=torch.int64, device=input_ids.device)
    return input_ids.gather(1, source), shift.gather(1, source), mask


def _batch_mask(
    attention_mask: Tensor | None, documents: Sequence[Sequence[int]] | None, shape: torch.Size, causal: bool = True
) -> AttentionMask | None:
    """The :class:`AttentionMask` of packed ``documents``, of left padding, or (not ``causal``) of every row's real
    tokens; ``None`` for unpadded or right-padded rows under causal attention (exact for them as they are)."""
    if documents is not None:
        if attention_mask is not None:
            raise ValueError(
                "pass documents= (packed rows; what follows the last document is padding) or attention_mask=, not both"
            )
        if len(documents) != shape[0] or any(sum(row) > shape[1] for row in documents):
            raise ValueError(
                f"documents {[list(r) for r in documents]} do not fit {shape[0]} rows of {shape[1]} tokens"
            )
        return AttentionMask.from_lengths(documents)
    if attention_mask is None:
        return None if causal else AttentionMask(documents=tuple(((0, shape[1]),) for _ in range(shape[0])))
    keep = _one_run(attention_mask, shape)
    if causal and not bool((keep.any(1) & ~keep[:, 0]).any()):
        return None  # no row starts with padding: right padding (or none)
    spans = []
    for row in keep.tolist():
        first = row.index(True) if True in row else 0
        spans.append(((first, first + sum(row)),) if any(row) else ())
    return AttentionMask(documents=tuple(spans))


def document_positions(
    mask: AttentionMask, batch: int, seq_len: int, *, mesh: CPMesh, layout: Layout, device=None
) -> Tensor:
    """``(batch, seq_local)`` position of each of this rank's tokens inside its document: 0 at every document's
    first token (what RoPE needs for packed and left-padded rows), 0 for padding."""
    inside = torch.zeros(batch, seq_len, dtype=torch.int64)
    for row in range(batch):
        for spans in mask.document_spans(row if mask.rows is not None else 0, seq_len):
            before = 0  # tokens of the document in its earlier parts (Note [Split documents])
            for start, stop in spans:
                inside[row, start:stop] = torch.arange(before, before + stop - start)
                before += stop - start
    return inside[:, position_ids(seq_len, mesh=mesh, layout=layout)].to(device)


def _one_run(attention_mask: Tensor, shape: torch.Size) -> Tensor:
    """The boolean mask of real tokens; raise unless every row is one run of ones (left or right padding)."""
    if attention_mask.shape != shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(shape)}"
        )
    keep = attention_mask.bool()
    runs = (keep[:, 1:] & ~keep[:, :-1]).sum(1) + keep[:, 0].long()
    if bool((runs > 1).any()):
        raise ValueError(
            "attention_mask pads inside a sequence (more than one run of real tokens in a row); mesh_cp takes left "
            "or right padding, or packed documents through documents="
        )
    return keep


class ShardingCollator:
    """``DataLoader`` collate function: right-pad examples to a length the layout accepts
    (:meth:`CPMesh.seq_multiple`, times ``pad_to_multiple_of``), shift labels
    on the full sequences, and return this CP rank's shard, ready for ``model(**batch)``.

    Every rank of a CP group must see the same examples (same sampler seed, no DP split inside the
    group). The batch holds ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (both the
    shifted labels: transformers' causal-LM loss uses ``shift_labels`` when given) and
    ``num_items_in_batch``, so a transformers model's own ``loss`` is this rank's share of the global mean.
    ``device``: where the batch's tensors go (``None``: the CPU, where the collator builds them).

    An example is a list of token ids or a mapping of :data:`~mesh_cp.runtime.example_keys.EXAMPLE_KEYS`, any other
    key refused by name: ``labels`` (default the ids), ``attention_mask`` (left or right padding of an example of one
    document), and the documents packed in an example (``seq_lengths`` of TRL's ``pack_dataset``, ``position_ids``
    restarting at 0, ``cu_seq_lens_*``, ``seq_idx``; every one given must describe the same documents). Under
    ``packed=False`` an example is a row; one holding several documents makes the batch carry ``mesh_cp_mask``, so
    no token attends across a document boundary.

    ``packed=True`` (padding-free packing): the documents of a batch's examples (each of an example's own documents
    counts) become the documents of one row, laid back to back and padded at the end; the batch then also holds
    ``mesh_cp_mask`` (the :class:`~mesh_cp.core.AttentionMask` of the documents, which a model attached with
    :func:`mesh_cp.integrations.hf.attach` passes to its attention) and ``position_ids`` that restart in every
    document. ``balance=True`` (or ``"order"``, with ``packed=True``) lays the documents out in the order that evens
    out the query-key pairs of the mesh's ranks (:func:`mesh_cp.core.balance.balance_documents`, Note [Balanced
    packing]); ``balance="split"`` cuts every document into one part per half-chunk of the zig-zag layout (Note [Split
    documents] in :mod:`mesh_cp.core.split`), which evens out any mix, long documents too, at the price of more and
    shorter varlen sequences. Either way every token keeps its loss, since it attends only inside its document and
    its position counts there, so the loss and gradients are those of the given order up to floating-point rounding.
    Off by default: it changes which tokens each rank holds (so results are not bitwise those of the given order) and
    costs tens of milliseconds of CPU per batch of 128K tokens (more with hundreds of documents).

    ``causal=False``: for a model with full attention; every row's padding, the mesh's included, is in the mask
    (:func:`shard_batch`).
    """

    def __init__(
        self,
        mesh: CPMesh,
        *,
        pad_token_id: int,
        layout: Layout = "zigzag",
        pad_to_multiple_of: int = 1,
        device: torch.device | str | None = None,
        packed: bool = False,
        balance: bool | Literal["order", "split"] = False,
        causal: bool = True,
    ):
        if not isinstance(mesh, CPMesh):
            raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.mesh, self.pad_token_id, self.layout = mesh, pad_token_id, check_layout(layout)
        self.device = None if device is None else torch.device(device)
        self.packed = bool(packed)
        if balance not in BALANCE:
            raise ValueError(f"balance must be one of {', '.join(map(repr, BALANCE))}, got {balance!r}")
        if balance and not self.packed:
            raise ValueError(f"balance={balance!r} lays out the documents of a packed row; pass packed=True with it")
        if balance == "split" and self.layout != "zigzag":
            raise ValueError(f"balance='split' cuts documents over the zig-zag layout, got layout={self.layout!r}")
        self.balance = "order" if balance is True else balance or None
        self.causal = bool(causal)
        self.multiple = math.lcm(mesh.seq_multiple(self.layout), pad_to_multiple_of)

    def __call__(self, examples: Sequence[Mapping[str, Any] | Sequence[int]]) -> dict[str, Tensor]:
        read = [read_example(e, i) for i, e in enumerate(examples)]
        padded = [i for i, e in enumerate(read) if e.attention_mask is not None]
        if self.packed:
            return self._packed(read, padded)
        several = [i for i, e in enumerate(read) if len(e.documents) > 1]
        if padded and several:
            raise ValueError(
                f"examples {padded} pad (attention_mask 0) and examples {several} hold several documents: a batch "
                f"takes padding or documents, not both; drop the padded tokens, or pass packed=True"
            )
        ones = [torch.ones_like(e.input_ids) if e.attention_mask is None else e.attention_mask for e in read]
        rows = pad_batch(
            [e.input_ids for e in read], [e.labels for e in read], ones, multiple=self.multiple,
            pad_token_id=self.pad_token_id,
        )  # fmt: skip
        options = {"documents": [list(e.documents) for e in read]} if several else {"attention_mask": rows[2]}
        return self._shard(rows[0], rows[1], options)

    def _packed(self, read: list[Example], padded: list[int]) -> dict[str, Tensor]:
        """One row of every example's documents (``packed=True``), in the balanced order if asked."""
        if padded:
            raise ValueError(
                f"examples {padded} pad (attention_mask 0): packed=True lays documents back to back with no padding "
                f"between them; drop the padded tokens (and attention_mask) from the examples"
            )
        parts = [part for e in read for part in e.parts()]
        ids, labels = [p[0] for p in parts], [p[1] for p in parts]
        if self.balance == "order":
            ids, labels = self.balanced(ids, labels)
        input_ids, label_ids, _ = pad_batch(
            [torch.cat(ids)], [torch.cat(labels)], multiple=self.multiple, pad_token_id=self.pad_token_id
        )
        options = {"documents": [[len(i) for i in ids]], "split": self.balance == "split"}
        return self._shard(input_ids, label_ids, options)

    def _shard(self, input_ids: Tensor, label_ids: Tensor, options: dict[str, Any]) -> dict[str, Tensor]:
        batch = shard_batch(
            input_ids, mesh=self.mesh, labels=label_ids, layout=self.layout, device=self.device, causal=self.causal,
            **options,
        )  # fmt: skip
        return self.batch_dict(batch)

    def balanced(self, ids: list[Tensor], labels: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """The examples in the order that balances the packed row over the mesh's ranks (the same on every rank)."""
        lengths = [len(i) for i in ids]
        seq_len = max(1, -(-sum(lengths) // self.multiple)) * self.multiple
        tiling = self.mesh.tiling
        (order,) = balance_documents(
            lengths, seq_len=seq_len, world=tiling.world, tile=tiling.shape, layout=self.layout
        )
        return [ids[i] for i in order], [labels[i] for i in order]

    @staticmethod
    def batch_dict(batch: ShardedBatch) -> dict[str, Tensor]:
        """The keyword arguments of ``model(**batch)`` for a :class:`ShardedBatch` (what this collator returns)."""
        out = {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            "labels": batch.shift_labels,
            "shift_labels": batch.shift_labels,
            "num_items_in_batch": torch.tensor(batch.num_items_in_batch, device=batch.input_ids.device),
        }
        return out if batch.mask is None else {**out, "mesh_cp_mask": batch.mask}


def pad_batch(
    rows: Sequence[Tensor],
    labels: Sequence[Tensor] | None = None,
    masks: Sequence[Tensor] | None = None,
    *,
    multiple: int,
    pad_token_id: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad 1-D token ``rows`` into one ``(batch, length)`` batch, ``length`` the longest row rounded up to a
    multiple of ``multiple`` (a mesh's :meth:`CPMesh.seq_multiple`): token ids (``pad_token_id`` on padding),
    labels (``labels``, default the ids; ``IGNORE_INDEX`` on padding) and the attention mask (``masks``, default
    1 on every given token; 0 on padding), what :func:`shard_batch` takes."""
    length = -(-max(len(r) for r in rows) // multiple) * multiple
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    label_ids = torch.full_like(input_ids, IGNORE_INDEX)
    real = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        n = len(ids)
        input_ids[row, :n] = ids
        label_ids[row, :n] = ids if labels is None else labels[row]
        real[row, :n] = 1 if masks is None else masks[row]
    return input_ids, label_ids, real


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
