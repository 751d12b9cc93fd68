"""What every trainer of :func:`~mesh_cp.integrations.hf.mesh_cp_trainer_class` shares about its DP replicas: the
training batches of the single process, each replica collating its contiguous part (every CP rank of a replica
alike), and the checks that the gradients are averaged over every DP x CP rank."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from mesh_cp.integrations.hf.collate import replica_examples
from mesh_cp.integrations.hf.compat import (
    LengthGroupedSampler,
    prepare_as_single_process,
    remove_unused_columns,
    seed_worker,
)


def replica_dataloader(trainer: Any, dataset: Any, batch_size: int, sampler: Any = None) -> DataLoader:
    """The training dataloader of ``trainer``'s DP replica: the single process's batches of ``batch_size`` times the
    DP degree (its sampler: ``trainer._get_train_sampler`` unless ``sampler`` is given; seeded, reshuffled every
    epoch, prepared as accelerate prepares a single process's), each cut into the replicas' contiguous parts, this
    replica's collated with ``trainer.data_collator`` (columns the model does not take removed as Trainer removes
    them)."""
    parallel, args = trainer.parallel, trainer.args
    dataset, collate = remove_unused_columns(trainer, dataset, trainer.data_collator, "Training")
    if sampler is None and not isinstance(dataset, IterableDataset):
        sampler = trainer._get_train_sampler(dataset)
        if isinstance(sampler, LengthGroupedSampler):
            sampler.batch_size *= parallel.dp_size  # the groups of the single process's batches
    loader = DataLoader(
        dataset,
        batch_size=batch_size * parallel.dp_size,
        sampler=sampler,
        collate_fn=_ReplicaCollate(collate, parallel.dp_rank, parallel.dp_size),
        drop_last=args.dataloader_drop_last,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
        in_order=getattr(args, "dataloader_in_order", True),
        worker_init_fn=functools.partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
    )
    return prepare_as_single_process(trainer.accelerator, loader)


def check_gradients_averaged(trainer: Any, model: torch.nn.Module) -> None:
    """Every rank's loss is its share of the batch's, scaled by the world size: the gradient is exact only once it
    is averaged over all ranks (DDP's or DeepSpeed's). Refuse a step of a model that nothing averages."""
    if trainer.is_deepspeed_enabled:  # the engine averages over its data-parallel group: it must be every rank
        check_world(trainer, engine=model)
        return
    if trainer.accelerator.num_processes == 1 or trainer._mesh_cp_sharded:  # FSDP2: checked when it was sharded
        return
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if not isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"MeshCPTrainer is training a {type(inner).__name__} that is not wrapped in DistributedDataParallel on "
            f"{trainer.accelerator.num_processes} processes: its gradients would not be averaged over the DP x CP "
            f"ranks; let Trainer.train() prepare the model (do not prepare it with accelerate beforehand)"
        )


def check_world(trainer: Any, engine: Any = None) -> None:
    """Refuse a run whose accelerate state (or DeepSpeed ``engine``, when given) sees another number of processes
    than the layout's group: the loss of a rank is scaled by the processes accelerate sees and the gradients are
    averaged over them, so each must be every DP x CP rank. On CPU, accelerate sees one process unless told to use
    the CPU (``TrainingArguments(use_cpu=True)``), and then no rank's gradients are averaged."""
    world = dist.get_world_size(trainer.parallel.group)
    seen = {"accelerate": trainer.accelerator.num_processes}
    if engine is not None:
        seen["the DeepSpeed engine's data-parallel group"] = getattr(engine, "dp_world_size", world)
    for who, size in seen.items():
        if size != world:
            fix = (
                "Build the layout over the launched world (DataContextParallel.create(dist.group.WORLD, ...))"
                if size > world
                else "On CPU set TrainingArguments(use_cpu=True) (--use_cpu on the command line; without it "
                "accelerate takes a machine with no GPU for one process), and build the layout over the launched "
                "world (dist.group.WORLD)"
            )
            raise ValueError(
                f"{who} sees {size} process(es) but mesh_cp's DP x CP layout spans {world} ranks: the gradients "
                f"would not be averaged over every rank and the token count would be a part's; every process of the "
                f"layout's group must be one of accelerate's. {fix}"
            )


class _ReplicaCollate:
    """Collate function of a DP replica: its part of the global batch (:func:`replica_examples`), then
    ``collate``."""

    def __init__(self, collate, replica: int, replicas: int):
        self.collate, self.replica, self.replicas = collate, replica, replicas

    def __call__(self, examples):
        return self.collate(replica_examples(examples, self.replica, self.replicas))
