"""CPU workarounds of ``examples/megatron/pretrain_gpt.py``: what Megatron does on GPU, for CPU runs.

Megatron's ``DistributedDataParallel``, ``get_megatron_optimizer`` and ``get_grad_norm_fp32`` assert CUDA, and
its RoPE module moves its frequencies to CUDA. On CPU the example uses instead:

- :func:`reduce_gradients_cpu` / :func:`grad_norm_cpu` / :func:`clip_gradients_cpu`: the sum over
  ``get_data_parallel_group(with_context_parallel=True)``, the global gradient norm and clipping. On GPU use
  Megatron's DDP with ``calculate_per_token_loss=True`` (it then sums) and its optimizer.
- :func:`use_cpu_rotary_embedding`: the one CPU workaround for the model itself (RoPE).
- :func:`cpu_thd_partition`: Megatron's THD partition (``get_thd_batch_on_this_cp_rank`` in megatron-core 0.16 and
  0.17, ``get_batch_on_this_cp_rank`` of a batch with ``cu_seqlens`` from 0.18) calls TransformerEngine's
  ``thd_get_partitioned_indices`` (a CUDA kernel); on CPU it gets the same indices from
  :func:`mesh_cp.core.split.thd_partitioned_indices`.

The step pieces used on every device (``shard_batch``, ``loss_share``, ``global_token_count``) are installed:
:mod:`mesh_cp.integrations.megatron.training`. Import this module as ``examples.megatron.cpu_workarounds``
(with the repository root on ``sys.path``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import megatron.core.utils as megatron_utils
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch import Tensor

from mesh_cp.core.split import thd_partitioned_indices


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


@contextlib.contextmanager
def cpu_thd_partition() -> Iterator[None]:
    """CPU workaround: inside, megatron-core's THD partition (:func:`~mesh_cp.integrations.megatron.compat.
    thd_batch_on_this_cp_rank` calls it in every supported version) partitions THD batches with
    :func:`mesh_cp.core.split.thd_partitioned_indices` (TransformerEngine's ``thd_partition_indices_kernel``, on the
    host) instead of TransformerEngine, which is CUDA-only. On GPU install TransformerEngine and do not use it."""

    def indices(cu_seqlens_padded: Tensor, total: int, world: int, rank: int) -> Tensor:
        found = thd_partitioned_indices(cu_seqlens_padded.tolist(), int(total), world, rank)
        return torch.tensor(found, dtype=torch.int32, device=cu_seqlens_padded.device)

    saved = megatron_utils.tex, megatron_utils.is_te_min_version
    megatron_utils.tex = SimpleNamespace(thd_get_partitioned_indices=indices)
    megatron_utils.is_te_min_version = lambda version, check_equality=True: True
    try:
        yield
    finally:
        megatron_utils.tex, megatron_utils.is_te_min_version = saved
