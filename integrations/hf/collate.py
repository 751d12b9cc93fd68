"""A client's collated batch, sharded over a CP mesh: what TRL's ``DataCollatorForLanguageModeling`` (padded or
padding-free), transformers' ``DataCollatorWithFlattening`` / ``DataCollatorForLanguageModeling(mlm=False)`` or a
user's collator returns, turned into this CP rank's shard, with every key either honoured exactly or refused by
name (:data:`BATCH_KEYS`).

::

    collate = hf.ShardCollated(trl_collator, mesh, pad_token_id=tokenizer.pad_token_id)
    batch = collate(examples)             # this rank's input_ids, position_ids, shift_labels, mesh_cp_mask, ...
    loss = model(**batch).loss

Document boundaries come from ``position_ids`` that restart at 0 (padding-free packing numbers every document
from 0); ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` must say the same and are checked against them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mesh_cp.core.options import Layout, check_layout
from mesh_cp.runtime.batch import IGNORE_INDEX, ShardingCollator, pad_batch, shard_batch
from mesh_cp.runtime.example_keys import encode_documents, first_difference
from mesh_cp.runtime.mesh import CPMesh

BATCH_KEYS: dict[str, str] = {
    "input_ids": "the token ids, (batch, seq), right-padded by the collator",
    "labels": "unshifted labels (-100: no loss), shifted on the full sequence before sharding",
    "attention_mask": "padding: one run of ones per row (left or right padding)",
    "position_ids": "per-row positions; restarting at 0 they mark packed documents (padding-free packing)",
    "cu_seq_lens_q": "a packed row's document starts (one row); checked against position_ids",
    "cu_seq_lens_k": "as cu_seq_lens_q",
    "max_length_q": "the longest document of cu_seq_lens_q; checked",
    "max_length_k": "as max_length_q",
    "seq_idx": "each token's document index (one row); checked against position_ids",
}
"""The keys of a collated batch :func:`shard_collated` takes, and what it does with each; any other key is refused
by name."""

TOKEN_COUNTS = "mesh_cp_tokens"
"""The key under which :func:`shard_collated` gives the token counts of the whole (unsharded) batch, for the
trainer's token counters: ``[attention_mask.sum() (-1: no mask), tokens other than pad_token_id, the row
length]`` (what transformers' and TRL's counters read off the batch a single process sees).
The trainer takes it out of the batch before the model sees it."""


def shard_collated(
    batch: Mapping[str, Any],
    *,
    mesh: CPMesh,
    pad_token_id: int,
    layout: Layout = "zigzag",
    pad_to_multiple_of: int = 1,
    token_counts: bool = False,
    causal: bool = True,
) -> dict[str, Any]:
    """This CP rank's shard of a client's collated causal-LM ``batch`` (module doc), as :class:`ShardingCollator`
    gives it: ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (both shifted on the full
    sequence), ``num_items_in_batch`` and, for packed documents or left padding, ``mesh_cp_mask``. Rows are padded
    to the mesh's :meth:`~mesh_cp.CPMesh.seq_multiple` (times ``pad_to_multiple_of``). ``token_counts`` adds
    :data:`TOKEN_COUNTS`. ``causal=False`` (a model with full attention) puts every row's padding in the mask."""
    check_layout(layout)
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(
            f"the collated batch has {unknown}, which mesh_cp does not shard (it takes {sorted(BATCH_KEYS)}); "
            f"drop them from the collator's output, or shard the batch yourself with mesh_cp.shard_batch"
        )
    if "input_ids" not in batch or "labels" not in batch:
        missing = [k for k in ("input_ids", "labels") if k not in batch]
        raise ValueError(
            f"the collated batch has no {' or '.join(missing)} (keys: {sorted(batch)}): a causal-LM collator gives "
            f"both (DataCollatorForLanguageModeling(tokenizer, mlm=False), TRL's, or mesh_cp's default)"
        )
    input_ids, labels = _tensor(batch, "input_ids"), _tensor(batch, "labels")
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and labels must be (batch, seq) of one shape, got {tuple(input_ids.shape)} and "
            f"{tuple(labels.shape)}"
        )
    attention_mask = _tensor(batch, "attention_mask") if batch.get("attention_mask") is not None else None
    if attention_mask is not None:
        _check_no_padding_labels(labels, attention_mask)
    documents = _documents(batch, input_ids, attention_mask, pad_token_id)
    real = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if documents is not None:
        real = torch.zeros_like(input_ids)
        for r, row in enumerate(documents):
            real[r, : sum(row)] = 1
    multiple = mesh.seq_multiple(layout) * pad_to_multiple_of
    ids, label_ids, mask = pad_batch(
        list(input_ids), list(labels), list(real), multiple=multiple, pad_token_id=pad_token_id
    )
    options = {"documents": documents} if documents is not None else {"attention_mask": mask}
    sharded = shard_batch(ids, mesh=mesh, labels=label_ids, layout=layout, causal=causal, **options)
    out = ShardingCollator.batch_dict(sharded)
    if token_counts:
        counts = [
            -1 if attention_mask is None else int(attention_mask.sum()),
            int((input_ids != pad_token_id).sum()),
            input_ids.shape[1],
        ]
        out[TOKEN_COUNTS] = torch.tensor(counts, dtype=torch.int64)
    return out


