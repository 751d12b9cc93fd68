"""What differs between the supported megatron-core versions (0.16 to 0.20), in one place; each difference read from
that version's source and detected by the parameters of the installed function, never by a version number.

- ``megatron.core.utils.get_batch_on_this_cp_rank``: ``(batch, cp_group=None)`` in 0.16 and 0.17; from 0.18
  ``(batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None)`` with ``is_hybrid_cp`` required (0.19 adds
  ``use_per_sequence_balancing=False``). :func:`batch_on_this_cp_rank` calls either.
- THD batches: 0.16 and 0.17 have ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
  cp_size, cp_rank) -> (batch, PackedSeqParams)``; 0.18 removed it, and ``get_batch_on_this_cp_rank`` partitions a
  batch holding ``cu_seqlens`` (with a leading batch dimension) per document, with ``is_hybrid_cp=False``, returning
  the batch only. :func:`thd_batch_on_this_cp_rank` calls either and builds the same ``PackedSeqParams``.
- ``dist_checkpointing.save(..., async_sharded_save=True)``: from 0.17 it takes ``async_strategy``, whose default
  ``"nvrx"`` needs nvidia-resiliency-ext; :data:`ASYNC_STRATEGY` is megatron-core's own (``"mcore"``), whose
  ``AsyncCallsQueue`` mesh_cp's checkpoints schedule the request on, in every version.

Note [is_hybrid_cp]
~~~~~~~~~~~~~~~~~~~
From 0.18, ``get_batch_on_this_cp_rank`` dispatches on the batch: without ``cu_seqlens`` (or with it ``None``) it cuts
every sequence into ``2 * CP`` chunks and keeps chunks ``r`` and ``2CP-1-r`` over ``cp_group``, whatever
``is_hybrid_cp`` says (0.18: ``get_pretrain_batch_on_this_cp_rank``, 0.19 and 0.20:
``_get_batch_on_this_cp_rank_per_sequence_balancing``; the code of 0.16's ``get_batch_on_this_cp_rank``), which is
mesh_cp's zig-zag. With ``cu_seqlens``, ``is_hybrid_cp=False`` partitions each document over ``cp_group`` (THD);
``is_hybrid_cp=True`` is Megatron's hybrid (dynamic) CP, which shards each sample over a CP group of its own size
(``local_cp_size``) made by ``hybrid_cp_group_func``: a sample would not span the mesh's CP group, so mesh_cp never
asks for it. ``False`` is the value for mesh_cp's zig-zag.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import utils as megatron_utils
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

__all__ = [
    "ASYNC_STRATEGY",
    "METADATA_KEYS",
    "THD_KEYS",
    "async_save_options",
    "batch_on_this_cp_rank",
    "check_sequence_length",
    "takes_is_hybrid_cp",
    "thd_batch_on_this_cp_rank",
]

ASYNC_STRATEGY = "mcore"
"""The asynchronous-save implementation mesh_cp schedules on (megatron-core's own ``AsyncCallsQueue``)."""

METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")
"""The keys that megatron-core 0.18 and later leave whole in ``get_batch_on_this_cp_rank`` (and 0.16 cuts)."""

THD_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The keys a THD batch may hold: those 0.18 and later partition (0.16 partitions every key; another key would be
left whole there, so it is refused in every version)."""


@functools.cache  # read once per installed function (batch_on_this_cp_rank asks every step)
def _takes(function, name: str) -> bool:
    return name in inspect.signature(function).parameters


def takes_is_hybrid_cp() -> bool:
    """Whether the installed ``get_batch_on_this_cp_rank`` has the ``is_hybrid_cp`` parameter (0.18 and later)."""
    return _takes(megatron_utils.get_batch_on_this_cp_rank, "is_hybrid_cp")


def check_sequence_length(seq: int, *, cp: int, name: str = "sequence length") -> None:
    """Refuse (``ValueError``) a sequence length that is not a positive multiple of ``2 * cp``: Megatron's zig-zag
    layout cuts every sequence into ``2 * CP`` equal chunks. The message names ``name``, the value, the multiple and
    the nearest valid lengths."""
    multiple = 2 * cp
    if seq >= 1 and seq % multiple == 0:
        return
    below, above = seq // multiple * multiple, (max(seq, 1) + multiple - 1) // multiple * multiple
    nearest = f"{below} or {above}" if below >= multiple else f"{above}"
    raise ValueError(
        f"{name} {seq} must be a positive multiple of 2*CP = {multiple} (CP {cp}) for Megatron's zig-zag layout, "
        f"which cuts each sequence into {multiple} chunks; the nearest valid lengths are {nearest}"
    )


def batch_on_this_cp_rank(batch: dict[str, Tensor | None], *, cp_group: dist.ProcessGroup) -> dict[str, Tensor | None]:
    """Megatron's ``get_batch_on_this_cp_rank`` on whole sequences: every tensor of ``batch`` (``(batch, seq, ...)``;
    ``attention_mask``: sequence dimension 2; ``None`` values stay) keeps chunks ``r`` and ``2CP-1-r`` of its ``2 *
    CP`` over ``cp_group`` (``is_hybrid_cp=False`` where the installed version takes it: Note [is_hybrid_cp]).

    ``seq`` must be a multiple of ``2 * CP`` (:func:`check_sequence_length`). A batch with ``cu_seqlens`` is THD:
    :func:`thd_batch_on_this_cp_rank`."""
    if cp_group is None:
        raise ValueError("cp_group is None; pass the CP group (parallel_state.get_context_parallel_group())")
    metadata = sorted(key for key in set(batch) & set(METADATA_KEYS) if batch[key] is not None)  # None: not THD
    if metadata:
        raise ValueError(
            f"batch holds {metadata}: megatron-core's metadata of THD and hybrid CP batches, which 0.16 cuts like a "
            f"sequence and 0.18 leaves whole; shard a THD row with thd_batch_on_this_cp_rank(batch, cu_seqlens=..., "
            f"cu_seqlens_padded=..., max_seqlen=..., cp_group=...) (hybrid CP is refused)"
        )
    for key, value in batch.items():
        if value is not None:
            check_sequence_length(value.shape[2 if key == "attention_mask" else 1], cp=cp_group.size(), name=key)
    if takes_is_hybrid_cp():
        return megatron_utils.get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)
    return megatron_utils.get_batch_on_this_cp_rank(dict(batch), cp_group=cp_group)


def thd_batch_on_this_cp_rank(
    batch: Mapping[str, Tensor],
    *,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor,
    max_seqlen: int,
    cp_group: dist.ProcessGroup,
) -> tuple[dict[str, Tensor], PackedSeqParams]:
    """One THD row (``batch``: ``(1, tokens)`` tensors of :data:`THD_KEYS`) partitioned per padded document over
    ``cp_group`` (TransformerEngine's ``thd_get_partitioned_indices``), and its ``PackedSeqParams``
    (``qkv_format="thd"``, ``cu_seqlens`` and the padded ones, ``max_seqlen``), as 0.16's
    ``get_thd_batch_on_this_cp_rank`` returns them, in every version. ``cu_seqlens`` / ``cu_seqlens_padded``: 1-D
    int32 document bounds."""
    unknown = sorted(set(batch) - set(THD_KEYS))
    if unknown:
        raise ValueError(f"THD batch keys {unknown} are not partitioned by every megatron-core; keep to {THD_KEYS}")
    if cu_seqlens.dim() != 1 or cu_seqlens_padded.dim() != 1:
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded {tuple(cu_seqlens_padded.shape)} must be "
            "1-D document bounds"
        )
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    if hasattr(megatron_utils, "get_thd_batch_on_this_cp_rank"):  # 0.16, 0.17
        sharded, _ = megatron_utils.get_thd_batch_on_this_cp_rank(
            dict(batch), cu_seqlens, cu_seqlens_padded, torch.tensor([int(max_seqlen)]),
            cp_size=cp_group.size(), cp_rank=cp_group.rank(),
        )  # fmt: skip
        return sharded, params
    meta = {"cu_seqlens": cu_seqlens[None], "cu_seqlens_padded": cu_seqlens_padded[None]}
    sharded = megatron_utils.get_batch_on_this_cp_rank({**batch, **meta}, is_hybrid_cp=False, cp_group=cp_group)
    return {key: sharded[key] for key in batch}, params


def async_save_options() -> dict[str, str]:
    """The keyword arguments ``dist_checkpointing.save(..., async_sharded_save=True)`` needs to return megatron-core's
    own ``AsyncRequest``: ``async_strategy="mcore"`` where it takes the parameter (0.17 and later), none before."""
    return {"async_strategy": ASYNC_STRATEGY} if _takes(dist_checkpointing.save, "async_strategy") else {}
