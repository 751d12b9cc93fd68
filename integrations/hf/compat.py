"""What differs between the supported transformers versions, in one place (the versions are in ``pyproject.toml``;
``scripts/compat.py`` runs the Hugging Face tests on the oldest supported and the newest released ones).

- The cache keyword of a model's forward and of ``generate``: ``past_key_values`` until transformers 5.23,
  ``cache`` from 5.24 (which still takes ``past_key_values`` with a deprecation warning until 5.40 / 6.0). Read from
  the model's own signature, never from a version number: a model's forward says which name it takes.
- The private parts of ``transformers.Trainer``, ``accelerate`` and TRL's ``SFTTrainer`` that MeshCPTrainer uses where
  no public hook exists, each in one function here (the Trainer and TRL tests run each against the installed
  versions): the column removal of Trainer's dataloaders, the registration of a prepared dataloader with
  the accelerator, TRL's token counter, the gather of TRL's training metrics and its count of ranks that share a batch, and the state that makes the Trainer
  take an FSDP2 model that mesh_cp sharded.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import seed_worker

__all__ = [
    "CACHE_KEYWORDS",
    "LengthGroupedSampler",
    "cache_keyword",
    "correct_trl_tokens",
    "count_repeated_ranks",
    "eval_metric_lists",
    "eval_order",
    "every_rank_once",
    "replica_view",
    "forget_eval_prepare",
    "gather_for_metrics_as",
    "given_cache",
    "output_cache",
    "prepare_as_single_process",
    "remove_unused_columns",
    "seed_worker",
    "sharded_generation",
    "use_sharded_model",
]

CACHE_KEYWORDS: tuple[str, ...] = ("cache", "past_key_values")
"""The names a transformers model call has given its cache, newest first."""


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``model``'s forward (and so its ``generate``) takes its cache by: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"``."""
    forward = getattr(type(model), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def given_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache a model call or ``generate`` call was given under either name (``None``: none). Both names at once
    are refused: transformers would take one and drop the other."""
    given = {name: kwargs[name] for name in CACHE_KEYWORDS if kwargs.get(name) is not None}
    if len(given) > 1:
        raise ValueError(f"a cache was given as both {' and '.join(given)}: pass one (cache= on transformers >= 5.24)")
    return next(iter(given.values()), None)


def output_cache(output: Any) -> Any:
    """The cache a model output carries (``output.cache`` from transformers 5.24, ``output.past_key_values``
    before)."""
    for name in CACHE_KEYWORDS:
        if isinstance(output, Mapping) and output.get(name) is not None:
            return output[name]
        if not isinstance(output, Mapping) and getattr(output, name, None) is not None:
            return getattr(output, name)
    return None


def remove_unused_columns(trainer: Any, dataset: Any, collator: Any, description: str) -> tuple[Any, Any]:
    """``(dataset, collator)`` with the columns the model does not take removed, as ``Trainer`` does for its own
    dataloaders (``remove_unused_columns``): from a ``datasets.Dataset`` itself, else by wrapping the collator
    (private ``Trainer._remove_unused_columns`` / ``_get_collator_with_removed_columns``)."""
    try:
        import datasets
    except ImportError:  # transformers works without datasets
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description=description), collator
    return dataset, trainer._get_collator_with_removed_columns(collator, description=description)


def eval_order(trainer: Any, dataset: Any) -> list[int] | range:
    """The order a single-process ``Trainer`` evaluates ``dataset`` in: its eval sampler's (the length-grouped order
    under ``train_sampling_strategy="group_by_length"``), else the set's own (private ``Trainer._get_eval_sampler``,
    which gives no sampler when distributed)."""
    from torch.utils.data import SequentialSampler

    sampler = trainer._get_eval_sampler(dataset)
    return range(len(dataset)) if sampler is None or isinstance(sampler, SequentialSampler) else list(sampler)


def prepare_as_single_process(accelerator: Any, loader: torch.utils.data.DataLoader) -> Any:
    """``loader`` prepared as ``accelerator.prepare`` prepares it for a single process: the same sampler
    replacement (accelerate's seedable sampler with ``data_seed``), RNG synchronisation, device placement and
    epoch handling, but every process iterates every batch (each DP replica then takes its part of it). Registered
    with the accelerator like its own dataloaders (private ``Accelerator._dataloaders``), so that its state is saved
    and restored with checkpoints."""
    from accelerate.data_loader import prepare_data_loader

    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=1,
        process_index=0,
        split_batches=False,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=True,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    accelerator._dataloaders.append(prepared)
    return prepared


def correct_trl_tokens(trainer: Any, before: int, tokens: int) -> None:
    """TRL ``SFTTrainer``'s ``num_tokens`` metric after a training step: ``before`` (its count before the step) plus
    the step's ``tokens`` counted once (TRL sums the shard lengths of every rank; private
    ``SFTTrainer._total_train_tokens`` / ``_metrics``)."""
    trainer._total_train_tokens = before + tokens // trainer._tp_size
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


def count_repeated_ranks(trainer: Any, repeats: int) -> None:
    """Make a TRL trainer's token counter (``num_tokens``: the batch's attention mask summed over every process)
    count each token once when every ``repeats`` consecutive ranks hold the same batch (the CP ranks of a replica,
    Note [Whole sequences under CP] in :mod:`mesh_cp.integrations.hf.scores`): TRL divides that sum by the ranks
    that share a batch under tensor parallelism (private ``_tp_size`` of ``DPOTrainer`` and ``RewardTrainer``),
    which mesh_cp sets to ``repeats`` (accelerate's own TP is refused beside mesh_cp)."""
    if getattr(trainer, "_tp_size", 1) != 1:
        raise NotImplementedError(
            f"{type(trainer).__name__} counts tokens over {trainer._tp_size} tensor-parallel ranks: accelerate's TP "
            f"does not combine with mesh_cp's CP; leave tp_size at 1"
        )
    trainer._tp_size = repeats


def forget_eval_prepare(trainer: Any) -> None:
    """Undo what ``Trainer.evaluate()`` before ``train()`` leaves behind: it prepares the model with accelerate in
    evaluation mode, which marks it prepared (private ``_is_accelerate_prepared``, ``Accelerator._models``), so
    that ``train()`` would not wrap it for DDP and the gradients would not be averaged over the ranks. While the model
    is not wrapped yet, the mark (and the autocast accelerate put on its forward) is taken off, and ``train()``
    prepares it as it would have."""
    model = trainer.model
    if trainer.model_wrapped is not model or trainer.is_deepspeed_enabled:
        return
    if not getattr(model, "_is_accelerate_prepared", False):
        return
    del model._is_accelerate_prepared
    if "_original_forward" in model.__dict__:
        model.forward = model.__dict__.pop("_original_forward")
    trainer.accelerator._models[:] = [m for m in trainer.accelerator._models if m is not model]


def eval_metric_lists(trainer: Any) -> dict[str, list]:
    """The per-batch metric lists a trainer appends to during evaluation: TRL's ``SFTTrainer._metrics["eval"]``
    (private; ``num_tokens``, a running total, left out), empty for ``transformers.Trainer``."""
    metrics = getattr(trainer, "_metrics", None)
    if not isinstance(metrics, Mapping) or "eval" not in metrics:
        return {}
    return {key: values for key, values in metrics["eval"].items() if key != "num_tokens"}


@contextlib.contextmanager
def gather_for_metrics_as(accelerator: Any, gather: Any) -> Iterator[None]:
    """``accelerator.gather_for_metrics`` is ``gather`` inside the context (an instance attribute over the class's
    method); what it was before (another instance attribute, or the method) is put back on leaving, an exception
    included, so contexts nest."""
    previous = accelerator.__dict__.get("gather_for_metrics")
    accelerator.gather_for_metrics = gather
    try:
        yield
    finally:
        if previous is None:
            accelerator.__dict__.pop("gather_for_metrics", None)
        else:
            accelerator.gather_for_metrics = previous


def every_rank_once(accelerator: Any) -> contextlib.AbstractContextManager[None]:
    """Within a training step, ``accelerator.gather_for_metrics`` gathers from every rank, trimming nothing. TRL's
    ``entropy`` and ``mean_token_accuracy`` gather per-rank sums with it, and at an epoch's short last batch it keeps
    the first ``remainder`` entries (one per example, as if every process held examples), which would count only
    the first ranks' shards; every DP x CP rank's sum counts each of the batch's tokens once."""
    from accelerate.utils import gather_object

    def gather_all(data: Any, use_gather_object: bool = False) -> Any:
        return gather_object(data) if use_gather_object else accelerator.gather(data)

    return gather_for_metrics_as(accelerator, gather_all)


class _ReplicaState:
    """An accelerate state seen as one DP replica's: ``process_index`` and ``num_processes`` the replica's index and
    the DP degree, ``is_main_process`` the first replica's CP rank 0; everything else the real state's."""

    def __init__(self, state: Any, parallel: Any) -> None:
        self._state, self.process_index, self.num_processes = state, parallel.dp_rank, parallel.dp_size
        self.is_main_process = parallel.dp_rank == 0 and parallel.mesh.rank == 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


@contextlib.contextmanager
def replica_view(trainer: Any, *modules: Any) -> Iterator[None]:
    """Inside: ``trainer.accelerator`` sees the DP replicas as its processes, as a run without CP sees its processes
    (Note [Whole sequences under CP] in :mod:`mesh_cp.integrations.hf.scores`): ``process_index`` and
    ``num_processes`` are the replica's index and the DP degree (private ``Accelerator.state``, swapped for the
    context), ``gather`` gathers over the DP group (every rank of a replica holds the same values) and so do the
    ``gather`` and ``gather_object`` that ``modules`` imported from ``accelerate.utils`` (TRL's trainer modules).
    Everything is put back on leaving, an exception included."""
    import torch.distributed as dist
    from accelerate.utils import recursively_apply

    parallel, accelerator = trainer.parallel, trainer.accelerator

    def gather(data: Any) -> Any:
        def one(tensor: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(tensor) for _ in range(parallel.dp_size)]
            dist.all_gather(parts, tensor.contiguous(), group=parallel.dp_group)
            return torch.cat([p.reshape(-1, *tensor.shape[1:]) for p in parts])

        return recursively_apply(one, data, error_on_other_type=True)

    def gather_object(data: Any) -> list:
        parts: list[Any] = [None] * parallel.dp_size
        dist.all_gather_object(parts, data, group=parallel.dp_group)
        return [item for part in parts for item in part]

    state, given = accelerator.state, accelerator.__dict__.get("gather")
    saved = [(m, {name: getattr(m, name) for name in ("gather", "gather_object") if hasattr(m, name)}) for m in modules]
    accelerator.state, accelerator.gather = _ReplicaState(state, parallel), gather
    for module, names in saved:
        for name in names:
            setattr(module, name, gather if name == "gather" else gather_object)
    try:
        yield
    finally:
        accelerator.state = state
        if given is None:
            accelerator.__dict__.pop("gather", None)
        else:
            accelerator.gather = given
        for module, names in saved:
            for name, value in names.items():
                setattr(module, name, value)


@contextlib.contextmanager
def sharded_generation(modules: list[Any], mesh: Any, generate: Any) -> Iterator[None]:
    """Inside: the model that TRL's trainer modules ``modules`` unwrap for generation (their private module attribute
    ``unwrap_model_for_generation``) generates through ``generate`` (:func:`mesh_cp.integrations.hf.generate`: the
    prompts prefilled sharded over ``mesh``, decoding with Tree Attention over the sharded cache, the same sequences
    on every rank of the mesh). Put back on leaving."""
    modules = [m for m in modules if hasattr(m, "unwrap_model_for_generation")]
    originals = [m.unwrap_model_for_generation for m in modules]

    class Sharded:
        def __init__(self, model: torch.nn.Module) -> None:
            self._model = model

        def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
            return generate(self._model, input_ids, attention_mask, mesh=mesh, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._model, name)

    def sharded(original: Any) -> Any:
        @contextlib.contextmanager
        def unwrap(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with original(*args, **kwargs) as model:
                yield Sharded(model)

        return unwrap

    for module, original in zip(modules, originals, strict=True):
        module.unwrap_model_for_generation = sharded(original)
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.unwrap_model_for_generation = original


def use_sharded_model(trainer: Any, plugin: Any) -> None:
    """Make ``trainer`` train its FSDP2-sharded model the way a GPU run with accelerate's FSDP2 does: accelerate's
    state set to FSDP with ``plugin``, as accelerate sets it from the same settings on GPUs (it leaves FSDP off on the
    CPU), so that the Trainer prepares the model and optimizer through accelerate's FSDP2 path (which finds the model
    sharded and keeps it) and its no_sync, clipping, gathers and checkpoints (torch.distributed.checkpoint) are FSDP2's
    (Note [FSDP2 beside CP] in :mod:`mesh_cp.integrations.hf.fsdp`)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    state.fsdp_plugin = plugin
    if state.distributed_type != DistributedType.FSDP:
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState sets it
    trainer.is_fsdp_enabled = True
