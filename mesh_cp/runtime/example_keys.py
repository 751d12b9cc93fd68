"""The examples :class:`~mesh_cp.runtime.batch.ShardingCollator` takes, every key honoured exactly or refused by name
(:data:`EXAMPLE_KEYS`).

An example is one tokenized sequence, or several documents laid back to back (TRL's ``pack_dataset`` gives each
packed example ``seq_lengths``; padding-free data numbers every document's ``position_ids`` from 0). Each key that
describes those documents (:data:`BOUNDARY_KEYS`, ``max_length_*``) must describe the same ones: the first given
in :data:`BOUNDARY_KEYS` order is read, every other is checked against it, and a disagreement is refused showing
where the values got and expected differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""The label of a token that does not count in the loss (PyTorch's and transformers' convention)."""

EXAMPLE_KEYS: dict[str, str] = {
    "input_ids": "the example's token ids (required; an example may also be the list of ids itself)",
    "labels": "unshifted labels (-100: no loss), default the ids; shifted on the whole row before sharding",
    "attention_mask": "all ones, or one run of ones (left or right padding) in an example of one document",
    "seq_lengths": "the lengths of the documents packed in the example (TRL's pack_dataset)",
    "position_ids": "0, 1, ... inside each document; restarting at 0 they mark the example's documents",
    "cu_seq_lens_q": "the documents' boundaries [0, ..., length]",
    "cu_seq_lens_k": "as cu_seq_lens_q",
    "seq_idx": "each token's document, counted from 0",
    "max_length_q": "the longest document's length; checked",
    "max_length_k": "as max_length_q",
}
"""The keys of an example :class:`~mesh_cp.runtime.batch.ShardingCollator` takes; any other is refused by name."""

BOUNDARY_KEYS = ("seq_lengths", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
"""The keys that give an example's documents, in the order the first given is read (the others are checked)."""

TOKEN_KEYS = ("labels", "attention_mask", "position_ids", "seq_idx")
"""The keys with one value per token (as many as ``input_ids``)."""

NUMBERING = {"position_ids": "0, 1, ... inside each document", "seq_idx": "each token's document 0, 0, ..., 1, 1, ..."}


@dataclass(frozen=True)
class Example:
    """One example as :func:`read_example` reads it."""

    input_ids: Tensor
    """``(length,)`` int64 token ids."""
    labels: Tensor
    """``(length,)`` int64 unshifted labels, ``-100`` where none (padding included)."""
    documents: tuple[int, ...]
    """The lengths of its documents, back to back, summing to ``length`` (one document unless a key says more)."""
    attention_mask: Tensor | None
    """``(length,)`` 0/1 padding of an example of one document; ``None``: no padding."""

    def parts(self) -> list[tuple[Tensor, Tensor]]:
        """The ``(input_ids, labels)`` of every document."""
        return list(zip(self.input_ids.split(self.documents), self.labels.split(self.documents), strict=True))


def read_example(example: Mapping[str, Any] | Sequence[int], index: int) -> Example:
    """Example ``index`` of a batch (a mapping of :data:`EXAMPLE_KEYS`, or a list of token ids), checked."""
    if not isinstance(example, Mapping):
        ids = _tokens(example, "input_ids", index)
        return Example(ids, ids, (len(ids),) if len(ids) else (), None)
    unknown = sorted(str(k) for k in example if k not in EXAMPLE_KEYS)
    if unknown or "input_ids" not in example:
        what = f"has {unknown}, which mesh_cp does not take" if unknown else "has no input_ids"
        raise ValueError(
            f"example {index} {what} (ShardingCollator takes {sorted(EXAMPLE_KEYS)}); drop the other columns "
            f"(dataset.select_columns, or Trainer's remove_unused_columns), or collate the batch yourself and shard it "
            f"with mesh_cp.shard_batch"
        )
    ids = _tokens(example["input_ids"], "input_ids", index)
    given = {k: _tokens(example[k], k, index, len(ids)) for k in TOKEN_KEYS if example.get(k) is not None}
    documents = _documents(example, len(ids), index)
    mask, labels = given.get("attention_mask"), given.get("labels")
    if mask is not None:
        mask = _padding(mask, documents, index)
    if labels is None:
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    elif mask is not None:
        _check_no_padding_labels(labels, mask, index)
    return Example(ids, labels, documents, mask)


def first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    """Where two integer lists first differ, with a few values either side of it."""
    got, want = list(got), list(want)
    at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
    lo = max(0, at - 3)
    return f"first difference at index {at}: got [...{got[lo : at + 4]}...], expected [...{want[lo : at + 4]}...]"


def _tokens(value: Any, key: str, index: int, length: int | None = None) -> Tensor:
    """``value`` as a 1-D int64 tensor (``length`` values, where given), or a ``ValueError`` naming ``key``."""
    tensor = torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(f"example {index}'s {key} must be one sequence (1-D), got shape {tuple(tensor.shape)}")
    if tensor.numel() and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"example {index}'s {key} must hold integers, got dtype {tensor.dtype}")
    if length is not None and len(tensor) != length:
        raise ValueError(
            f"example {index}'s {key} has {len(tensor)} values, its input_ids {length}: give one per token"
        )
    return tensor.long().cpu()


