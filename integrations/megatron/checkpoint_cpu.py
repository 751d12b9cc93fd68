"""Megatron's checkpoint strategies for parameters on the CPU: megatron-core's own, with the CUDA calls they make
on every path replaced by their CPU equivalents (its private use of megatron-core's strategies is in this module
only). :mod:`mesh_cp.integrations.megatron.checkpoint` uses them when the parameters are on the CPU.

Note [Distributed checkpoints on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
megatron-core 0.16.1's ``torch_dist`` save strategy (``TorchDistSaveShardedStrategy``) assumes CUDA in two places
of its save path, so ``dist_checkpointing.save`` dies on a CPU-only torch with gloo:

- ``FileSystemWriterAsync.preload_tensors`` is always handed ``non_blocking=True`` and then calls
  ``torch.cuda.synchronize()`` (needed only after pinned device-to-host copies);
- ``save_state_dict_async_finalize`` broadcasts its failure flag from ``torch.cuda.current_device()``.

:class:`CpuTorchDistSaveStrategy` is that strategy with those two callbacks replaced: a blocking preload (no CUDA
call) and the same finalize (gather the write results, the coordinator writes the metadata, every rank learns of
any failure) with the flag on the CPU, which gloo takes. Planning, the writer, the files and the metadata are
Megatron's own; loading needs no change. It is used only when the parameters are on the CPU; on GPUs Megatron's
default strategy runs as it is.

The load wrapper (Note [Fully parallel save and load] in :mod:`mesh_cp.integrations.megatron.checkpoint`) and the
asynchronous caller and queue (Note [Asynchronous save] there) are Megatron's with the same kind of change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    TemporalAsyncCaller,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from mesh_cp.integrations.megatron.compat import ASYNC_STRATEGY


class CpuTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy without its CUDA calls (Note [Distributed checkpoints on CPU])."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

    def _get_save_and_finalize_callbacks(
        self, writer: FileSystemWriterAsync, save_state_dict_ret: tuple, async_strategy: str = ASYNC_STRATEGY
    ) -> Any:
        # megatron-core 0.17 added async_strategy ("mcore": its own AsyncRequest, the only one built here).
        if async_strategy != ASYNC_STRATEGY:
            raise NotImplementedError(
                f"async_strategy {async_strategy!r} with parameters on the CPU: mesh_cp's CPU save runs megatron-core's "
                f"own asynchronous save; pass async_strategy={ASYNC_STRATEGY!r}"
            )
        save_fn, _, save_args = writer.get_save_function_and_args()
        storage_writer, global_metadata, dist_wrapper = save_state_dict_ret

        def preload() -> list:
            return FileSystemWriterAsync.preload_tensors(writer.write_buckets, non_blocking=False)

        def finalize() -> None:
            _finalize_on_cpu(storage_writer, global_metadata, dist_wrapper)

        return AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload if save_fn is not None else None)


def _finalize_on_cpu(storage_writer: FileSystemWriterAsync, global_metadata: Any, dist_wrapper: Any) -> None:
    """``save_state_dict_async_finalize`` with its failure flag broadcast from the CPU."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    all_results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
    failures = {}
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(all_results)
        if not failures:
            storage_writer.finish(global_metadata, all_results)
    failed = torch.tensor([int(bool(failures))], dtype=torch.int)
    dist.broadcast(failed, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if failed.item():
        raise CheckpointException("write", failures)


class CpuFullyParallelLoadStrategy(FullyParallelLoadStrategyWrapper):
    """Megatron's ``FullyParallelLoadStrategyWrapper`` for CPU parameters (Note [Fully parallel save and load]):
    the loaded shards are exchanged with ``all_gather_object`` (its ``"gather_object"`` algorithm, which keeps
    tensors on the CPU; ``"broadcast"`` and ``"gather_rounds"`` stage them on CUDA), and its two
    ``torch.cuda.synchronize()`` calls are skipped on a torch without CUDA, where they raise."""

    def __init__(self, strategy: Any, parallelization_group: dist.ProcessGroup) -> None:
        super().__init__(strategy, parallelization_group, exchange_algo="gather_object")

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, *args: Any) -> Any:
        # *args: the async_strategy that dist_checkpointing.load passes from megatron-core 0.17 on.
        if torch.cuda.is_available():
            return super().load(sharded_state_dict, checkpoint_dir, *args)
        with mock.patch.object(torch.cuda, "synchronize", _no_cuda_synchronize):
            return super().load(sharded_state_dict, checkpoint_dir, *args)


def _no_cuda_synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize`` on a torch without CUDA: there is no device work to wait for."""


class CpuAsyncCaller(TemporalAsyncCaller):
    """Megatron's ``TemporalAsyncCaller`` (a forked process writes the files) without its CUDA calls: no
    ``torch.cuda.synchronize()`` on a torch without CUDA, and the all-ranks-done flag reduced on the CPU."""

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if torch.cuda.is_available():
            return super().schedule_async_call(async_req)
        with mock.patch.object(torch.cuda, "synchronize", _no_cuda_synchronize):
            return super().schedule_async_call(async_req)

    def sync_all_async_calls(self, is_alive: int) -> bool:
        flag = torch.tensor([is_alive], dtype=torch.int)
        dist.all_reduce(flag)
        return bool(flag[0] == 0)


class CpuAsyncCallsQueue(AsyncCallsQueue):
    """Megatron's ``AsyncCallsQueue`` with :class:`CpuAsyncCaller` and its call-index check on the CPU."""

    def _get_async_caller(self) -> AsyncCaller:
        return CpuAsyncCaller()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        finalized = []
        while self.async_calls:
            if not self.async_calls[0].async_caller.is_current_async_call_done(blocking, no_dist):
                break
            call_idx, _, request = self.async_calls.popleft()
            for fn in request.finalize_fns:
                fn()
            index = torch.tensor([call_idx], dtype=torch.int)
            dist.all_reduce(index, op=dist.ReduceOp.MAX)
            if index.item() != call_idx:
                raise RuntimeError("asynchronous checkpoint saves finalized out of step: not every rank called")
            finalized.append(call_idx)
        return finalized
