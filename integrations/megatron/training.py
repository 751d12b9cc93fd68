"""Training-step pieces for a Megatron-core GPT under TP x CP(a x b) x DP with Mesh-Attention core attention.

- :func:`shard_batch`: labels shifted on the *full* sequence, then Megatron's own
  ``get_batch_on_this_cp_rank`` cuts the zig-zag chunks ``r`` and ``2CP-1-r`` (through
  :func:`~mesh_cp.integrations.megatron.compat.batch_on_this_cp_rank`, which calls it in every supported version).
- :func:`global_token_count`: the tokens that count in the whole global batch (summed over DP x CP).
- :func:`loss_share`: this rank's token losses summed over that count, so losses and gradients summed over
  ``get_data_parallel_group(with_context_parallel=True)`` are those of the global mean. On GPU Megatron's
  ``DistributedDataParallel`` with ``calculate_per_token_loss=True`` sums them.

Import it as ``mesh_cp.integrations.megatron.training``. ``examples/megatron/pretrain_gpt.py`` is a whole
pretraining loop built on it (its CPU-only workarounds stay beside that script).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from mesh_cp.integrations.megatron.compat import batch_on_this_cp_rank, check_sequence_length
from mesh_cp.runtime.device_checks import check_on_device

__all__ = ["check_cp_group", "global_token_count", "loss_share", "shard_batch"]


def shard_batch(tokens: Tensor, *, cp_group: dist.ProcessGroup, loss_mask: Tensor | None = None) -> dict[str, Tensor]:
    """This CP rank's share of a ``(batch, seq + 1)`` token window: ``tokens``, ``labels`` (next tokens,
    shifted before sharding, so no shard loses its last label), ``loss_mask`` and global
    ``position_ids``, each ``(batch, seq / CP)`` in Megatron's zig-zag layout.

    ``seq`` must be a multiple of ``2 * CP``; ``loss_mask`` (``(batch, seq)``, 1 = counts) defaults to ones.
    ``cp_group`` must be the CP group of Megatron's ``parallel_state`` when that is initialized (the group the
    model's mesh tiles), else ``ValueError`` naming both.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, seq + 1), got shape {tuple(tokens.shape)}")
    seq = tokens.shape[1] - 1
    check_sequence_length(seq, cp=cp_group.size(), name="sequence length (tokens - 1)")
    check_cp_group(cp_group)
    if loss_mask is None:
        mask = torch.ones(tokens.shape[0], seq, dtype=torch.float32, device=tokens.device)
    else:
        mask = loss_mask.float()
    if mask.shape != (tokens.shape[0], seq):
        raise ValueError(f"loss_mask shape {tuple(mask.shape)} must be (batch, seq) = {(tokens.shape[0], seq)}")
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": mask.to(tokens.device),
        "position_ids": torch.arange(seq, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1).contiguous(),
    }
    return batch_on_this_cp_rank(batch, cp_group=cp_group)


def check_cp_group(cp_group: dist.ProcessGroup) -> None:
    """Refuse (``ValueError``) a ``cp_group`` other than the CP group of Megatron's ``parallel_state``, when that is
    initialized: the batch would be cut over other ranks than the ones the model's mesh tiles."""
    if not parallel_state.model_parallel_is_initialized():
        return
    ranks = dist.get_process_group_ranks(cp_group)
    expected = dist.get_process_group_ranks(parallel_state.get_context_parallel_group())
    if ranks != expected:
        raise ValueError(
            f"cp_group holds global ranks {ranks} but Megatron's parallel_state CP group of rank {dist.get_rank()} is "
            f"{expected}; pass cp_group=parallel_state.get_context_parallel_group()"
        )


def loss_share(per_token_loss: Tensor, loss_mask: Tensor, global_tokens: int | Tensor) -> Tensor:
    """``sum(loss * mask) / global_tokens``: this rank's share of the global mean next-token loss.

    For a loop that back-propagates it once per step (one micro-batch, the gradients then summed over DP x CP, as
    ``examples/megatron/pretrain_gpt.py`` does). Over several micro-batches, count ``global_tokens`` over all of
    them; under Megatron's ``forward_backward_func``, which scales and normalises the loss itself, return Megatron's
    own ``(loss_sum, num_tokens)`` from the loss function instead.

    ``global_tokens`` (:func:`global_token_count`) must be at least 1, else ``ValueError``. A tensor is
    checked where it is, without reading it on the host (``torch._assert_async``): on the CPU the error is
    raised at once; on a GPU a zero count stops the run with a device-side assertion at the next
    synchronisation, instead of training on a loss of ``0 / 0``."""
    message = "global_tokens must be >= 1 (tokens with a label in the global batch over DP x CP)"
    if not isinstance(global_tokens, Tensor):
        if global_tokens < 1:
            raise ValueError(f"{message}, got {global_tokens}")
    elif global_tokens.numel() != 1:
        raise ValueError(f"global_tokens must be one number, got a tensor of shape {tuple(global_tokens.shape)}")
    else:
        check_on_device((global_tokens >= 1).reshape(()), ValueError(message))
    return (per_token_loss.float() * loss_mask).sum() / global_tokens


def global_token_count(loss_mask: Tensor) -> Tensor:
    """Tokens that count in the global batch: the local count summed over DP x CP."""
    count = loss_mask.sum().to(torch.float64)
    dist.all_reduce(count, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return count