def _documents(example: Mapping[str, Any], length: int, index: int) -> tuple[int, ...]:
    """The lengths of the example's documents, read from the first of :data:`BOUNDARY_KEYS` given (one document if
    none is), every boundary and ``max_length_*`` key checked against them."""
    given = [k for k in BOUNDARY_KEYS if example.get(k) is not None]
    source = given[0] if given else None
    lengths = _read_lengths(source, _ints(example[source]), length, index) if source else [length] if length else []
    checked = given + [k for k in ("max_length_q", "max_length_k") if example.get(k) is not None]
    for key in checked:
        got, want = _ints(example[key]), encode_documents(key, lengths)
        if got == want:
            continue
        if key == source:  # position_ids or seq_idx numbering its documents otherwise
            raise ValueError(
                f"example {index}'s {key} are not {NUMBERING[key]} ({first_difference(got, want)}); fix or drop {key}"
            )
        of = f"its {source} (documents {lengths})" if source else f"its one document of {length} tokens"
        raise ValueError(
            f"example {index}'s {key} does not describe the documents of {of}: {first_difference(got, want)}; make "
            f"them agree or drop {key}"
        )
    return tuple(lengths)


def _read_lengths(key: str, values: list[int], length: int, index: int) -> list[int]:
    """The document lengths ``key``'s ``values`` give (checked only as far as reading them needs)."""
    if key == "seq_lengths":
        if any(n < 1 for n in values) or sum(values) != length:
            raise ValueError(
                f"example {index}'s seq_lengths {values} must be positive and sum to its {length} tokens (input_ids)"
            )
        return values
    if key.startswith("cu_seq_lens"):
        if values[:1] != [0] or values[-1:] != [length] or any(n < 1 for n in _steps(values)):
            raise ValueError(
                f"example {index}'s {key} {values} must rise from 0 to its {length} tokens (input_ids), one step per "
                f"document"
            )
        return _steps(values)
    if key == "position_ids":
        if values[:1] not in ([], [0]):
            raise ValueError(
                f"example {index}'s position_ids do not start at 0 (got {values[:8]}...): an example numbers each of "
                f"its documents from 0 (drop position_ids for one document)"
            )
        starts = [i for i, p in enumerate(values) if p == 0] + [length]
    else:  # seq_idx: a new document wherever the index changes
        starts = [i for i, d in enumerate(values) if i == 0 or d != values[i - 1]] + [length]
    return _steps(starts)


def _steps(bounds: list[int]) -> list[int]:
    return [b - a for a, b in pairwise(bounds)]


def encode_documents(key: str, lengths: list[int]) -> list[int]:
    """What ``key`` (one of :data:`BOUNDARY_KEYS` or ``max_length_*``) holds for documents of ``lengths`` laid back
    to back."""
    if key == "seq_lengths":
        return list(lengths)
    if key == "position_ids":
        return [p for n in lengths for p in range(n)]
    if key.startswith("cu_seq_lens"):
        return [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    if key.startswith("max_length"):
        return [max(lengths, default=0)]
    assert key == "seq_idx", key
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def _ints(value: Any) -> list[int]:
    return torch.as_tensor(value).flatten().tolist()


def _padding(mask: Tensor, documents: tuple[int, ...], index: int) -> Tensor | None:
    """An example's ``attention_mask``: ``None`` when all ones; refused unless 0/1, and with several documents."""
    values = set(mask.unique().tolist())
    if not values <= {0, 1}:
        raise ValueError(f"example {index}'s attention_mask must hold 0 and 1, got {sorted(values)}")
    if bool(mask.all()):
        return None
    if len(documents) > 1:
        raise ValueError(
            f"example {index} holds {len(documents)} documents and pads (attention_mask 0 at "
            f"{(mask == 0).nonzero().flatten().tolist()[:8]}...): a packed example has no padding; drop its padded "
            f"tokens (and attention_mask)"
        )
    return mask


def _check_no_padding_labels(labels: Tensor, mask: Tensor, index: int) -> None:
    """Labels other than ``-100`` on padding: one process trains on them, mesh_cp gives padding no label."""
    trained = (labels != IGNORE_INDEX) & (mask == 0)
    if bool(trained.any()):
        at = int(trained.nonzero()[0])
        raise ValueError(
            f"example {index}'s labels on {int(trained.sum())} padded tokens (attention_mask 0) are not -100, the "
            f"first at {at} ({int(labels[at])}): one process would train on padding there, mesh_cp gives padding no "
            f"label; set labels to -100 where attention_mask is 0"
        )
