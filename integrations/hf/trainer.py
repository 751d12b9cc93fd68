"""transformers' ``Trainer`` (and its subclasses: TRL's ``SFTTrainer``) with a DP x CP layout: the single process's
batches, each DP replica collating its part and every rank of its CP group taking its shard; the layout built from
a DeepSpeed config's ``"mesh_attention"`` block when none is given."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.utils.data import DataLoader

from mesh_cp.config import MeshConfig
from mesh_cp.integrations.hf.attach import attach
from mesh_cp.integrations.hf.collate import TOKEN_COUNTS, PadExamples, ShardCollated
from mesh_cp.integrations.hf.compat import (
    correct_trl_tokens,
    every_rank_once,
)
from mesh_cp.integrations.hf.evaluation import MeshCPEvaluation, check_evaluation, check_loss_inputs
from mesh_cp.integrations.hf.fsdp import check_launch, shard_for_trainer
from mesh_cp.integrations.hf.replicas import check_gradients_averaged, check_world, replica_dataloader
from mesh_cp.integrations.layout import ds_attention_shape, parallel_from_config
from mesh_cp.integrations.versions import require, require_for_trainer
from mesh_cp.runtime.batch import ShardingCollator
from mesh_cp.runtime.parallel import DataContextParallel


def mesh_cp_trainer_class(base: type | None = None) -> type:
    """A subclass of ``base`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``, a user's) that trains
    with a :class:`DataContextParallel` layout: ``MeshCPTrainerMixin`` placed before ``base``.

    ``MeshCPTrainer(model=..., args=..., train_dataset=..., parallel=parallel)`` (with ``base``'s own keywords:
    ``data_collator``, ``processing_class``, TRL's ``SFTConfig`` ...) attaches its mesh to the model and trains
    exactly what a single process would train with ``per_device_train_batch_size`` times the DP degree:

    - the training batches are the single process's (the same sampler: ``train_sampling_strategy`` random,
      sequential or group_by_length, ``data_seed``, ``dataloader_drop_last``, reshuffled every epoch); every DP
      replica collates its contiguous part of each with the client's collator (``data_collator``, the one TRL
      builds for padding, packing or padding-free, or :class:`~mesh_cp.integrations.hf.collate.PadExamples` when
      there is none), and every rank of its CP group takes its shard of that
      (:func:`~mesh_cp.integrations.hf.collate.shard_collated`: packed documents, padding and labels honoured or
      refused by name);
    - Trainer's own token counting makes the loss exact: with ``average_tokens_across_devices`` (required) the loss
      of a rank is its tokens' sum over the label count of all ranks, times the world size, so the gradient mean
      over all DP x CP ranks (DDP's, or DeepSpeed's at every ZeRO stage) is the gradient of the global mean;
    - the throughput metrics and token counters (``train_samples_per_second``, ``include_num_input_tokens_seen``,
      TRL's ``num_tokens``) count every replica's examples and tokens once.

    ``evaluate()`` and ``predict()`` report the loss single-process ``Trainer.evaluate()`` reports (Note [Evaluation
    under CP] in :mod:`mesh_cp.integrations.hf.evaluation`). What would change the result under CP and is not
    honoured is refused by name when the trainer is built (:data:`REFUSED_OPTIONS`), and so are a ``base`` that is
    another trainer of transformers or TRL than :data:`SUPPORTED_BASES` (:func:`check_base`) and an accelerate state
    that sees another number of processes than ``parallel``'s group (:func:`check_world`; on CPU pass
    ``TrainingArguments(use_cpu=True)``).

    With DeepSpeed (``TrainingArguments(deepspeed="ds_config.json")``) leave ``parallel`` out: the trainer builds it
    from the config's ``"mesh_attention"`` block (:class:`mesh_cp.config.MeshConfig`). TRL::

        SFTTrainer = hf.mesh_cp_trainer_class(trl.SFTTrainer)
        trainer = SFTTrainer(model=model, args=SFTConfig(..., packing=True), train_dataset=ds, parallel=parallel)

    TRL's ``DPOTrainer``, ``GRPOTrainer`` and ``RewardTrainer`` get their own mixins (:data:`SEQUENCE_MIXINS`): every
    CP rank holds its replica's whole batch and the model calls are sharded (Note [Whole sequences under CP] in
    :mod:`mesh_cp.integrations.hf.scores`).
    """
    if base is None:
        from transformers import Trainer

        base = Trainer
    require_for_trainer(base)  # accelerate, and TRL for its trainers: an unsupported release is refused
    return _trainer_class(base)


@functools.cache
def _trainer_class(base: type) -> type:
    from transformers import Trainer

    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise ValueError(f"base must be transformers.Trainer or a subclass of it, got {base!r}")
    check_base(base)
    mixin = _sequence_mixin(base) or MeshCPTrainerMixin
    if issubclass(base, mixin):
        return base
    return type(f"MeshCP{base.__name__}", (mixin, base), {"__module__": __name__})


SEQUENCE_MIXINS: dict[str, str] = {
    "DPOTrainer": "mesh_cp.integrations.hf.preference:MeshCPDPOMixin",
    "GRPOTrainer": "mesh_cp.integrations.hf.rl:MeshCPGRPOMixin",
    "RewardTrainer": "mesh_cp.integrations.hf.reward:MeshCPRewardMixin",
    "RLOOTrainer": "mesh_cp.integrations.hf.rl:MeshCPGRPOMixin",
}
"""TRL's trainers of whole sequences and the mixin of each (Note [Whole sequences under CP] in
:mod:`mesh_cp.integrations.hf.scores`): every CP rank holds its replica's whole batch and only the model calls are
sharded."""

SUPPORTED_BASES: tuple[str, ...] = ("transformers.Trainer", "trl.SFTTrainer", *(f"trl.{n}" for n in SEQUENCE_MIXINS))
"""The trainers mesh_cp trains exactly, and their subclasses: rows of tokens with per-token labels and a token-mean
loss (``Trainer``, ``SFTTrainer``: every rank's batch is its shard), and TRL's trainers of whole sequences
(:data:`SEQUENCE_MIXINS`). Any other trainer class of transformers or TRL in a base's MRO is refused by name."""


def _sequence_mixin(base: type) -> type | None:
    """The mixin of :data:`SEQUENCE_MIXINS` for the first of TRL's whole-sequence trainers in ``base``'s MRO."""
    import importlib

    for c in base.__mro__:
        if _package(c) == "trl" and c.__name__ in SEQUENCE_MIXINS:
            module, name = SEQUENCE_MIXINS[c.__name__].split(":")
            return getattr(importlib.import_module(module), name)
    return None


UNSUPPORTED_REASONS: dict[str, tuple[str, ...]] = {
    "its loss compares whole sequences' log-probabilities (chosen and rejected, or labelled, completions)": (
        "CPOTrainer", "ORPOTrainer", "KTOTrainer", "BCOTrainer", "TPOTrainer", "A2POTrainer",
    ),
    "it generates completions and weighs whole sequences by their rewards": (
        "PPOTrainer", "OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer",
        "GMPOTrainer", "AsyncGRPOTrainer", "SDPOTrainer", "IWOPDTrainer",
    ),
    "it scores each sequence from one pooled token": ("PRMTrainer",),
    "its loss reads a teacher model's logits (the teacher is not attached to the mesh) or generates": (
        "GKDTrainer", "GOLDTrainer", "DistillationTrainer", "ServerDistillationTrainer", "AsyncDistillationTrainer",
        "SDFTTrainer",
    ),
    "its evaluation generates and its batches are encoder-decoder pairs": ("Seq2SeqTrainer",),
}  # fmt: skip
"""Why the trainers known not to be rows of tokens are refused, by reason (the refusal itself is by
:data:`SUPPORTED_BASES`: a trainer not listed here is refused too)."""


def check_base(base: type) -> None:
    """Refuse, by name, a trainer class whose MRO holds a trainer of transformers or TRL other than
    :data:`SUPPORTED_BASES` and their own bases (TRL's KTO, RLOO, PPO, ... trainers: :data:`UNSUPPORTED_REASONS`). Imports nothing distributed."""
    from transformers import Trainer

    allowed = set(Trainer.__mro__)
    if any(_package(c) == "trl" for c in base.__mro__):
        import trl

        for name in ("SFTTrainer", *SEQUENCE_MIXINS):
            allowed |= set(getattr(trl, name).__mro__)
    for c in base.__mro__:
        if _package(c) in ("transformers", "trl") and issubclass(c, Trainer) and c not in allowed:
            why = next((r for r, names in UNSUPPORTED_REASONS.items() if c.__name__ in names), None)
            why = why or "its batches or loss are not Trainer's rows of tokens with per-token labels"
            named = c.__name__ if c is base else f"{base.__name__} (a {c.__name__})"
            raise NotImplementedError(
                f"mesh_cp_trainer_class does not support {named} from {c.__module__} yet: {why}, which a CP rank "
                f"does not train under CP yet; supported: {' and '.join(SUPPORTED_BASES)}, and "
                f"subclasses of them that keep their batches"
            )


def _package(cls: type) -> str:
    return cls.__module__.partition(".")[0]


REFUSED_OPTIONS: dict[str, str] = {
    "label_smoothing_factor": "Trainer's label smoother shifts the labels of each rank's shard again (mesh_cp's are "
    "shifted on the full sequence); set it to 0",
    "neftune_noise_alpha": "NEFTune scales its embedding noise by the sequence length, which is a shard's under CP; "
    "leave it None",
    "average_tokens_across_devices": "the loss of a CP rank is its share of the global token mean, which needs "
    "Trainer's token count over all ranks; set it to True",
}
"""``TrainingArguments`` fields (and TRL ``SFTConfig`` fields) refused with a value other than the default, and why."""


class MeshCPTrainerMixin(MeshCPEvaluation):
    """What :func:`mesh_cp_trainer_class` adds to a ``transformers.Trainer`` (placed before it in the bases)."""

    def __init__(
        self,
        *args,
        parallel: DataContextParallel | None = None,
        layout: DataContextParallel | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        check_base(type(self))
        if _sequence_mixin(type(self)) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} puts MeshCPTrainerMixin, which shards rows of tokens, over a trainer of whole "
                f"sequences; build the class with hf.mesh_cp_trainer_class(...), which gives it its own mixin"
            )
        if args:
            raise ValueError("MeshCPTrainer takes keyword arguments only (model=..., args=..., ...)")
        if layout is not None:  # the earlier name of parallel=
            if parallel is not None:
                raise ValueError("pass parallel= (layout= is its earlier name), not both")
            parallel = layout
        if parallel is not None and not isinstance(parallel, DataContextParallel):
            raise ValueError(f"parallel must be a DataContextParallel, got {type(parallel).__name__}")
        client_collator = kwargs.get("data_collator")
        if isinstance(client_collator, (ShardingCollator, ShardCollated)):
            raise ValueError(
                f"data_collator is mesh_cp's {type(client_collator).__name__}, which shards: MeshCPTrainer shards the "
                f"batches itself; pass the collator that builds the full batch (or none)"
            )
        check_launch(kwargs.get("args"))
        super().__init__(**kwargs)
        check_options(self)
        if parallel is None:
            parallel = _parallel_from_deepspeed_args(self.args, self.model)
        else:
            attach(self.model, parallel.mesh)
        self.parallel = parallel
        check_world(self)
        self._mesh_cp_sharded = shard_for_trainer(self, parallel)
        pad = _pad_token_id(self, pad_token_id)
        collator = self.data_collator if client_collator is not None or not _is_trainer_default(self) else None
        if collator is None:  # the model's own inputs among the examples' keys are refused, not left out
            forward = self.accelerator.unwrap_model(self.model).forward
            collator = PadExamples(pad, model_inputs=inspect.signature(forward).parameters)
        self.data_collator = ShardCollated(
            collator, parallel.mesh, pad_token_id=pad, token_counts=True, causal=_causal(self.model)
        )
        if self.args.eval_strategy != "no":
            check_evaluation(self, prediction_loss_only=True)  # before training, not at its first evaluation

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return replica_dataloader(self, self.train_dataset, self._train_batch_size)

    def get_total_train_batch_size(self, args) -> int:
        """Examples per optimizer step: every DP replica's once (Trainer would divide the world by its own CP
        degree, which mesh_cp does not set)."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.parallel.dp_size

    def training_step(self, model, inputs, num_items_in_batch=None):
        check_gradients_averaged(self, model)
        counts = inputs.pop(TOKEN_COUNTS, None)
        before = getattr(self, "_total_train_tokens", None)
        with every_rank_once(self.accelerator):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if counts is not None:
            self._mesh_cp_counts = counts
            if before is not None:  # TRL's SFTTrainer counts tokens in compute_loss from the shard: count the batch's
                correct_trl_tokens(self, before, self._replica_total(counts[0] if counts[0] >= 0 else counts[2]))
        return loss

    def _track_num_input_tokens(self, inputs):
        """``include_num_input_tokens_seen="non_padding"``: the tokens of every replica's batch, counted once as a
        single process counts them (Trainer's own count reads the shard); ``"all"`` is refused (check_options)."""
        counts = getattr(self, "_mesh_cp_counts", None)
        if self.args.include_num_input_tokens_seen != "non_padding" or counts is None:
            return
        self.state.num_input_tokens_seen += self._replica_total(counts[0] if counts[0] >= 0 else counts[1])

    def _replica_total(self, value) -> int:
        """The sum over the DP replicas of a count every rank of a replica holds."""
        mine = torch.as_tensor(value if self.parallel.mesh.rank == 0 else 0, dtype=torch.int64, device=self.args.device)
        return int(self.accelerator.gather(mine.reshape(1)).sum())


def check_options(trainer: Any) -> None:
    """Refuse, by name and with the fix, the options that would change what is trained under CP
    (:data:`REFUSED_OPTIONS`, ``train_sampling_strategy="batch_rebalance"``, accelerate's own CP or SP)."""
    args = trainer.args
    if args.label_smoothing_factor:
        raise NotImplementedError(
            f"label_smoothing_factor={args.label_smoothing_factor}: {REFUSED_OPTIONS['label_smoothing_factor']}"
        )
    if getattr(args, "neftune_noise_alpha", None) is not None:
        raise NotImplementedError(
            f"neftune_noise_alpha={args.neftune_noise_alpha}: {REFUSED_OPTIONS['neftune_noise_alpha']}"
        )
    if not args.average_tokens_across_devices:
        raise ValueError(f"average_tokens_across_devices=False: {REFUSED_OPTIONS['average_tokens_across_devices']}")
    if args.include_num_input_tokens_seen not in ("no", "non_padding", False):
        raise NotImplementedError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} counts padding, which depends on how "
            f"the batch is cut over the DP replicas and padded for the mesh; use 'non_padding' (counted exactly) or 'no'"
        )
    if args.train_sampling_strategy == "batch_rebalance":
        raise NotImplementedError(
            "train_sampling_strategy='batch_rebalance' deals examples to ranks by length, so the ranks of a CP group "
            "would hold different examples; use 'random', 'sequential' or 'group_by_length'"
        )
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    for name in ("cp_size", "sp_size", "tp_size"):
        size = getattr(parallelism, name, 1) or 1
        if size > 1:
            raise NotImplementedError(
                f"accelerate's parallelism_config has {name}={size}: mesh_cp does the context parallelism itself and "
                f"does not combine with accelerate's CP, SP or TP; build the layout with hf.parallel_from_accelerate "
                f"(which reads the same block) and leave {name} at 1 in what accelerate is given"
            )
    check_loss_inputs(trainer)
    if getattr(args, "use_liger_kernel", False):
        raise NotImplementedError(
            "use_liger_kernel=True replaces the model's loss and attention code, which mesh_cp does not check; set it "
            "to False"
        )


def _causal(model: torch.nn.Module) -> bool:
    """Whether every attached attention layer of ``model`` is causal (else the batches carry their padding as a
    mask: ``shard_batch(causal=False)``)."""
    config = getattr(model, "config", None)
    layers = [m for m in model.modules() if hasattr(m, "mesh_cp_attached")]
    return getattr(config, "is_causal", True) is not False and all(getattr(m, "is_causal", True) for m in layers)


def _is_trainer_default(trainer: Any) -> bool:
    """Whether ``trainer.data_collator`` is one ``transformers.Trainer`` picked for want of one (it gives no
    causal-LM labels: mesh_cp's :class:`PadExamples` stands in for it)."""
    from transformers import DataCollatorWithPadding, default_data_collator

    return trainer.data_collator is default_data_collator or type(trainer.data_collator) is DataCollatorWithPadding


def _pad_token_id(trainer: Any, given: int | None) -> int:
    """``pad_token_id`` as given, else the tokenizer's (TRL sets it), else the model config's."""
    if given is not None:
        return given
    for source in (getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)):
        source = getattr(source, "tokenizer", source)
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            return int(value)
    raise ValueError(
        "MeshCPTrainer needs a pad token id to pad rows to the mesh's length multiple: pass pad_token_id=..., or a "
        "processing_class (tokenizer) with a pad token"
    )


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
    require("deepspeed")
    shape = ds_attention_shape(model, cfg, ds_config.config) if cfg.tile == "auto" else None
    parallel = parallel_from_config(cfg, shape=shape)
    attach(model, parallel.mesh, **cfg.attention_options)
    return parallel
