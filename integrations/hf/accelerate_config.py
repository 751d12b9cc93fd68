"""The DP x CP layout from accelerate's ``parallelism_config`` block (Note [accelerate's parallelism_config]).

::

    # accelerate config file (accelerate launch --config_file ...)
    parallelism_config:
      parallelism_config_dp_replicate_size: 2
      parallelism_config_cp_size: 4

    accelerator = Accelerator(parallelism_config=hf.accelerator_parallelism_config())
    parallel = hf.parallel_from_accelerate(tile="2x2")      # DP(2) x CP(2x2)
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from mesh_cp.core import most_square_tile
from mesh_cp.core.head_parallel import check_head_parallel
from mesh_cp.core.options import refuse_renamed
from mesh_cp.integrations.versions import require
from mesh_cp.runtime.parallel import DataContextParallel

# Note [accelerate's parallelism_config]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `accelerate launch` with a config file whose `parallelism_config` block is not empty gives every process
# ACCELERATE_USE_PARALLELISM_CONFIG=true and PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,TP,CP,SP}_SIZE from the
# block's parallelism_config_* keys (accelerate 1.15, utils/launch.py), whatever its distributed_type. Accelerator()
# -- and the Accelerator transformers' Trainer builds when TrainingArguments has no parallelism_config -- then reads
# them into a ParallelismConfig, where cp_size > 1 is accelerate's own context parallelism (torch's
# context_parallel, with FSDP2 sharding the model over dp_shard x cp):
#
#   - without FSDP it raises: on GPUs "cp_size > 1 specified in the parallelism_config, but no fsdp_plugin was
#     provided"; on the CPU (MULTI_CPU) it builds a device mesh, then raises "ParallelismConfig is only
#     compatible DistributedType.FSDP (version 2) or ...";
#   - with FSDP2 it shards the parameters, and inside accelerator.maybe_context_parallel (which the Trainer enters
#     every step, refusing any attention but SDPA) it shards the sequence: a second sharding over mesh_cp's.
#   - it refuses dp_replicate_size > 1 beside cp_size > 1 unless dp_shard_size > 1 too.
#
# So mesh_cp takes the block and accelerate gets none of it: parallel_from_accelerate() reads the variables, and
# the Accelerator is given accelerator_parallelism_config() (every size 1), with which it runs no parallelism of its
# own; it still joins the processes in one group and does mixed precision. The DP degree is dp_replicate_size x
# dp_shard_size. Without FSDP mesh_cp's DP replicates the model (dp_shard_size counts as replicas); with FSDP2
# (distributed_type: FSDP, fsdp_version: 2) MeshCPTrainer shards it over every dp_shard x cp rank itself (Note
# [FSDP2 beside CP] in mesh_cp.integrations.hf.fsdp), and dp_replicate_size > 1 beside it (HSDP) is refused.

_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
_BLOCK = "the config file's parallelism_config block"


def accelerator_parallelism_config():
    """The ``accelerate.ParallelismConfig`` to give the ``Accelerator`` (``Accelerator(parallelism_config=...)``,
    or ``TrainingArguments(parallelism_config=...)`` for the Trainer) when mesh_cp takes the config file's
    ``parallelism_config`` block: every size 1, so accelerate neither refuses the block's ``cp_size`` nor shards the
    sequence itself (Note [accelerate's parallelism_config])."""
    require("accelerate")
    from accelerate import ParallelismConfig

    return ParallelismConfig(**dict.fromkeys(_SIZES, 1), cp_backend="torch", sp_backend="deepspeed")


def parallel_from_accelerate(
    parallelism_config: Any = None,
    *,
    tile: tuple[int, int] | str | None = None,
    head_parallel: int = 1,
    group: dist.ProcessGroup | None = None,
    **mesh_options: Any,
) -> DataContextParallel:
    """The :class:`DataContextParallel` layout of accelerate's parallelism sizes, over ``group`` (default: the world).

    ``parallelism_config``: an ``accelerate.ParallelismConfig``, or ``None`` for the config file's
    ``parallelism_config`` block, which ``accelerate launch`` hands every process as ``PARALLELISM_CONFIG_*``
    environment variables. ``cp_size`` is the CP size (consecutive ranks), ``dp_replicate_size x dp_shard_size`` the
    DP degree, and ``cp_size x DP`` must be the group's size; ``tp_size`` and ``sp_size`` must be 1. With FSDP (version
    2 only) the model is sharded over every DP x CP rank, and ``dp_replicate_size`` (HSDP) is refused.
    ``tile`` (default the most square tiling of ``cp_size / head_parallel`` ranks, unless ``mesh=`` is given),
    ``head_parallel`` (the head-parallel degree of the hybrid) and ``mesh_options`` (``timeout``, ``debug``,
    ``mesh``) go to :meth:`DataContextParallel.create`; the former keyword ``heads`` is refused, naming
    ``head_parallel``. Create the ``Accelerator`` first, with
    :func:`accelerator_parallelism_config` (Note [accelerate's parallelism_config]).
    """
    refuse_renamed(mesh_options, where="parallel_from_accelerate")
    sizes, key, source = _sizes(parallelism_config)
    _check_accelerator()
    for name, what in (("tp_size", "tensor parallelism"), ("sp_size", "DeepSpeed's sequence parallelism (Ulysses)")):
        if sizes[name] != 1:
            raise ValueError(
                f"{source}: {key(name)} {sizes[name]} asks for {what}, which mesh_cp's DP x CP layout does not combine "
                f"with; set {key(name)}: 1 (the head-parallel x mesh hybrid, head_parallel=, splits heads inside the "
                f"CP group)"
            )
    cp, dp = sizes["cp_size"], sizes["dp_replicate_size"] * sizes["dp_shard_size"]
    if sizes["dp_replicate_size"] > 1 and _fsdp_on():
        raise ValueError(
            f"{source}: {key('dp_replicate_size')} {sizes['dp_replicate_size']} with FSDP asks for HSDP (parameters "
            f"replicated over the replicas), which mesh_cp does not build; FSDP2 shards over every DP x CP rank: put "
            f"the DP degree in {key('dp_shard_size')}"
        )
    if cp < 2:
        raise ValueError(
            f"{source}: {key('cp_size')} {cp} asks for no context parallelism; set it to the ranks of each CP group"
        )
    if group is None:
        if not dist.is_initialized():
            raise ValueError(
                "no default process group: create the Accelerator first (Accelerator(parallelism_config="
                "hf.accelerator_parallelism_config())), or call torch.distributed.init_process_group(...)"
            )
        group = dist.group.WORLD
    world = dist.get_world_size(group)
    if cp * dp != world:
        dp_keys = f"{key('dp_replicate_size')} x {key('dp_shard_size')}"
        fix = f"make {dp_keys} {world // cp}" if world % cp == 0 else f"make {key('cp_size')} divide {world}"
        raise ValueError(
            f"{source}: {key('cp_size')} {cp} x {key('dp_replicate_size')} {sizes['dp_replicate_size']} x "
            f"{key('dp_shard_size')} {sizes['dp_shard_size']} = {cp * dp} ranks, but the process group has {world}; "
            f"{fix}"
        )
    if tile is None and mesh_options.get("mesh") is None:
        tile = most_square_tile(cp // check_head_parallel(cp, head_parallel))
    return DataContextParallel.create(group, cp_size=cp, tile=tile, head_parallel=head_parallel, **mesh_options)


def _sizes(parallelism_config: Any):
    """The sizes of ``parallelism_config`` (``None``: the environment ``accelerate launch`` set), how to name one
    of them, and where they came from."""
    if parallelism_config is not None:
        missing = [name for name in _SIZES if not isinstance(getattr(parallelism_config, name, None), int)]
        if missing:
            raise ValueError(
                f"parallelism_config must be an accelerate.ParallelismConfig, got {type(parallelism_config).__name__} "
                f"(without integer {', '.join(missing)})"
            )
        return {name: getattr(parallelism_config, name) for name in _SIZES}, str, "ParallelismConfig"
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        raise ValueError(
            "no parallelism_config block reached this process: accelerate launch hands the config file's "
            "parallelism_config block (parallelism_config_cp_size: N, parallelism_config_dp_replicate_size: M) to "
            "every process; add the block, or pass an accelerate.ParallelismConfig"
        )
    sizes = {}
    for name in _SIZES:
        variable = f"PARALLELISM_CONFIG_{name.upper()}"
        value = os.environ.get(variable, "1")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{variable}={value!r} (parallelism_config_{name}) must be a positive integer")
        sizes[name] = int(value)
    return sizes, lambda name: f"parallelism_config_{name}", _BLOCK


def _fsdp_on() -> bool:
    """Whether accelerate was launched with FSDP (its launcher's variable, or a created Accelerator's state)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    state = AcceleratorState._shared_state
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or state.get("distributed_type") == (
        DistributedType.FSDP
    )


def _check_accelerator() -> None:
    """Refuse an ``Accelerator`` that runs FSDP1 or its own context parallelism (Note [accelerate's
    parallelism_config]); FSDP2 is sharded by mesh_cp over every DP x CP rank (Note [FSDP2 beside CP] in
    :mod:`mesh_cp.integrations.hf.fsdp`). None created yet is fine (only ``accelerate launch``'s FSDP variables are
    checked)."""
    require("accelerate")
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state  # empty until an Accelerator is created
    plugin = state.get("fsdp_plugin")
    version = plugin.fsdp_version if plugin is not None else int(os.environ.get("FSDP_VERSION", "1"))
    if _fsdp_on() and version != 2:
        raise ValueError(
            f"accelerate runs FSDP version {version} here (distributed_type: FSDP); mesh_cp shards with FSDP2 over "
            f"every DP x CP rank: set fsdp_version: 2 in the config file's fsdp_config"
        )
    config = state.get("parallelism_config")
    if config is not None and config.cp_enabled:
        raise ValueError(
            f"the Accelerator runs accelerate's own context parallelism (cp_size {config.cp_size}), which would shard "
            f"the sequence a second time; create it with Accelerator(parallelism_config="
            f"hf.accelerator_parallelism_config())"
        )
