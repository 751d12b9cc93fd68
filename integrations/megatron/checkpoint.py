"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) of a mesh_cp model and its optimizer.

::

    from mesh_cp.integrations.megatron import checkpoint

    checkpoint.save(directory, model, optimizer, common={"step": step})   # every rank, collectively
    common = checkpoint.load(directory, model, optimizer)                  # in any TP x CP(a x b) x DP layout

    checkpoint.save(directory, model, optimizer, common=..., async_save=True)  # written in the background
    checkpoint.finalize_async_saves(blocking=False)                             # every step, every rank

``model`` may be wrapped in Megatron's ``DistributedDataParallel`` (and ``Float16Module``); it is unwrapped
(:func:`unwrap`) before its ``sharded_state_dict()`` is taken, so the keys are Megatron-LM's, without ``module.``,
and wrapped and unwrapped models load each other's checkpoints.

The files are Megatron's ``torch_dist`` format (what Megatron-LM's ``--ckpt-format torch_dist`` writes and its
converters read): the model's ``sharded_state_dict()`` and the optimizer state sharded like the parameters it
belongs to. Nothing in them depends on CP, the tile or ``heads`` (attention has no parameters, and Megatron gives
CP and DP ranks replica ids of one parameter), and TP shards are global slices, so a checkpoint loads into any
layout of the same model.

Note [Distributed checkpoints on CPU] in :mod:`mesh_cp.integrations.megatron.checkpoint_cpu` says what runs on
CPU parameters.

Note [Fully parallel save and load]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron marks replicas of a tensor with ``replica_id`` and its plain strategies write replica 0 only, so with DP
(and CP) replicas one rank of each TP/PP position writes everything. :func:`save` wraps the strategy in
``FullyParallelSaveStrategyWrapper`` over :func:`parallelization_group` (DP x CP, as Megatron-LM's
``--ckpt-fully-parallel-save``), which spreads the replica-0 role of every shard over that group; :func:`load`
wraps it in ``FullyParallelLoadStrategyWrapper``: each rank reads a share and the group exchanges them. On CPU
parameters the load wrapper is :class:`CpuFullyParallelLoadStrategy` (the ``"gather_object"`` exchange, no
``torch.cuda.synchronize()`` on a torch without CUDA); the save wrapper needs no change.

