"""transformers' ``Trainer`` with a DP x CP layout: every rank of a CP group fed the same examples, sharded,
and the layout built from a DeepSpeed config's ``"mesh_attention"`` block when none is given."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from mesh_cp.config import MeshConfig
from mesh_cp.integrations import ds_attention_shape
from mesh_cp.integrations.hf.attach import attach
from mesh_cp.integrations.hf.evaluation import MeshCPEvaluation, check_evaluation
from mesh_cp.runtime.batch import ShardingCollator
from mesh_cp.runtime.parallel import DataContextParallel


def mesh_cp_trainer_class():
    """``transformers.Trainer`` subclass that trains with a :class:`DataContextParallel` layout.

    ``MeshCPTrainer(model=..., args=..., train_dataset=..., parallel=parallel, pad_token_id=...)``: attaches
    its mesh to the model, feeds every rank of a CP group the same examples (a
    ``DistributedSampler`` over the DP replicas, reshuffled every epoch: Trainer calls the dataloader's
    ``set_epoch``) through :class:`ShardingCollator`, and lets Trainer's
    own token counting do the rest: with ``average_tokens_across_devices`` (required) the loss is the
    model's sum over this rank's tokens over the label count of all ranks, times the world size, so
    the DDP gradient mean over all DP x CP ranks is the gradient of the global mean loss.

    ``evaluate()`` (also during training, ``eval_strategy="steps"``) gives ``eval_loss`` equal to single-process
    ``Trainer.evaluate()`` on the same eval set and ``per_device_eval_batch_size``: the eval set's batches, in order,
    are dealt to the DP replicas, each batch's loss summed over its CP group's shares and the batches' losses
    averaged once over the replicas (Note [Evaluation under CP] in :mod:`mesh_cp.integrations.hf.evaluation`).
    ``predict()`` gives the loss only (``metrics["test_loss"]``; needs ``prediction_loss_only=True``); logits are
    not gathered, so ``compute_metrics`` and ``include_for_metrics`` are refused by name.

    With DeepSpeed (``TrainingArguments(deepspeed="ds_config.json")``, or ``--deepspeed`` on the command
    line) leave ``parallel`` out: the trainer builds it from the config's ``"mesh_attention"`` block
    (:class:`mesh_cp.config.MeshConfig`), and DeepSpeed's gradient mean over all ranks is exact at
    every ZeRO stage for the same reason.

    The head-parallel x mesh hybrid comes either way: ``DataContextParallel.create(group, cp_size=..., tile=...,
    heads=u)`` as ``parallel``, or ``"heads": u`` in the block; the collator pads to the mesh's
    :meth:`~mesh_cp.CPMesh.seq_multiple` and shards in its layout.
    """
    from transformers import Trainer

    class MeshCPTrainer(_MeshCPTraining, MeshCPEvaluation, Trainer):
        pass

    return MeshCPTrainer


class _MeshCPTraining:
    """What :func:`mesh_cp_trainer_class` adds to ``transformers.Trainer`` (placed before it in the bases)."""

    def __init__(
        self,
        *args,
        parallel: DataContextParallel | None = None,
        layout: DataContextParallel | None = None,
        pad_token_id: int,
        **kwargs,
    ):
        if args:
            raise ValueError("MeshCPTrainer takes keyword arguments only (model=..., args=..., ...)")
        if layout is not None:  # the earlier name of parallel=
            if parallel is not None:
                raise ValueError("pass parallel= (layout= is its earlier name), not both")
            parallel = layout
        if parallel is None:
            parallel = _parallel_from_deepspeed_args(kwargs.get("args"), kwargs.get("model"))
        elif isinstance(parallel, DataContextParallel):
            attach(kwargs["model"], parallel.mesh)
        else:
            raise ValueError(f"parallel must be a DataContextParallel, got {type(parallel).__name__}")
        kwargs.setdefault("data_collator", ShardingCollator(parallel.mesh, pad_token_id=pad_token_id))
        super().__init__(**kwargs)
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                "MeshCPTrainer needs TrainingArguments(average_tokens_across_devices=True): the loss of a CP "
                "rank is its share of the global token mean"
            )
        if self.args.label_smoothing_factor:
            raise NotImplementedError(
                f"label_smoothing_factor={self.args.label_smoothing_factor}: Trainer's label smoother shifts the labels "
                f"of each rank's shard again (ShardingCollator's are shifted on the full sequence); set it to 0"
            )
        self.parallel = parallel
        if self.args.eval_strategy != "no":
            check_evaluation(self, prediction_loss_only=True)  # before training, not at its first evaluation

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = DistributedSampler(
            self.train_dataset,
            num_replicas=self.parallel.dp_size,
            rank=self.parallel.dp_rank,
            shuffle=True,
            seed=self.args.seed,
        )
        batches = _EpochBatchSampler(sampler, self._train_batch_size, drop_last=self.args.dataloader_drop_last)
        return _EpochDataLoader(self.train_dataset, batch_sampler=batches, collate_fn=self.data_collator)


class _EpochBatchSampler(BatchSampler):
    """A ``BatchSampler`` whose ``set_epoch`` reshuffles its sampler. Resuming mid-epoch, Trainer first wraps the
    batch sampler to skip the batches already trained (accelerate's ``skip_first_batches`` builds a new plain
    ``DataLoader`` around it, which has no ``set_epoch``) and then sets the epoch through the wrapped batch
    sampler's ``set_epoch``: without this one the resumed epoch would be read in epoch 0's order."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class _EpochDataLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reshuffles its sampler: Trainer calls ``set_epoch(epoch)`` on a
    training dataloader that has one, before every epoch (a plain ``DataLoader`` would repeat the order)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _parallel_from_deepspeed_args(training_args: Any, model: torch.nn.Module) -> DataContextParallel:
    """The layout of an enabled ``"mesh_attention"`` block in ``training_args.deepspeed`` (collective over the
    world), with ``model`` attached to its mesh."""
    ds_config = getattr(training_args, "hf_deepspeed_config", None)
    if ds_config is None:
        raise ValueError(
            "MeshCPTrainer needs parallel=DataContextParallel.create(...), or TrainingArguments(deepspeed=...) whose "
            'config has an enabled "mesh_attention" block'
        )
    cfg = MeshConfig.from_ds_config(ds_config.config)
    if cfg is None or not cfg.enabled:
        raise ValueError(
            'the DeepSpeed config has no enabled "mesh_attention" block: add {"enabled": true, "cp_size": ..., '
            '"tile": ...} to it, or pass parallel= to MeshCPTrainer'
        )
    shape = ds_attention_shape(model, cfg, ds_config.config) if cfg.tile == "auto" else None
    parallel = DataContextParallel.from_config(cfg, shape=shape)
    attach(model, parallel.mesh, **cfg.attention_options)
    return parallel
