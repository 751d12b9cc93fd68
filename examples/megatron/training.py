"""Training-step pieces for a Megatron-core GPT under TP x CP(a x b) x DP, on GPU and on CPU.

- :func:`shard_batch`: labels shifted on the *full* sequence, then Megatron's own
  ``get_batch_on_this_cp_rank`` cuts the zig-zag chunks ``r`` and ``2CP-1-r``.
- :func:`loss_share`: this rank's token losses summed over the token count of the whole global batch
  (every DP replica and CP rank), so losses and gradients add up to those of the global mean.
- :func:`reduce_gradients_cpu` / :func:`grad_norm_cpu`: the sum over
  ``get_data_parallel_group(with_context_parallel=True)`` and the global gradient norm, for CPU runs,
  where Megatron's ``DistributedDataParallel``, ``get_megatron_optimizer`` and ``get_grad_norm_fp32``
  assert CUDA. On GPU use Megatron's DDP with ``calculate_per_token_loss=True`` (it then sums).
- :func:`use_cpu_rotary_embedding`: the one CPU workaround for the model itself (RoPE).

The step of ``examples/megatron/pretrain_gpt.py``; import it as ``examples.megatron.training`` (with the
repository root on ``sys.path``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import get_batch_on_this_cp_rank
from torch import Tensor

from mesh_cp.runtime.device_checks import check_on_device


def shard_batch(tokens: Tensor, *, cp_group: dist.ProcessGroup, loss_mask: Tensor | None = None) -> dict[str, Tensor]:
    """This CP rank's share of a ``(batch, seq + 1)`` token window: ``tokens``, ``labels`` (next tokens,
    shifted before sharding, so no shard loses its last label), ``loss_mask`` and global
    ``position_ids``, each ``(batch, seq / CP)`` in Megatron's zig-zag layout.

    ``seq`` must be a multiple of ``2 * CP``; ``loss_mask`` (``(batch, seq)``, 1 = counts) defaults to ones.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (batch, seq + 1), got shape {tuple(tokens.shape)}")
    seq = tokens.shape[1] - 1
    cp = cp_group.size()
    if seq < 1 or seq % (2 * cp):
        fix = -(-max(seq, 1) // (2 * cp)) * 2 * cp
        raise ValueError(
            f"sequence length {seq} (tokens {tokens.shape[1]} = seq + 1) must be a positive multiple of 2*CP = "
            f"{2 * cp} for the zig-zag layout; use seq {fix}"
        )
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
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def loss_share(per_token_loss: Tensor, loss_mask: Tensor, global_tokens: int | Tensor) -> Tensor:
    """``sum(loss * mask) / global_tokens``: this rank's share of the global mean next-token loss.

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


def reduce_gradients_cpu(model: torch.nn.Module) -> None:
    """CPU path of gradient reduction: sum every gradient over DP x CP (each rank's loss is its share
    of the global mean, so the sum is the full gradient). On GPU Megatron's DDP does this."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def grad_norm_cpu(model: torch.nn.Module) -> Tensor:
    """CPU path of the global L2 gradient norm: squares of the TP shards (replicated parameters once, by
    Megatron's ``param_is_not_tensor_parallel_duplicate``), summed over the model-parallel group.

    A 0-dim float64 tensor on the parameters' device (``float()`` it to print)."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt()


def clip_gradients_cpu(model: torch.nn.Module, max_norm: float, norm: Tensor | float) -> None:
    """Scale gradients by ``max_norm / (norm + 1e-6)`` when the global ``norm`` exceeds ``max_norm`` (CPU
    path; ``max_norm <= 0``: off). The choice is made where ``norm`` is, without reading it on the host."""
    if max_norm <= 0:
        return
    norm = torch.as_tensor(norm, dtype=torch.float64, device=next(model.parameters()).device)
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))


class _CPURotaryEmbedding(RotaryEmbedding):
    """CPU workaround: Megatron's ``RotaryEmbedding.get_emb`` moves its frequencies to CUDA and
    ``get_pos_emb_on_this_cp_rank`` indexes through a pinned CUDA tensor. The same embedding, computed
    where the frequencies are, and the same zig-zag slice (chunks ``r`` and ``2CP-1-r``)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        emb = self.get_emb(max_seq_len, offset)
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            cp, r = cp_group.size(), cp_group.rank()
            emb = emb.view(2 * cp, -1, *emb.shape[1:])[[r, 2 * cp - 1 - r]].flatten(0, 1)
        return emb


def use_cpu_rotary_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """CPU workaround (see :class:`_CPURotaryEmbedding`): switch ``model``'s RoPE module, if any, to the
    CPU form, with its frequencies (a plain attribute, which ``model.to`` does not move) on the device of
    the model's parameters. Parameters and outputs are unchanged; on GPU do not call it."""
    device = next(model.parameters()).device
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = _CPURotaryEmbedding
            module.inv_freq = module.inv_freq.to(device)
    return model
