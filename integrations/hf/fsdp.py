"""FSDP2 beside CP: the parameters, gradients and optimizer states sharded over every DP x CP rank
(Note [FSDP2 beside CP]).

::

    # TrainingArguments (or accelerate launch with distributed_type: FSDP and fsdp_version: 2)
    args = TrainingArguments(..., fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = hf.mesh_cp_trainer_class()(model=model, args=args, train_dataset=ds, parallel=parallel)

    # a plain torch loop
    hf.attach(model, parallel.mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=hf.fsdp_mesh(parallel))
    fully_shard(model, mesh=hf.fsdp_mesh(parallel))
    hf.check_sharded(model, parallel)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from mesh_cp.integrations.hf.compat import use_sharded_model
from mesh_cp.runtime.parallel import DataContextParallel

# Note [FSDP2 beside CP]
# ~~~~~~~~~~~~~~~~~~~~~~
# Every rank of a CP group holds the same parameters and computes the gradient of its share of the loss, so the
# CP ranks are data-parallel ranks as far as the parameters are concerned: FSDP2 (torch's fully_shard) shards them,
# their gradients and the optimizer states over the flattened dp_shard x cp ranks, one 1-D mesh of every rank of
# the layout (fsdp_mesh), as torchtitan, TRL's long-context recipe and accelerate's own CP do. Each rank then holds
# 1 / (dp x cp) of them. Its reduce-scatter averages a gradient over the mesh; the loss of a rank is its tokens' sum
# over the label count of all ranks times the world size (Trainer's average_tokens_across_devices), so the average
# is the gradient of the global token mean, exactly as DDP's average over the same ranks.
#
# A 2-D mesh (dp_shard, cp) given to fully_shard is HSDP: parameters sharded over one dimension and *replicated*
# over the other, each rank holding 1/dp or 1/cp, not 1/(dp x cp), with the gradient all-reduced over the other
# dimension. Its gradients are still right, so the mistake is silent; check_sharded refuses it by name, as it
# refuses a mesh over the CP group or a DP group alone (whose average would leave out the other ranks' shares).
#
# With the Trainer, mesh_cp applies fully_shard itself, from accelerate's FSDP settings (accelerate's own
# fsdp2_prepare_model: the layers its wrap policy names, then the embeddings, the tail and the root), before the
# Trainer prepares the model; accelerate then neither wraps it in DDP nor shards it again (integrations/hf/compat.py,
# use_sharded_model). That is one path on GPUs and on the CPU, where accelerate 1.15 does not switch FSDP on
# (distributed_type stays MULTI_CPU) although torch's FSDP2 runs with gloo. Checkpoints go through accelerate's
# FSDP2 save and load (torch.distributed.checkpoint for SHARDED_STATE_DICT, the default here).

SUPPORTED_FIELDS = ("fsdp_version", "reshard_after_forward", "auto_wrap_policy", "transformer_cls_names_to_wrap",
                    "state_dict_type", "mixed_precision_policy")  # fmt: skip
"""The FSDP settings mesh_cp applies (with accelerate's meaning); the others must keep their default
(:func:`check_plugin`)."""


def fsdp_mesh(parallel: DataContextParallel, *, name: str = "dp_cp"):
    """The 1-D ``DeviceMesh`` of every DP x CP rank of ``parallel`` (its group), dimension ``name``: the one mesh
    to give ``fully_shard`` (Note [FSDP2 beside CP])."""
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dist.get_backend(parallel.group) == "nccl" else "cpu"
    return DeviceMesh.from_group(parallel.group, device, mesh_dim_names=(name,))


def check_sharded(model: torch.nn.Module, parallel: DataContextParallel) -> int:
    """Refuse, by name, a model whose FSDP2 parameters are not sharded over one 1-D mesh of every rank of
    ``parallel`` (a 2-D mesh is HSDP: Note [FSDP2 beside CP]); returns the number of sharded parameters."""
    from torch.distributed.tensor import DTensor, Shard

    ranks = sorted(dist.get_process_group_ranks(parallel.group))
    count = 0
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            if p.requires_grad:
                raise ValueError(
                    f"parameter {name} is not sharded by FSDP2 (a {type(p).__name__}): its gradient would be neither "
                    f"reduced nor averaged; apply fully_shard to the module that holds it (or to the whole model)"
                )
            continue
        mesh = p.device_mesh
        got = sorted(mesh.mesh.flatten().tolist())
        if mesh.ndim != 1 or any(not isinstance(pl, Shard) for pl in p.placements):
            raise ValueError(
                f"parameter {name} is sharded over a {mesh.ndim}-D mesh {tuple(mesh.mesh.shape)} with placements "
                f"{p.placements}: that is HSDP, which replicates it over a dimension, so each rank holds more than "
                f"1/{len(ranks)} of it; pass fully_shard the 1-D mesh of every DP x CP rank, hf.fsdp_mesh(parallel)"
            )
        if got != ranks:
            raise ValueError(
                f"parameter {name} is sharded over ranks {got}, but mesh_cp's DP x CP layout spans {ranks}: its "
                f"gradient would be averaged over part of the ranks that hold shares of the loss; pass fully_shard "
                f"hf.fsdp_mesh(parallel)"
            )
        count += 1
    if not count:
        raise ValueError(
            "the model has no FSDP2-sharded parameter; apply fully_shard to it (mesh=hf.fsdp_mesh(parallel))"
        )
    return count


def fsdp_plugin(args: Any, accelerator: Any):
    """The FSDP settings of a Trainer run, or None without FSDP: accelerate's plugin where it switched FSDP on (on
    GPUs), else the one ``TrainingArguments(fsdp=..., fsdp_config=...)`` or ``accelerate launch``'s FSDP settings
    describe (accelerate leaves FSDP off on the CPU); refused by name where mesh_cp does not apply it as accelerate
    would (:func:`check_plugin`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None and getattr(args, "fsdp_plugin_args", None) is not None:
        plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    elif plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        plugin = FullyShardedDataParallelPlugin()  # reads accelerate launch's FSDP_* variables
    if plugin is None:
        return None
    if accelerator.mixed_precision != "no" and plugin.mixed_precision_policy is None:
        plugin.set_mixed_precision(accelerator.mixed_precision)
    check_plugin(plugin)
    return plugin


def check_plugin(plugin: Any) -> None:
    """Refuse, naming the field and the fix, FSDP settings that mesh_cp does not apply: FSDP1, CPU offload,
    FSDP's own activation checkpointing (use ``gradient_checkpointing``), size-based wrapping, ignored modules, and
    rank-0 loading."""
    if plugin.fsdp_version != 2:
        raise NotImplementedError(
            f"fsdp_version={plugin.fsdp_version}: mesh_cp shards with FSDP2 (torch's fully_shard) only; set "
            f"fsdp_config's version (or fsdp_version in accelerate's config) to 2"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    refused = {
        "cpu_offload": (isinstance(plugin.cpu_offload, CPUOffloadPolicy), "set it to false"),
        "activation_checkpointing": (
            plugin.activation_checkpointing,
            "use TrainingArguments(gradient_checkpointing=True)",
        ),
        "cpu_ram_efficient_loading": (plugin.cpu_ram_efficient_loading, "set it to false"),
        "ignored_modules": (plugin.ignored_modules is not None, "leave it unset"),
        "min_num_params": (bool(plugin.min_num_params), "wrap by transformer_layer_cls_to_wrap (the default policy)"),
    }
    for name, (given, fix) in refused.items():
        if given:
            raise NotImplementedError(f"FSDP {name}={getattr(plugin, name)!r} is not supported beside mesh_cp: {fix}")


def shard_model(model: torch.nn.Module, parallel: DataContextParallel, accelerator: Any, plugin: Any) -> None:
    """Shard ``model`` in place with FSDP2 over every rank of ``parallel`` as accelerate would from ``plugin``
    (``fsdp2_prepare_model``: its wrap policy's layers, the embeddings and tail, the root), then check it
    (:func:`check_sharded`)."""
    from accelerate.utils import fsdp2_prepare_model

    world = dist.get_world_size(parallel.group)
    if dist.get_world_size() != world:
        raise ValueError(
            f"FSDP2 shards over accelerate's default mesh of all {dist.get_world_size()} processes, but mesh_cp's DP x "
            f"CP layout spans {world}: build the layout over the launched world (dist.group.WORLD)"
        )
    accelerator.state.fsdp_plugin = plugin  # what fsdp2_prepare_model, and the Trainer's checkpoints, read
    state, config = accelerator.state, accelerator.parallelism_config
    if config is not None and (config.dp_replicate_enabled or config.total_size > 1):
        raise ValueError(
            f"the Accelerator has parallelism sizes {config._sizes}: give it hf.accelerator_parallelism_config() (every "
            f"size 1) so that FSDP2 shards over every DP x CP rank of mesh_cp's layout (Note [FSDP2 beside CP])"
        )
    before = state.device_mesh
    if config is not None:  # accelerate shards over its mesh's "dp_shard_cp" dimension: make that every rank
        state.device_mesh = fsdp_mesh(parallel, name="dp_shard_cp")
    try:
        fsdp2_prepare_model(accelerator, model)
    finally:
        state.device_mesh = before
    check_sharded(model, parallel)


def shard_for_trainer(trainer: Any, parallel: DataContextParallel) -> bool:
    """FSDP2 over every DP x CP rank (Note [FSDP2 beside CP] in :mod:`mesh_cp.integrations.hf.fsdp`), from the
    run's FSDP settings, or for a model the user sharded already (checked: a 2-D mesh is refused); returns whether
    the model is sharded."""
    from torch.distributed.fsdp import FSDPModule

    plugin = fsdp_plugin(trainer.args, trainer.accelerator)
    sharded = isinstance(trainer.model, FSDPModule)
    if plugin is None and not sharded:
        return False
    if trainer.is_deepspeed_enabled:
        raise ValueError("the model is sharded with FSDP2 and DeepSpeed is enabled too: use one of them")
    if plugin is None:  # the user's fully_shard: accelerate's FSDP2 checkpoints with their defaults
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    if sharded:
        check_sharded(trainer.model, parallel)
    else:
        shard_model(trainer.model, parallel, trainer.accelerator, plugin)
    use_sharded_model(trainer, plugin)
    return True
