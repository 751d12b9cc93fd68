"""``deepspeed.initialize`` with the DP x CP layout of a ``"mesh_attention"`` block: the layout, the
``mpu`` DeepSpeed averages gradients over, and what the engine trains with (sharding, the loss)."""

from __future__ import annotations

import copy
import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.config import MeshConfig
from mesh_cp.integrations import ds_attention_shape, parallel_from_config, switch_attention
from mesh_cp.integrations.deepspeed.config import (
    check_no_conflicts,
    check_training_data,
    check_training_options,
    load_config,
    replica_batch_size,
)
from mesh_cp.integrations.deepspeed.data import training_dataloader
from mesh_cp.integrations.layout import check_ds_engine
from mesh_cp.runtime.batch import ShardedBatch, causal_lm_loss, shard_batch
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.parallel import DataContextParallel

# Note [DeepSpeed gradient averaging]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed averages gradients over the data-parallel group of its mpu (the world without one).
# mesh_cp gives it all DP x CP ranks: measured on DeepSpeed 0.19.8, that group averages correctly at
# ZeRO 0-3, while an mpu exposing sequence-parallel methods makes ZeRO-3 average over a different
# group and a DP-only group gives ZeRO-3 wrong gradients. A CP rank's share of its replica's
# token-mean loss, s_r = (sum of its token losses) / (labels of the replica), sums to the replica's
# loss over the CP group; so the rank back-propagates cp_size * s_r, and DeepSpeed's mean over all
# dp * cp ranks, (1/dp) sum_replicas (1/cp) sum_cp cp * s_r, is the mean of the replicas' losses.


class DataContextParallelMPU:
    """The ``mpu`` DeepSpeed gets: data parallelism over all DP x CP ranks, no model parallelism.

    It deliberately exposes no ``get_sequence_parallel_*`` methods (see Note [DeepSpeed gradient
    averaging]); its model-parallel group is this rank alone. Constructing it is collective over
    ``parallel.group``: the singletons are subgroups of it (:func:`mesh_cp.runtime.groups.new_subgroups`, a split
    of that group when the default group is bound to a GPU, as DeepSpeed binds it on CUDA).
    """

    def __init__(self, parallel: DataContextParallel):
        self.parallel = parallel
        ranks = dist.get_process_group_ranks(parallel.group)
        self._alone = new_subgroups(parallel.group, [[r] for r in ranks])

    def get_data_parallel_group(self):
        return self.parallel.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.parallel.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.parallel.group)

    def get_model_parallel_group(self):
        return self._alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class MeshAttention:
    """The mesh an engine trains with (``engine.mesh_attention``): sharding and the loss to back-propagate."""

    config: MeshConfig
    parallel: DataContextParallel
    """The DP x CP groups and this replica's mesh."""

    @property
    def mesh(self) -> CPMesh:
        return self.parallel.mesh

    def shard(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        device: torch.device | str | None = None,
        documents=None,
    ) -> ShardedBatch:
        """This rank's shard of its replica's ``(batch, seq)`` batch (every rank of the CP group passes the
        same batch); labels are shifted on the full sequence, right padding is exact.

        ``device``: where the shard goes, the engine's (``engine.device``: DeepSpeed moved the model there);
        ``None`` keeps the input's device. The batch is cut where it is (the host, for a data loader's) and
        only this rank's shard is copied. Left padding and packed rows (``documents``, lengths per row) give the
        batch a ``mask``: pass it to the model as ``mesh_cp_mask=batch.mask`` (:func:`mesh_cp.shard_batch`)."""
        return shard_batch(
            input_ids, mesh=self.mesh, labels=labels, attention_mask=attention_mask, device=device, documents=documents
        )

    def loss(self, logits: Tensor, batch: ShardedBatch) -> Tensor:
        """The loss to pass to ``engine.backward``: ``cp_size`` times this rank's share of its replica's
        token-mean loss (see Note [DeepSpeed gradient averaging])."""
        return causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch) * self.mesh.size

    def mean_loss(self, loss: Tensor) -> float:
        """The step's loss, the mean over replicas of their token-mean losses, from every rank's :meth:`loss`
        (collective over all ranks)."""
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=self.parallel.group)
        return total.item() / dist.get_world_size(self.parallel.group)  # host sync: printed


def layout_from_config(config: dict[str, Any], model: torch.nn.Module | None = None) -> MeshAttention | None:
    """Build the DP x CP layout a DeepSpeed config's enabled ``"mesh_attention"`` block asks for (collective
    over the world) and, given ``model``, switch its attention; ``None`` when the block is absent or off."""
    cfg = MeshConfig.from_ds_config(config)
    if cfg is None or not cfg.enabled:
        return None
    shape = ds_attention_shape(model, cfg, config) if cfg.tile == "auto" else None
    parallel = parallel_from_config(cfg, shape=shape)
    if model is not None:
        switch_attention(model, parallel.mesh, **cfg.attention_options)
    return MeshAttention(config=cfg, parallel=parallel)