Note [Per-rank state]
~~~~~~~~~~~~~~~~~~~~~
``common`` is written by rank 0 only, so per-rank values there come back as rank 0's. Every rank's RNG states
(:func:`get_rng_state`: Python, NumPy, torch CPU, CUDA, Megatron's tensor-parallel tracker) are saved as its own
``ShardedObject("rng_state", state, grid shape, rank position, replica_id=0)`` over the PP x TP x CP x DP grid
(:func:`rank_grid`; Megatron-LM keys its ``rng_state`` by (PP, TP) only, but CP and DP ranks draw differently too)
and restored per rank by :func:`load` when the grid is the same; the grid's shape is kept in common
(``rng_state_grid``). In another grid no rank has a saved state of its own; they are left as they are (logged).

Note [Asynchronous save]
~~~~~~~~~~~~~~~~~~~~~~~~
``save(..., async_save=True)`` plans the save and hands Megatron's ``AsyncRequest`` (``async_sharded_save=True``)
to an ``AsyncCallsQueue``: a forked process writes the files from a copy of the state taken before :func:`save`
returns; :func:`finalize_async_saves`, called by every rank, runs the finalization (write results gathered,
``.metadata`` and ``metadata.json`` written, failures raised on every rank). Megatron's ``TemporalAsyncCaller`` and
queue call CUDA (``torch.cuda.synchronize()`` and flags on ``torch.cuda.current_device()``); for CPU parameters
``CpuAsyncCaller`` and ``CpuAsyncCallsQueue`` (:mod:`mesh_cp.integrations.megatron.checkpoint_cpu`) are the same with those on the CPU.

Megatron's ``DistributedOptimizer``/``FP32Optimizer`` assert CUDA, so on the CPU the optimizer is a torch one (the
example's AdamW). :func:`optimizer_sharded_state_dict` shards its state the way Megatron's own optimizers do
(``dist_checkpointing.optimizer.optim_state_to_sharding_state``: ``optimizer.state.<key>`` tensors sharded like
their parameter); its per-parameter ``step`` counters, equal for every parameter, are kept as one common value. A
Megatron optimizer (it has ``sharded_state_dict``) is saved by its own method.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from mesh_cp.integrations.megatron.checkpoint_cpu import (
    CpuAsyncCallsQueue,
    CpuFullyParallelLoadStrategy,
    CpuTorchDistSaveStrategy,
)
from mesh_cp.integrations.megatron.compat import async_save_options
from mesh_cp.integrations.megatron.rng_state import get_rng_state, rank_grid, set_rng_state

_STEP = "step"
_RNG_KEY = "rng_state"
_RNG_GRID = "rng_state_grid"
_log = logging.getLogger(__name__)


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without Megatron's wrappers (``DistributedDataParallel``, its FSDPs, ``Float16Module``): the module
    whose ``sharded_state_dict()`` has Megatron-LM's keys (``decoder.layers.0...``), as Megatron-LM's
    ``unwrap_model`` gives it. A model without wrappers is returned as it is."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, loading: bool) -> ShardedStateDict:
    model_sharded = model.sharded_state_dict()
    state = {"model": model_sharded}
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(optimizer, model, model_sharded, loading=loading)
    return state


def _on_cpu(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def _rng_object(state: Any, shape: tuple[int, ...], position: tuple[int, ...]):
    return ShardedObject(_RNG_KEY, state, shape, position, replica_id=0)  # every rank saves its own


# ----------------------------------------------------------------------------------------------------------------
# Fully parallel save and load (Note [Fully parallel save and load])


def parallelization_group() -> dist.ProcessGroup:
    """The ranks that share the writing and reading of one model replica: Megatron's data-parallel group with the
    context-parallel ranks (they hold replicas of every parameter too), as Megatron-LM's ``--ckpt-fully-parallel-save``
    uses; the whole world when parallel_state is not initialized."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dist.group.WORLD
    return ps.get_data_parallel_group(with_context_parallel=True)


def _save_strategy(on_cpu: bool, fully_parallel: bool):
    base = CpuTorchDistSaveStrategy() if on_cpu else get_default_save_sharded_strategy()
    group = parallelization_group()
    if not fully_parallel or dist.get_world_size(group) == 1:
        return base
    return FullyParallelSaveStrategyWrapper(base, group)


def _load_strategy(directory: Path, on_cpu: bool, fully_parallel: bool):
    base = get_default_load_sharded_strategy(str(directory))
    group = parallelization_group()
    if not fully_parallel or dist.get_world_size(group) == 1:
        return base
    if on_cpu:
        return CpuFullyParallelLoadStrategy(base, group)
    return FullyParallelLoadStrategyWrapper(base, group)


# ----------------------------------------------------------------------------------------------------------------
# Asynchronous save (Note [Asynchronous save])

_ASYNC_QUEUES: dict[str, Any] = {}


def _async_queue(on_cpu: bool) -> AsyncCallsQueue:
    kind = "cpu" if on_cpu else "cuda"
    if kind not in _ASYNC_QUEUES:
        _ASYNC_QUEUES[kind] = CpuAsyncCallsQueue() if on_cpu else AsyncCallsQueue()
    return _ASYNC_QUEUES[kind]


def finalize_async_saves(blocking: bool = True) -> list[int]:
    """Finish the asynchronous saves (``save(..., async_save=True)``) that are written: gather every rank's write
    results, write the checkpoint's metadata (only then is it a checkpoint :func:`load` accepts) and raise on every
    rank if a rank failed to write. ``blocking``: wait for every pending save; otherwise finish only those every
    rank has written. Returns the indices :func:`save` returned of the saves finished. Called by every rank."""
    finalized: list[int] = []
    for kind in sorted(_ASYNC_QUEUES):
        finalized += _ASYNC_QUEUES[kind].maybe_finalize_async_calls(blocking=blocking)
    return finalized


def pending_async_saves() -> int:
    """How many asynchronous saves are not finalized yet."""
    return sum(q.get_num_unfinalized_calls() for q in _ASYNC_QUEUES.values())


# ----------------------------------------------------------------------------------------------------------------


def save(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    common: dict[str, Any] | None = None,
    *,
    rng: bool = True,
    fully_parallel: bool = True,
    async_save: bool = False,
) -> int | None:
    """Save ``model`` (and ``optimizer``) into the empty or new folder ``directory``, with ``common`` (plain values
    every rank agrees on: step, data position, arguments) under ``"common"``. Called by every rank.

    ``model`` may be wrapped in Megatron's ``DistributedDataParallel`` / ``Float16Module``: the keys are those of
    the module inside (Megatron-LM's). ``rng``: every rank's RNG states (:func:`get_rng_state`) are saved as its
    own sharded object (Note [Per-rank state]). ``fully_parallel``: the ranks of :func:`parallelization_group`
    share the writing (Megatron's ``FullyParallelSaveStrategyWrapper``) instead of DP rank 0 writing everything.
    ``async_save``: the files are written by a background process; returns the save's index, and the checkpoint
    exists once :func:`finalize_async_saves` has returned it (Note [Asynchronous save]). The state is taken
    before this returns, so training may go on at once."""
    directory = Path(directory)
    with _params_gathered(model):
        return _save(directory, unwrap(model), optimizer, common, rng, fully_parallel, async_save)


@contextlib.contextmanager
def _params_gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every parameter current on every rank while saving. With Megatron's distributed optimizer and
    ``overlap_param_gather``, ``optimizer.step()`` updates each rank's shard only, and the wrapper's forward pre-hooks
    gather the rest at the next forward; as Megatron-LM saves, the hooks are taken off with a synchronous gather
    (``disable_forward_pre_hook(param_sync=True)``) and put back after."""
    wrappers = []
    module = model
    while module is not None:
        if getattr(module, "use_forward_hook", False):
            wrappers.append(module)
        module = getattr(module, "module", None)
    for wrapper in wrappers:
        wrapper.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.enable_forward_pre_hook()


def _save(directory: Path, model, optimizer, common, rng: bool, fully_parallel: bool, async_save: bool) -> int | None:
    """:func:`save` of the unwrapped ``model`` with its parameters current."""
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded(model, optimizer, loading=False)
    state["common"] = dict(common or {})
    if rng:
        shape, position = rank_grid()
        state[_RNG_GRID] = list(shape)
        state[_RNG_KEY] = _rng_object(get_rng_state(), shape, position)
    on_cpu = _on_cpu(model)
    strategy = _save_strategy(on_cpu, fully_parallel)
    if not async_save:
        dist_checkpointing.save(state, str(directory), sharded_strategy=strategy)
        return None
    options = async_save_options()  # megatron-core's own AsyncRequest in every version (compat)
    request = dist_checkpointing.save(
        state, str(directory), sharded_strategy=strategy, async_sharded_save=True, **options
    )
    return _async_queue(on_cpu).schedule_async_request(request)


def load(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
    fully_parallel: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (in any layout of the same model, wrapped in Megatron's DDP or
    not) into ``model`` and ``optimizer``; returns its ``common`` dict. Called by every rank.

    ``rng``: every rank's RNG states are restored from its own sharded object when the checkpoint was saved in the
    same PP x TP x CP x DP grid; in another grid there is no state of this rank to restore, and they are left as
    they are (logged). ``fully_parallel``: the ranks of :func:`parallelization_group` share the reading and
    exchange what they read (Megatron's ``FullyParallelLoadStrategyWrapper``). Loading the model alone while a
    Megatron mixed-precision or distributed optimizer exists (fine-tuning with a fresh optimizer): call its
    ``reload_model_params()`` afterwards, as Megatron-LM does, or its fp32 copies made at construction overwrite the
    loaded weights at the first step."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointingException(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    directory = Path(directory)
    model = unwrap(model)
    template = _sharded(model, optimizer, loading=True)
    restore_rng = False
    if rng:
        shape, position = rank_grid()
        saved_grid = dist_checkpointing.load_common_state_dict(str(directory)).get(_RNG_GRID)
        restore_rng = saved_grid is not None and tuple(saved_grid) == shape
        if restore_rng:
            template[_RNG_KEY] = _rng_object(None, shape, position)
        elif dist.get_rank() == 0:
            why = "it has none" if saved_grid is None else f"it was saved in grid {tuple(saved_grid)}"
            _log.warning(
                "%s: RNG states not restored: %s, this run's PP x TP x CP x DP grid is %s",
                directory,
                why,
                shape,
            )
    strategy = _load_strategy(directory, _on_cpu(model), fully_parallel)
    state = dist_checkpointing.load(template, str(directory), sharded_strategy=strategy)
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
    if restore_rng:
        set_rng_state(state[_RNG_KEY])
    return state.get("common", {})