def _check_no_padding_labels(labels: Tensor, attention_mask: Tensor) -> None:
    """Labels on padding (``attention_mask`` 0) other than ``-100``: one process trains on them, mesh_cp gives
    padding no label (it is not part of any sequence), so they are refused, naming the first."""
    trained = (labels != IGNORE_INDEX) & (attention_mask == 0)
    if bool(trained.any()):
        row, column = trained.nonzero()[0].tolist()
        raise ValueError(
            f"labels on {int(trained.sum())} padded positions (attention_mask 0) are not -100, the first at row {row}, "
            f"column {column} ({int(labels[row, column])}): one process would train on padding there, mesh_cp gives "
            f"padding no label; set labels to -100 where attention_mask is 0 (as DataCollatorForLanguageModeling does)"
        )


class ShardCollated:
    """Collate function: ``collator`` (a client's: TRL's, transformers', a user's; default :func:`pad_examples`),
    then this CP rank's shard of what it returns (:func:`shard_collated`)."""

    def __init__(
        self,
        collator: Callable[[list], Mapping[str, Any]] | None,
        mesh: CPMesh,
        *,
        pad_token_id: int,
        layout: Layout = "zigzag",
        pad_to_multiple_of: int = 1,
        token_counts: bool = False,
        causal: bool = True,
    ):
        if not isinstance(mesh, CPMesh):
            raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
        if isinstance(collator, (ShardCollated, ShardingCollator)):
            raise ValueError(
                f"collator is already mesh_cp's {type(collator).__name__} (it shards): pass the collator it wraps, "
                f"or leave it out"
            )
        self.collator = collator if collator is not None else PadExamples(pad_token_id)
        self.mesh, self.pad_token_id, self.layout = mesh, pad_token_id, check_layout(layout)
        self.pad_to_multiple_of, self.token_counts, self.causal = pad_to_multiple_of, token_counts, causal

    def __call__(self, examples: list) -> dict[str, Any]:
        return shard_collated(
            self.collator(examples),
            mesh=self.mesh,
            pad_token_id=self.pad_token_id,
            layout=self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            token_counts=self.token_counts,
            causal=self.causal,
        )


class PadExamples:
    """The default causal-LM collator: examples (``{"input_ids": [...], "labels": [...], "attention_mask": [...]}``,
    labels and mask optional, or token lists) right-padded with ``pad_token_id``; the mask defaults to ones, labels
    to the ids with ``-100`` where the mask is 0 and on padding. Other keys that are ``model_inputs`` (the model's
    forward arguments: ``token_type_ids``, ``position_ids``, ...) are refused by name; the rest is left out, as
    Trainer's ``remove_unused_columns`` leaves it out."""

    KEYS = ("input_ids", "labels", "attention_mask")

    def __init__(self, pad_token_id: int, model_inputs: Collection[str] = ()):
        self.pad_token_id, self.model_inputs = pad_token_id, frozenset(model_inputs)

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]] | Sequence[int]]) -> dict[str, Tensor]:
        rows = [dict(e) if isinstance(e, Mapping) else {"input_ids": e} for e in examples]
        extra = sorted({str(k) for r in rows for k in r if k not in self.KEYS and k in self.model_inputs})
        if extra:
            raise ValueError(
                f"examples have {extra}, which mesh_cp's default collator does not take (it pads {list(self.KEYS)}); "
                f"drop those columns, or pass a data_collator that uses them"
            )
        ids = [torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows]
        masks = [
            torch.as_tensor(r["attention_mask"], dtype=torch.long) if "attention_mask" in r else None for r in rows
        ]
        masks = [torch.ones_like(i) if m is None else m for m, i in zip(masks, ids, strict=True)]
        labels = [
            torch.as_tensor(r["labels"], dtype=torch.long) if "labels" in r else i.masked_fill(m == 0, IGNORE_INDEX)
            for r, i, m in zip(rows, ids, masks, strict=True)
        ]
        input_ids, label_ids, real = pad_batch(ids, labels, masks, multiple=1, pad_token_id=self.pad_token_id)
        return {"input_ids": input_ids, "labels": label_ids, "attention_mask": real}