def _bind_local_device(accelerator) -> None:
    """Before the process group is made: this rank's GPU as the current device (``LOCAL_RANK``, set by the
    deepspeed launcher and torchrun), as DeepSpeed's engine would set it later. DeepSpeed binds the NCCL
    default group to that device (``init_process_group(device_id=...)``), and the layout's groups are made
    before the engine: without it their control collectives would run from GPU 0 on every rank."""
    if dist.is_initialized() or accelerator.device_name() == "cpu" or "LOCAL_RANK" not in os.environ:
        return
    accelerator.set_device(int(os.environ["LOCAL_RANK"]))


def initialize(
    args: Any = None,
    model: torch.nn.Module = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config: str | dict | None = None,
    mesh_param: Any = None,
    config_params: str | dict | None = None,
):
    """``deepspeed.initialize`` with the config's ``"mesh_attention"`` block switched on.

    Without the block (or with ``"enabled": false``) this is ``deepspeed.initialize``. With it: the
    block is validated, the DP x CP layout built, the model's attention switched, and DeepSpeed given a
    :class:`DataContextParallelMPU`; the engine carries the :class:`MeshAttention` as
    ``engine.mesh_attention``. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``training_data`` (a map-style dataset) gives ``engine.training_dataloader``: DeepSpeed's loader sampling
    over the DP replicas, whose batches are this rank's :class:`~mesh_cp.runtime.batch.ShardedBatch` on
    ``engine.device`` (:mod:`mesh_cp.integrations.deepspeed.data`); ``collate_fn`` then collates the examples
    into the ``(batch, seq)`` batch that is sharded.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    forwarded = dict(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        mesh_param=mesh_param,
        config_params=config_params,
    )
    if distributed_port is not None:
        forwarded["distributed_port"] = distributed_port
    loaded, cfg = load_config(args, config, config_params)
    if cfg is None or not cfg.enabled:
        return deepspeed.initialize(**forwarded)
    check_no_conflicts(loaded, mpu=mpu, mesh_param=mesh_param)
    check_training_options(loaded)
    check_training_data(loaded, training_data, collate_fn)
    if model is None:
        raise ValueError("initialize requires a model")
    _bind_local_device(get_accelerator())
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        dist_init_required=dist_init_required,
        **({"distributed_port": distributed_port} if distributed_port is not None else {}),
    )
    mesh_attention = layout_from_config(loaded, model)
    # The engine's loader would sample over all DP x CP ranks: build it after, over the DP replicas.
    forwarded.update(mpu=DataContextParallelMPU(mesh_attention.parallel), training_data=None, collate_fn=None)
    forwarded.update(_with_config(args, replica_batch_size(loaded, mesh_attention.mesh.size)))
    engine, optimizer, _, scheduler = deepspeed.initialize(**forwarded)
    check_ds_engine(engine, mesh_attention.parallel)
    engine.mesh_attention = mesh_attention
    engine.deepspeed_io = _replica_io(engine.deepspeed_io, mesh_attention)
    if training_data is not None:
        engine.training_dataloader = training_dataloader(engine, training_data, mesh_attention, collate_fn)
    return engine, optimizer, engine.training_dataloader, scheduler


def _with_config(args: Any, config: dict) -> dict[str, Any]:
    """The ``deepspeed.initialize`` arguments that hand it ``config`` (read from ``args.deepspeed_config`` or the
    given one): ``args`` without its config path, which DeepSpeed would read again."""
    if getattr(args, "deepspeed_config", None) is not None or getattr(args, "deepscale_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = args.deepscale_config = None
    return {"args": args, "config": config, "config_params": None}


def _replica_io(deepspeed_io, mesh_attention: MeshAttention):
    """``engine.deepspeed_io`` with a sampler given: its default sampler would sample over all DP x CP ranks, so that
    the ranks of a CP group would shard different sequences."""

    signature = inspect.signature(deepspeed_io)

    @functools.wraps(deepspeed_io)
    def io(*args, **kwargs):
        if signature.bind(*args, **kwargs).arguments.get("data_sampler") is None:
            parallel = mesh_attention.parallel
            raise ValueError(
                "engine.deepspeed_io's default sampler samples over all DP x CP ranks; pass data_sampler="
                f"torch.utils.data.DistributedSampler(dataset, num_replicas={parallel.dp_size}, rank="
                f"{parallel.dp_rank}) (engine.mesh_attention.parallel.dp_size / dp_rank) and shard each batch with "
                "engine.mesh_attention.shard (or collate_fn=mesh_cp.integrations.deepspeed.data.ShardingCollate)"
            )
        return deepspeed_io(*args, **kwargs)

    return io
