"""TRL's trainers of whole sequences (``DPOTrainer``, ``GRPOTrainer``, ``RewardTrainer``) under a DP x CP layout: what
their mesh_cp mixins share (Note [Whole sequences under CP] in :mod:`mesh_cp.integrations.hf.scores`).

Every CP rank of a DP replica holds the replica's whole batch, collated by the trainer's own collator from the
replica's contiguous part of the single process's batch; the models' calls are sharded over the mesh inside their
forward hooks, so the trainer's loss and metrics run unchanged on full-length tensors, the same on every rank of
the group. Gradients: each rank's are its tokens' part of its replica's loss times ``cp_size``, and the average
over every DP x CP rank (DDP's) is the gradient of the global batch's loss.

World gathers in the trainers' metric code hold each replica's values ``cp_size`` times in a row: means, minima and
maxima are the single process's; token counts summed over the world are divided by ``cp_size``
(:func:`~mesh_cp.integrations.hf.compat.count_repeated_ranks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from mesh_cp.integrations.hf.attach import attach
from mesh_cp.integrations.hf.compat import count_repeated_ranks, every_rank_once
from mesh_cp.integrations.hf.replicas import check_gradients_averaged, check_world, replica_dataloader
from mesh_cp.integrations.hf.scores import shard_fused_calls, spread
from mesh_cp.runtime.parallel import DataContextParallel

REFUSED_SEQUENCE_OPTIONS: dict[str, str] = {
    "deepspeed": "DeepSpeed beside the whole-sequence trainers (their reference models prepared by TRL for ZeRO) is "
    "not run by mesh_cp yet; train with DDP (leave deepspeed unset)",
    "fsdp": "FSDP beside the whole-sequence trainers (their reference models sharded by TRL) is not run by mesh_cp "
    "yet; train with DDP (leave fsdp unset)",
    "neftune_noise_alpha": "NEFTune scales its embedding noise by the sequence length, which is a shard's under CP; "
    "leave it None",
    "use_liger_kernel": "Liger's kernels replace the model's forward and loss code, which mesh_cp does not check; set "
    "it to False",
    "eval_strategy": "evaluation of the whole-sequence trainers under CP is not built yet; set eval_strategy='no' and "
    "evaluate with a single process",
}
"""``TrainingArguments`` fields refused for :class:`MeshCPSequenceTrainerMixin` with a value other than the default,
and why."""


class MeshCPSequenceTrainerMixin:
    """What the mesh_cp mixins of TRL's whole-sequence trainers share (placed before the trainer in the bases):
    ``parallel=`` taken, the models attached to its mesh with their fused calls sharded
    (:func:`~mesh_cp.integrations.hf.scores.shard_fused_calls`), every DP replica collating its part of the single
    process's training batches, the world and the gradient averaging checked. Subclasses name the models to attach
    (:meth:`mesh_cp_models`) and may fix the trainer's arguments before it reads them (:meth:`mesh_cp_before_init`)."""

    def __init__(self, *args, parallel: DataContextParallel | None = None, **kwargs):
        name = type(self).__name__
        if args:
            raise ValueError(f"{name} takes keyword arguments only (model=..., args=..., ...)")
        if not isinstance(parallel, DataContextParallel):
            raise ValueError(
                f"{name} needs parallel=DataContextParallel.create(dist.group.WORLD, cp_size=..., tile=...), got "
                f"{type(parallel).__name__}"
            )
        self.parallel = parallel
        self._mesh_cp_attached: set[int] = set()
        self._mesh_cp_sharded = False  # FSDP is refused (check_sequence_options)
        check_sequence_options(kwargs.get("args"), name)
        refuse_prompt_learning(kwargs, name)
        self.mesh_cp_before_init(kwargs)
        super().__init__(**kwargs)
        self.mesh_cp_attach()
        check_world(self)
        count_repeated_ranks(self, parallel.mesh.size)

    def mesh_cp_before_init(self, kwargs: dict[str, Any]) -> None:
        """Check or fix the trainer's keywords before its ``__init__`` reads them (nothing here)."""

    def mesh_cp_models(self) -> list[torch.nn.Module]:
        """The models whose fused calls run over the mesh: the trained model and, when the trainer keeps one (DPO,
        GRPO with ``beta != 0``), its reference model, unwrapped."""
        models = [self.accelerator.unwrap_model(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))
        return models

    def mesh_cp_attach(self) -> None:
        """Attach every model of :meth:`mesh_cp_models` to the mesh and shard its fused calls, once each (the
        gradients scaled by ``cp_size``: accelerate's DDP averages them over every DP x CP rank)."""
        mesh = self.parallel.mesh
        for model in self.mesh_cp_models():
            if model is None or id(model) in self._mesh_cp_attached:
                continue
            attach(model, mesh)
            shard_fused_calls(model, mesh, grad_scale=mesh.size)
            self._mesh_cp_attached.add(id(model))

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self.mesh_cp_pairs:
            check_last_batch(type(self).__name__, self.train_dataset, self._train_batch_size, self.args, self.parallel)
        return replica_dataloader(self, self.train_dataset, self._train_batch_size)

    def get_total_train_batch_size(self, args) -> int:
        """Examples per optimizer step: every DP replica's once."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.parallel.dp_size

    mesh_cp_pairs: bool = False
    """Whether the batches are pairs (chosen rows, then rejected rows) whose count every DP replica must share."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        check_gradients_averaged(self, model)
        if self.mesh_cp_pairs:
            ids = inputs["input_ids"]
            check_even_replicas(type(self).__name__, ids.shape[0] // 2, self.parallel, ids.device)
        with every_rank_once(self.accelerator):
            return super().training_step(model, inputs, num_items_in_batch)

    def evaluate(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.evaluate(): {REFUSED_SEQUENCE_OPTIONS['eval_strategy']}")

    def predict(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.predict(): {REFUSED_SEQUENCE_OPTIONS['eval_strategy']}")


def check_last_batch(name: str, dataset: Any, batch_size: int, args: Any, parallel: DataContextParallel) -> None:
    """Refuse, on every rank before training, an epoch whose last batch of pairs would split unevenly over the DP
    replicas (:func:`check_even_replicas`; a replica left with no pairs would fail alone, the others waiting)."""
    try:
        last = len(dataset) % (batch_size * parallel.dp_size)
    except TypeError:  # no length: checked step by step
        return
    if last and not args.dataloader_drop_last and last % parallel.dp_size:
        raise NotImplementedError(
            f"the epoch's last batch of {last} pairs ({len(dataset)} in batches of {batch_size} x {parallel.dp_size} "
            f"replicas) splits unevenly over the {parallel.dp_size} DP replicas: {name}'s loss and metrics are means "
            f"over each replica's pairs, whose average is not the batch's mean; set dataloader_drop_last=True or give "
            f"a dataset whose length is a multiple of the global batch (per_device_train_batch_size x DP)"
        )


def check_even_replicas(name: str, pairs: int, parallel: DataContextParallel, device: torch.device) -> None:
    """Raise unless every DP replica of ``parallel`` holds ``pairs`` pairs in this step (one all-reduce over the DP
    group when there are several replicas): the trainer's loss and metrics are means over a replica's pairs,
    averaged over the replicas, which is the mean over the global batch only when the replicas hold as many."""
    if parallel.dp_size == 1:
        return
    fewest, most = spread(pairs, parallel.dp_group, device)
    if fewest != most:
        raise NotImplementedError(
            f"this step's batch splits unevenly over the {parallel.dp_size} DP replicas ({fewest} to {most} pairs "
            f"each, {pairs} here): {name}'s loss and metrics are means over each replica's pairs, whose average is "
            f"not the batch's mean; set dataloader_drop_last=True or give a dataset whose length is a multiple of the "
            f"global batch (per_device_train_batch_size x DP)"
        )


def refuse_prompt_learning(kwargs: dict[str, Any], name: str) -> None:
    """Refuse a prompt-learning PEFT adapter (prompt tuning, prefix tuning, P-tuning), given as ``peft_config`` or as
    the model's: it prepends virtual tokens inside the model's forward, to each rank's shard of the rows."""
    configs = [kwargs.get("peft_config")]
    configs += list(getattr(kwargs.get("model"), "peft_config", {}).values())
    for config in configs:
        if getattr(config, "is_prompt_learning", False):
            raise NotImplementedError(
                f"{name}: a prompt-learning PEFT adapter ({type(config).__name__}) prepends virtual tokens inside the "
                f"model's forward, to every CP rank's shard of the rows; use an adapter of the weights (LoraConfig) "
                f"under CP"
            )


def check_sequence_options(args: Any, name: str) -> None:
    """Refuse, by name and with the fix, the ``TrainingArguments`` of :data:`REFUSED_SEQUENCE_OPTIONS` and
    ``train_sampling_strategy="batch_rebalance"``, before the trainer is built."""
    if args is None:
        raise ValueError(f"{name} needs args= (its TRL config, with use_cpu=True on CPU processes)")
    given = {
        "deepspeed": args.deepspeed,
        "fsdp": args.fsdp,
        "neftune_noise_alpha": getattr(args, "neftune_noise_alpha", None),
        "use_liger_kernel": getattr(args, "use_liger_kernel", False),
        "eval_strategy": None if str(args.eval_strategy) in ("no", "IntervalStrategy.NO") else args.eval_strategy,
    }
    for key, value in given.items():
        if value:
            raise NotImplementedError(f"{name}: {key}={value!r}: {REFUSED_SEQUENCE_OPTIONS[key]}")
    if getattr(args, "train_sampling_strategy", "random") == "batch_rebalance":
        raise NotImplementedError(
            "train_sampling_strategy='batch_rebalance' deals examples to ranks by length, so the ranks of a CP group "
            "would hold different examples; use 'random', 'sequential' or 'group_by_length'"
        )