def replica_examples(examples: Sequence[Any], replica: int, replicas: int) -> list[Any]:
    """DP replica ``replica``'s part of a global batch of ``examples`` (the batch a single process would take):
    contiguous parts, sizes differing by at most one (the first replicas take the extra examples). A replica left
    with none (fewer examples than replicas) gets the first example with every label masked, so that it runs a
    forward and backward that add nothing (every rank of a DP x CP layout must run each step)."""
    base, extra = divmod(len(examples), replicas)
    start = replica * base + min(replica, extra)
    part = list(examples[start : start + base + (replica < extra)])
    if part:
        return part
    first = examples[0]
    if not isinstance(first, Mapping) or "input_ids" not in first:
        raise ValueError(
            f"a global batch of {len(examples)} examples leaves DP replica {replica} of {replicas} none, and its "
            f"examples are not dicts with input_ids to stand in with masked labels; use dataloader_drop_last=True or a "
            f"dataset length that fills every batch"
        )
    return [{**first, "labels": [IGNORE_INDEX] * len(first["input_ids"])}]


def _documents(
    batch: Mapping[str, Any], input_ids: Tensor, attention_mask: Tensor | None, pad_token_id: int
) -> list[list[int]] | None:
    """The packed documents of every row (their lengths), read from ``position_ids`` that restart at 0 and checked
    against the other packing keys; ``None`` for plain or padded rows (their positions, if given, checked)."""
    packing = [k for k in BATCH_KEYS if k.startswith(("cu_seq", "max_length", "seq_idx")) and batch.get(k) is not None]
    if batch.get("position_ids") is None:
        if packing:
            raise ValueError(
                f"the collated batch has {packing} but no position_ids: mesh_cp reads a packed row's documents from "
                f"position_ids restarting at 0; have the collator return them (padding_free / return_position_ids)"
            )
        return None
    positions = _tensor(batch, "position_ids")
    if positions.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(positions.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if attention_mask is not None:
        _check_padded_positions(positions, attention_mask)
        return None
    documents = [
        _row_documents(row, ids, pad_token_id, r) for r, (row, ids) in enumerate(zip(positions, input_ids, strict=True))
    ]
    _check_packing_keys(batch, positions)
    if all(len(row) <= 1 and sum(row) == input_ids.shape[1] for row in documents):
        return None  # one unpadded document per row: plain causal rows
    return documents


def _tensor(batch: Mapping[str, Any], key: str) -> Tensor:
    value = batch[key]
    if not isinstance(value, Tensor):
        value = torch.as_tensor(value)
    if value.is_floating_point():
        raise ValueError(f"{key} must hold integers, got dtype {value.dtype}")
    return value.long().cpu()


def _check_padded_positions(positions: Tensor, attention_mask: Tensor) -> None:
    """``position_ids`` beside an ``attention_mask`` (TRL's ``return_position_ids``): each row's real tokens must be
    numbered 0, 1, ... (the positions mesh_cp gives them); other numberings are refused."""
    if attention_mask.shape != positions.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal position_ids shape {tuple(positions.shape)}"
        )
    keep = attention_mask.bool()
    for r in range(positions.shape[0]):
        got = positions[r][keep[r]].tolist()
        if got != list(range(len(got))):
            raise ValueError(
                f"position_ids of row {r} do not number its real tokens 0, 1, ... ({first_difference(got, list(range(len(got))))}); "
                f"mesh_cp numbers a padded row's tokens from its first real token: drop position_ids or fix them"
            )


def _row_documents(positions: Tensor, ids: Tensor, pad_token_id: int, row: int) -> list[int]:
    """The lengths of the documents of one padding-free row (``positions`` restart at 0 in each). A tail of
    one-token "documents" of padding (padding-free collators number padding 0, 0, ...) is padding."""
    pos = positions.tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    if not starts or starts[0] != 0:
        raise ValueError(
            f"position_ids of row {row} do not start at 0 (got {pos[:8]}...): a packed row numbers every document "
            f"from 0"
        )
    bounds = starts + [len(pos)]
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = encode_documents("position_ids", lengths)
    if pos != expected:
        raise ValueError(
            f"position_ids of row {row} are not 0, 1, ... inside each document ({first_difference(pos, expected)}); "
            f"mesh_cp reads packed documents from positions that restart at 0"
        )
    tail = len(lengths)
    token = ids.tolist()
    while tail > 1 and lengths[tail - 1] == 1 and token[bounds[tail - 1]] == pad_token_id:
        tail -= 1
    return lengths[:tail]


def _check_packing_keys(batch: Mapping[str, Any], positions: Tensor) -> None:
    """``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` must be what ``position_ids`` say (as transformers and
    TRL derive them: a document starts wherever a position is 0)."""
    given = [k for k in BATCH_KEYS if k.startswith(("cu_seq", "max_length", "seq_idx")) and batch.get(k) is not None]
    if not given:
        return
    if positions.shape[0] != 1:
        raise ValueError(
            f"{given} describe one packed row; the batch has {positions.shape[0]} rows: pack the batch into one row "
            f"(padding_free) or drop them"
        )
    cu = (positions[0] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
    lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    for key in given:
        got, want = torch.as_tensor(batch[key]).flatten().tolist(), encode_documents(key, lengths)
        if got != want:
            raise ValueError(
                f"{key} does not describe the documents of position_ids ({first_difference(got, want)}); "
                f"mesh_cp takes packed documents from position_ids restarting at 0: make them agree or drop {key}"
            )
