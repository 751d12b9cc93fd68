"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) of a mesh_cp model and its optimizer.

::

    from mesh_cp.integrations.megatron import checkpoint

    checkpoint.save(directory, model, optimizer, common={"step": step})   # every rank, collectively
    common = checkpoint.load(directory, model, optimizer)                  # in any TP x CP(a x b) x DP layout

The files are Megatron's ``torch_dist`` format (what Megatron-LM's ``--ckpt-format torch_dist`` writes and its
converters read): the model's ``sharded_state_dict()`` and the optimizer state sharded like the parameters it
belongs to. Nothing in them depends on CP, the tile or ``heads`` (attention has no parameters, and Megatron gives
CP and DP ranks replica ids of one parameter), and TP shards are global slices, so a checkpoint loads into any
layout of the same model.

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

Megatron's ``DistributedOptimizer``/``FP32Optimizer`` assert CUDA, so on the CPU the optimizer is a torch one (the
example's AdamW). :func:`optimizer_sharded_state_dict` shards its state the way Megatron's own optimizers do
(``dist_checkpointing.optimizer.optim_state_to_sharding_state``: ``optimizer.state.<key>`` tensors sharded like
their parameter); its per-parameter ``step`` counters, equal for every parameter, are kept as one common value. A
Megatron optimizer (it has ``sharded_state_dict``) is saved by its own method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

_STEP = "step"


class CpuTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy without its CUDA calls (Note [Distributed checkpoints on CPU])."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

    def _get_save_and_finalize_callbacks(self, writer: FileSystemWriterAsync, save_state_dict_ret: tuple) -> Any:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW its state (zeros, step 0) if it has none yet, so that a fresh
    optimizer has the tensors a checkpoint is loaded into."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"a torch optimizer is checkpointed here only for Adam and AdamW, got {type(optimizer).__name__}; "
            "use Megatron's optimizer (get_megatron_optimizer), which shards its own state"
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError("amsgrad=True keeps max_exp_avg_sq; it is not checkpointed here, use amsgrad=False")
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, model_sharded: ShardedStateDict, *, loading: bool = False
) -> ShardedStateDict:
    """The optimizer's state as a sharded state dict (Note [Distributed checkpoints on CPU]); ``loading``: the
    template a checkpoint is loaded into."""
    if hasattr(optimizer, "sharded_state_dict"):  # Megatron's optimizers
        return optimizer.sharded_state_dict(model_sharded, is_loading=loading)
    init_optimizer_state(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = {id(p) for p in params} - {id(p) for p in model.parameters()}
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameter(s) are not parameters of the model being saved")
    state = optimizer.state_dict()
    steps = {float(s[_STEP]) for s in state["state"].values()}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's parameters are at different steps {sorted(steps)}; one step is kept")
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_sharded, iter(params)), (_STEP,))
    state[_STEP] = steps.pop() if steps else 0.0
    return state


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, loading: bool) -> ShardedStateDict:
    model_sharded = model.sharded_state_dict()
    state = {"model": model_sharded}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(optimizer, model, model_sharded, loading=loading)
    return state


def _on_cpu(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def save(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    common: dict[str, Any] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) into the empty or new folder ``directory``, with ``common`` (plain values
    every rank agrees on: step, data position, RNG states) under ``"common"``. Called by every rank."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded(model, optimizer, loading=False)
    state["common"] = dict(common or {})
    strategy = CpuTorchDistSaveStrategy() if _on_cpu(model) else None
    dist_checkpointing.save(state, str(directory), sharded_strategy=strategy)


def load(
    directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (in any layout of the same model) into ``model`` and
    ``optimizer``; returns its ``common`` dict. Called by every rank."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointingException(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    state = dist_checkpointing.load(_sharded(model, optimizer, loading=True), str(directory))
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optim = state["optimizer"]
        if hasattr(optimizer, "sharded_state_dict"):
            optimizer.load_state_dict(optim)
        else:
            step = optim.pop(_STEP)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index in range(len(params)):
                optim["state"][index][_STEP] = torch.tensor(step, dtype=torch.float32)
            optimizer.load_state_dict(optim)
    return state.get("common", {})
