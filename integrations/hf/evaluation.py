"""``evaluate()`` and ``predict()`` of :func:`~mesh_cp.integrations.hf.mesh_cp_trainer_class` under a DP x CP layout:
the loss only, exactly the single-process ``Trainer``'s (Note [Evaluation under CP])."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from mesh_cp.integrations.hf.collate import TOKEN_COUNTS
from mesh_cp.integrations.hf.compat import (
    eval_metric_lists,
    eval_order,
    forget_eval_prepare,
    gather_for_metrics_as,
    remove_unused_columns,
)

# Note [Evaluation under CP]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Single-process Trainer.evaluate() cuts the eval set, in the order of its eval sampler (the set's own order, or
# the length-grouped order of train_sampling_strategy="group_by_length"), into batches of eval_batch_size examples
# and reports the mean over examples of their batch's token-mean loss: every batch's loss is repeated
# eval_batch_size times and gather_for_metrics trims the repeats of the last, shorter batch to its examples, so a
# batch weighs as many examples as it has. Under DP x CP:
#
# - batch b goes to DP replica b % dp_size, whose every CP rank gets the same examples through the collator
#   (the client's collator, then this rank's shard: num_items_in_batch is the label count of the whole batch);
#   replicas with fewer batches repeat one at the end, so every rank runs the same number of forwards (ZeRO 3
#   gathers parameters over all ranks in every forward), and the repeats are not counted;
# - a rank's loss is its share of the batch's token mean (its tokens' sum over the batch's label count), so the
#   batch's loss is the sum of the shares over the CP group (one all-reduce per batch, inside the group);
# - the batches' losses, each weighted by its example count, are averaged once at the end over the DP group (one
#   all-reduce over the ranks that hold the same CP rank), so a CP group's loss counts once, not cp_size times.
#
# Trainer's own per-batch gather (gather_for_metrics over all ranks, as if every rank held different examples)
# is replaced by the identity for the loop's duration. Logits are not gathered: evaluate() and predict() give the
# loss only, and what needs logits is refused by name (check_evaluation).


class ReplicaBatches(Sampler[list[int]]):
    """Batch sampler of DP replica ``replica``: batches ``replica, replica + replicas, ...`` of ``order`` (the eval
    set's indices in the single process's order) cut into batches of ``batch_size`` examples, then repeats of its
    first batch up to the count of the replica with the most (:attr:`real_batches` of them are real).
    ``drop_last`` drops a last, shorter batch."""

    def __init__(self, order: Sequence[int], batch_size: int, *, replica: int, replicas: int, drop_last: bool):
        order, length = list(order), len(order)
        batches = length // batch_size if drop_last else -(-length // batch_size)
        starts = range(replica * batch_size, batches * batch_size, replicas * batch_size)
        self.batches = [order[s : min(s + batch_size, length)] for s in starts]
        self.real_batches = len(self.batches)
        steps = -(-batches // replicas)
        padding = self.batches[:1] or [order[: min(batch_size, length)]]
        self.batches += padding * (steps - self.real_batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def eval_dataloader(trainer: Any, dataset: Any) -> DataLoader:
    """The eval (or test) ``DataLoader`` of this rank: its replica's :class:`ReplicaBatches` of the single process's
    eval order, collated by the trainer's collator (the same examples on every rank of a CP group, sharded);
    ``replica_batches`` (the sampler) set on it."""
    if dataset is None:
        raise ValueError("Trainer: evaluation requires an eval_dataset.")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise NotImplementedError(
            f"MeshCPTrainer evaluates datasets with a length (it deals their batches to the DP replicas in order); "
            f"got {type(dataset).__name__}: pass a map-style dataset (a list or a datasets.Dataset)"
        )
    dataset, collate = remove_unused_columns(trainer, dataset, trainer.data_collator, "Evaluation")
    order = eval_order(trainer, dataset)
    parallel = trainer.parallel
    batches = ReplicaBatches(
        order,
        trainer.args.eval_batch_size,
        replica=parallel.dp_rank,
        replicas=parallel.dp_size,
        drop_last=trainer.args.dataloader_drop_last,
    )
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
    loader.replica_batches = batches
    return loader


def check_evaluation(trainer: Any, prediction_loss_only: bool) -> None:
    """Refuse, by name and with the fix, what evaluation under CP does not give: predictions (logits of a CP rank
    hold its shard of every sequence and are not gathered), and the metrics computed from them."""
    args = trainer.args
    if trainer.compute_metrics is not None:
        raise NotImplementedError(
            "MeshCPTrainer evaluates the loss only: compute_metrics needs logits, which CP ranks hold in shards and "
            "MeshCPTrainer does not gather; drop compute_metrics (evaluate() reports eval_loss)"
        )
    if args.include_for_metrics:
        raise NotImplementedError(
            f"MeshCPTrainer evaluates the loss only: include_for_metrics={args.include_for_metrics!r} feeds "
            f"compute_metrics, which it does not run; leave include_for_metrics empty"
        )
    if not prediction_loss_only:
        raise NotImplementedError(
            "MeshCPTrainer.predict() gives the loss only (metrics['test_loss'], predictions None): logits of a CP "
            "rank hold its shard of every sequence and are not gathered; set "
            "TrainingArguments(prediction_loss_only=True)"
        )


def check_loss_inputs(trainer: Any) -> None:
    """The model's own loss gets ``num_items_in_batch`` (else its loss would be the mean over this rank's shard),
    and no ``compute_loss_func`` gets labels (they are this rank's shard, already shifted on the full sequence)."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise NotImplementedError(
            "compute_loss_func would get this rank's shard of labels already shifted on the full sequence (a function "
            "written for Trainer shifts them again, one token off); leave it out: the model's loss takes the shard's "
            "shift_labels and num_items_in_batch"
        )
    if not trainer.model_accepts_loss_kwargs:
        raise NotImplementedError(
            f"{type(trainer.accelerator.unwrap_model(trainer.model)).__name__} takes no num_items_in_batch in its "
            f"forward (model_accepts_loss_kwargs=False), so its loss is the mean over this rank's shard, not its share "
            f"of the batch's; use a model whose forward takes **kwargs for its loss"
        )


