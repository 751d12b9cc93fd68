"""FSDP2 beside CP: the parameters, gradients and optimizer states sharded over every DP x CP rank
(Note [FSDP2 beside CP]).

::

    # TrainingArguments (or accelerate launch with distributed_type: FSDP and fsdp_version: 2)
    args = TrainingArguments(..., fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = hf.mesh_cp_trainer_class()(model=model, args=args, train_dataset=ds, parallel=parallel)

    # a plain torch loop
    hf.attach(model, parallel.mesh)
    mesh = hf.fsdp_mesh(parallel)  # one 1-D mesh of every DP x CP rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
# With the Trainer, mesh_cp applies fully_shard itself when the trainer is built, from accelerate's FSDP settings
# (accelerate's own fsdp2_prepare_model: the layers its wrap policy names, then the embeddings, the tail and the
# root), over that mesh. accelerate's state is then FSDP2 with those settings (integrations/hf/compat.py,
# use_sharded_model), as accelerate makes it on GPUs: the Trainer prepares the model and optimizer through
# accelerate's FSDP2 path, which finds the model sharded and keeps it, and accumulation (no_sync), clipping and
# checkpoints (FULL_STATE_DICT gathered, SHARDED_STATE_DICT through torch.distributed.checkpoint) are FSDP2's. That
# is one path on GPUs and on the CPU, where accelerate 1.15 does not switch FSDP on (distributed_type stays
# MULTI_CPU) although torch's FSDP2 runs with gloo. Applied as accelerate applies them: fsdp_version (2 only),
# reshard_after_forward, the wrap policy and its transformer_cls_names_to_wrap, state_dict_type and the
# mixed-precision policy; the other settings are refused unless at their default (check_plugin).


FSDP_CONFIG_KEYS = ("version", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "reshard_after_forward",
                    "state_dict_type", "min_num_params", "cpu_offload", "activation_checkpointing",
                    "cpu_ram_efficient_loading", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt")  # fmt: skip
"""The ``TrainingArguments.fsdp_config`` keys (``fsdp_`` prefix stripped, as transformers strips it) that mesh_cp
applies, or refuses at a value other than the default (:func:`check_plugin`, :func:`check_launch`); any other key is
refused by name (FSDP1's, XLA's, a misspelled one)."""


def check_launch(args: Any) -> None:
    """Refuse, before the Trainer is built and by name, what accelerate or transformers would refuse later with
    another fix, or ignore: an FSDP version other than 2, an ``fsdp_config`` key not in :data:`FSDP_CONFIG_KEYS`,
    FSDP on CPU processes without ``use_cpu``, and an accelerate ``parallelism_config`` block with ``cp_size > 1``
    that reaches accelerate (``TrainingArguments(parallelism_config=hf.accelerator_parallelism_config())``)."""
    cp = os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1")
    block = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    if block and cp.isdigit() and int(cp) > 1 and getattr(args, "parallelism_config", None) is None:
        raise ValueError(
            f"the accelerate config's parallelism_config block has cp_size {cp}, which accelerate would take as its own "
            f"context parallelism: pass TrainingArguments(parallelism_config=hf.accelerator_parallelism_config()) "
            f"and build the layout with hf.parallel_from_accelerate(tile=...)"
        )
    if args is None or not getattr(args, "fsdp", None):
        return
    config = args.fsdp_config or {}
    if int(config.get("version", 2)) != 2:
        raise NotImplementedError(
            f"fsdp_config version={config['version']}: mesh_cp shards with FSDP2 (torch's fully_shard) only; set it to 2"
        )
    unknown = sorted(set(config) - set(FSDP_CONFIG_KEYS))
    on = [key for key in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt") if config.get(key)]
    if unknown or on:
        raise ValueError(
            f"fsdp_config keys {unknown + on} are not FSDP2 settings mesh_cp applies (an FSDP1 or XLA setting, or a "
            f"misspelling); the keys it reads: {', '.join(FSDP_CONFIG_KEYS[:6])}"
        )
    if dist.is_initialized() and dist.get_world_size() > 1 and args.parallel_mode.value != "distributed":
        raise ValueError(
            f"TrainingArguments(fsdp=...) on {dist.get_world_size()} processes that accelerate takes for one: on CPU set "
            f"TrainingArguments(use_cpu=True) (--use_cpu; ACCELERATE_USE_CPU=true under accelerate launch)"
        )


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
    state, config = accelerator.state, accelerator.parallelism_config
    if config is not None and config.total_size > 1:
        sizes = ", ".join(
            f"{n}={getattr(config, n)}" for n in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
        )
        raise ValueError(
            f"the Accelerator has parallelism sizes {sizes}: give it hf.accelerator_parallelism_config() (every size 1) "
            f"so that FSDP2 shards over every DP x CP rank of mesh_cp's layout (Note [FSDP2 beside CP])"
        )
    state.fsdp_plugin = plugin  # what fsdp2_prepare_model, and the Trainer's checkpoints, read
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