def loss_scale(trainer: Any) -> int:
    """What ``Trainer.compute_loss`` multiplies the model's loss by (``average_tokens_across_devices``); refused when
    it does not hand the model ``num_items_in_batch`` (the model's loss would be its own shard's mean)."""
    check_loss_inputs(trainer)
    if trainer.args.n_gpu > 1:
        return trainer.args.n_gpu
    return trainer.accelerator.num_processes // trainer.get_tp_size()


def batch_loss(trainer: Any, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The batch's token-mean loss on every rank of the CP group: this rank's share (``Trainer.compute_loss`` with
    the batch's label count, unscaled), summed over the group."""
    count = inputs.get("num_items_in_batch")
    if count is None:
        raise ValueError(
            "MeshCPTrainer evaluates batches of its own collator (they carry num_items_in_batch, the batch's label "
            "count); leave trainer.data_collator as the trainer set it"
        )
    with torch.no_grad(), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs, num_items_in_batch=count)
    loss = loss.detach().float() / loss_scale(trainer)
    dist.all_reduce(loss, group=trainer.parallel.mesh.group)
    return loss


def replicas_mean(losses: list[torch.Tensor], sizes: list[int], trainer: Any) -> float | None:
    """The mean over every replica's examples of their batch's loss (``losses``: this replica's batches' losses,
    ``sizes`` their example counts), over the DP group; non-finite losses left out when ``logging_nan_inf_filter``
    and some are finite (as Trainer). ``None`` when there are none."""
    device = losses[0].device if losses else trainer.args.device
    local = torch.stack(losses).double() if losses else torch.zeros(0, dtype=torch.float64, device=device)
    weights = torch.tensor(sizes, dtype=torch.float64, device=device)
    finite = torch.isfinite(local)
    totals = torch.stack(
        [(local * weights)[finite].sum(), weights[finite].sum(), (local * weights).sum(), weights.sum()]
    )
    dist.all_reduce(totals, group=trainer.parallel.dp_group)
    finite_sum, finite_count, total, count = totals.tolist()
    if count == 0:
        return None
    if trainer.args.logging_nan_inf_filter and finite_count > 0:
        return finite_sum / finite_count
    return total / count


class MeshCPEvaluation:
    """The evaluation hooks of ``MeshCPTrainer`` (placed before ``transformers.Trainer`` in its bases; needs
    ``self.parallel``): Note [Evaluation under CP]."""

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        return eval_dataloader(self, self.eval_dataset if eval_dataset is None else eval_dataset)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return eval_dataloader(self, test_dataset)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = dict(inputs)
        inputs.pop(TOKEN_COUNTS, None)
        loss = batch_loss(self, model, self._prepare_inputs(inputs))
        self._mesh_cp_eval_losses.append(loss)
        return loss, None, None

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        check_evaluation(self, loss_only)
        batches = getattr(dataloader, "replica_batches", None)
        if batches is None:
            raise ValueError(
                "MeshCPTrainer.evaluation_loop needs a dataloader of get_eval_dataloader / get_test_dataloader (it "
                "deals the batches to the DP replicas)"
            )
        self._mesh_cp_eval_losses = []
        gather = self.gather_function
        self.gather_function = _this_rank  # Note [Evaluation under CP]: no gather as of different examples
        metrics = BatchMetrics(self, self.parallel)
        try:
            with metrics:
                output = super().evaluation_loop(dataloader, description, True, ignore_keys, metric_key_prefix)
        finally:
            self.gather_function = gather
            forget_eval_prepare(self)
        real = batches.real_batches
        metrics.keep_real(real)
        sizes = [len(b) for b in batches.batches[:real]]
        loss = replicas_mean(self._mesh_cp_eval_losses[:real], sizes, self)
        self._mesh_cp_eval_losses = []
        output.metrics.pop(f"{metric_key_prefix}_loss", None)
        if loss is not None:
            output.metrics[f"{metric_key_prefix}_loss"] = loss
        return output


class BatchMetrics:
    """Per-batch metrics a trainer computes itself during evaluation (TRL's ``entropy`` and ``mean_token_accuracy``,
    gathered with ``accelerator.gather_for_metrics`` in its ``compute_loss``), made a single process's: while the
    context is open, ``gather_for_metrics`` sums over the CP group only (a batch's tokens are its CP group's shards),
    so each batch's value is that batch's; :meth:`keep_real` then drops the repeated batches and puts every replica's
    values together (Note [Evaluation under CP])."""

    def __init__(self, trainer: Any, parallel: Any):
        self.trainer, self.parallel = trainer, parallel
        self.accelerator = trainer.accelerator

    def __enter__(self) -> BatchMetrics:
        self.before = {key: len(values) for key, values in eval_metric_lists(self.trainer).items()}
        group = self.parallel.mesh.group

        def over_cp_group(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach().clone()
            dist.all_reduce(tensor, group=group)
            return tensor

        self.swap = gather_for_metrics_as(self.accelerator, over_cp_group)
        self.swap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.swap.__exit__(*exc)

    def keep_real(self, real: int) -> None:
        for key, values in eval_metric_lists(self.trainer).items():
            start = self.before.get(key, 0)
            mine = values[start : start + real] if len(values) > start else []
            every = [None] * self.parallel.dp_size
            dist.all_gather_object(every, mine, group=self.parallel.dp_group)
            values[start:] = [v for replica in every for v in replica]


def _this_rank(tensor: torch.Tensor) -> torch.Tensor:
    """Trainer's per-batch gather, as the identity (Note [Evaluation under CP])."""
    return tensor
