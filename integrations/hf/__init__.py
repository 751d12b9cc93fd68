"""Hugging Face transformers: the ``mesh_cp`` attention implementation and exact sequence sharding.

::

    import mesh_cp
    from mesh_cp.integrations import hf

    hf.register()                                     # once per process (idempotent)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mesh_cp")
    hf.attach(model, mesh)                            # every attention layer runs over this CP mesh
    batch = hf.shard_batch(input_ids, mesh=mesh)      # this rank's input_ids, global position_ids, shift_labels
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()                                   # then sum parameter gradients over the CP group

Each rank's ``loss`` is its share of the global mean (token losses summed over its shard, divided by
the label count of the whole sequence), so the loss is the sum over the CP group and so is every
parameter gradient (:func:`reduce_gradients`). Labels are shifted on the *full* sequence before
sharding, so the last token of every shard keeps its label.

What is supported is checked, never dropped: a padding mask is accepted only when it pads on the
right (exact under causal attention, the padded tokens get no label); left or inner padding, 4-D
masks, sliding windows, softcapping and attention dropout raise with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

import mesh_cp
from mesh_cp.core.plan import BACKWARD_MODES
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.schedules import SCHEDULES

NAME = "mesh_cp"
IGNORE_INDEX = -100


def mesh_cp_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: ``query (B, Hq, S, D)``, ``key/value (B, Hkv, S, D)`` of this
    rank's shard -> ``((B, S, Hq, D), None)`` over the whole sequence of the module's CP mesh."""
    mesh = getattr(module, "mesh_cp_mesh", None)
    if mesh is None:
        raise ValueError(
            f"{type(module).__name__} uses attn_implementation='mesh_cp' but has no CP mesh; "
            f"call mesh_cp.integrations.hf.attach(model, mesh) after building the model"
        )
    if attention_mask is not None:
        raise ValueError(
            f"mesh_cp attention got a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)}; "
            f"only causal or full attention is supported: drop the mask, or right-pad and use shard_batch"
        )
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"sliding_window={kwargs['sliding_window']} is not supported by mesh_cp yet; set config.sliding_window=None "
            f"(or use_sliding_window=False) for full attention"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"attention softcap {kwargs['softcap']} is not supported by mesh_cp yet")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = mesh_cp.mesh_attn_func(
        q,
        k,
        v,
        mesh=mesh,
        causal=bool(getattr(module, "is_causal", True)),
        softmax_scale=scaling,
        **getattr(module, "mesh_cp_options", {}),
    )
    return out, None


def mesh_cp_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> None:
    """transformers mask function: no mask is built (the mesh applies causality itself); a 2-D padding
    mask with any zero is refused — :func:`shard_batch` turns right padding into ignored labels."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "mesh_cp attention does not take padding masks: right-pad the batch and pass attention_mask to "
            "mesh_cp.integrations.hf.shard_batch (padded tokens then get no label), not to the model"
        )
    return None


def register() -> None:
    """Register ``attn_implementation="mesh_cp"`` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, mesh_cp_attention)
    AttentionMaskInterface.register(NAME, mesh_cp_mask)


def attach(
    model: torch.nn.Module, mesh: CPMesh, *, schedule: str = "overlap", backward: str = "regather"
) -> torch.nn.Module:
    """Switch ``model`` to ``attn_implementation="mesh_cp"`` and give every attention layer ``mesh``
    (and the ``schedule`` and ``backward`` of :func:`mesh_cp.mesh_attn_func`)."""
    if not isinstance(mesh, CPMesh):
        raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not supported; choose one of {sorted(SCHEDULES)}")
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward {backward!r} is not supported; choose one of {sorted(BACKWARD_MODES)}")
    register()
    model.set_attn_implementation(NAME)
    layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers (modules with is_causal) to attach to")
    for layer in layers:
        layer.mesh_cp_mesh = mesh
        layer.mesh_cp_options = {"schedule": schedule, "backward": backward}
    return model


@dataclass(frozen=True)
class ShardedBatch:
    """One CP rank's share of a causal-LM batch."""

    input_ids: Tensor
    """``(batch, seq_local)`` token ids of this rank's shard."""
    position_ids: Tensor
    """``(batch, seq_local)`` global positions (pass them to the model: it would number the shard from 0)."""
    shift_labels: Tensor
    """``(batch, seq_local)`` next-token labels, shifted on the full sequence; ``-100`` where none."""
    num_items_in_batch: int
    """Labels that count in the whole batch (every shard of this CP group together)."""


def shard_batch(
    input_ids: Tensor,
    *,
    mesh: CPMesh,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> ShardedBatch:
    """Shift labels on the full ``(batch, seq)`` sequence, then give this rank its shard (see module doc).

    ``labels`` default to ``input_ids``; ``-100`` marks tokens without a label. A right-padding
    ``attention_mask`` (ones then zeros per row) is exact under causal attention: the padded tokens
    get no label and no real token attends to them. Left or inner padding is refused.

    ``device``: where the returned tensors go (the device the training loop runs the model on);
    ``None`` keeps the input's device. The labels are counted and the shard cut where the inputs
    are, so inputs on the CPU (a ``DataLoader``'s) cost the accelerator no host synchronisation and
    only this rank's shard is copied.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    labels = labels.clone()
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
        keep = attention_mask.bool()
        if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
            raise ValueError(
                "attention_mask pads on the left or inside a sequence; mesh_cp supports right padding only "
                "(tokenizer padding_side='right')"
            )
        labels[~keep] = IGNORE_INDEX
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    device = input_ids.device if device is None else torch.device(device)
    positions = mesh_cp.position_ids(input_ids.shape[1], mesh=mesh, layout=layout, device=device)
    return ShardedBatch(
        input_ids=mesh_cp.shard_sequence(input_ids, mesh=mesh, dim=1, layout=layout).to(device),
        position_ids=positions.unsqueeze(0).expand(input_ids.shape[0], -1),
        shift_labels=mesh_cp.shard_sequence(shift, mesh=mesh, dim=1, layout=layout).to(device),
        num_items_in_batch=int((shift != IGNORE_INDEX).sum()),
    )


class ShardingCollator:
    """``DataLoader`` collate function: right-pad examples to a length the layout accepts, shift labels
    on the full sequences, and return this CP rank's shard, ready for ``model(**batch)``.

    Every rank of a CP group must see the same examples (same sampler seed, no DP split inside the
    group). The batch holds ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (both the
    shifted labels: transformers' causal-LM loss uses ``shift_labels`` when given) and
    ``num_items_in_batch``, so the model's own ``loss`` is this rank's share of the global mean.
    ``device``: where the batch's tensors go (``None``: the CPU, where the collator builds them).
    """

    def __init__(
        self,
        mesh: CPMesh,
        *,
        pad_token_id: int,
        layout: str = "zigzag",
        pad_to_multiple_of: int = 1,
        device: torch.device | str | None = None,
    ):
        if not isinstance(mesh, CPMesh):
            raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.mesh, self.pad_token_id, self.layout = mesh, pad_token_id, layout
        self.device = None if device is None else torch.device(device)
        parts = 2 * mesh.size if layout == "zigzag" else mesh.size
        self.multiple = math.lcm(parts, pad_to_multiple_of)

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]] | Sequence[int]]) -> dict[str, Tensor]:
        ids = [torch.as_tensor(e["input_ids"] if isinstance(e, Mapping) else e, dtype=torch.long) for e in examples]
        labels = [
            torch.as_tensor(e["labels"], dtype=torch.long) if isinstance(e, Mapping) and "labels" in e else i
            for e, i in zip(examples, ids, strict=True)
        ]
        length = -(-max(len(i) for i in ids) // self.multiple) * self.multiple
        input_ids = torch.full((len(ids), length), self.pad_token_id, dtype=torch.long)
        label_ids = torch.full_like(input_ids, IGNORE_INDEX)
        mask = torch.zeros_like(input_ids)
        for row, (i, lab) in enumerate(zip(ids, labels, strict=True)):
            input_ids[row, : len(i)], label_ids[row, : len(lab)], mask[row, : len(i)] = i, lab, 1
        batch = shard_batch(
            input_ids, mesh=self.mesh, labels=label_ids, attention_mask=mask, layout=self.layout, device=self.device
        )
        return {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            "labels": batch.shift_labels,
            "shift_labels": batch.shift_labels,
            "num_items_in_batch": torch.tensor(batch.num_items_in_batch, device=batch.input_ids.device),
        }


def causal_lm_loss(logits: Tensor, shift_labels: Tensor, num_items_in_batch: int) -> Tensor:
    """This rank's share of the mean next-token loss: its token losses summed, over the global count."""
    if num_items_in_batch < 1:
        raise ValueError(f"num_items_in_batch must be >= 1 (labels that count in the batch), got {num_items_in_batch}")
    summed = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return summed / num_items_in_batch


def reduce_gradients(model: torch.nn.Module, mesh: CPMesh) -> None:
    """Sum every parameter gradient over the CP group (each rank holds the gradient of its loss share)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=mesh.group)


@dataclass(frozen=True, eq=False)
class DataContextParallel:
    """Data parallel x context parallel over a process group: CP inner, DP outer.

    Rank ``r`` of ``group`` is CP rank ``r % cp_size`` of data-parallel replica ``r // cp_size``; each
    replica's CP group is tiled as a :class:`CPMesh`. Gradients are summed over the CP group (the loss
    is split across it) and averaged over the replicas, in one all-reduce over ``group``.
    """

    mesh: CPMesh
    """This replica's CP mesh."""
    group: dist.ProcessGroup
    """All DP x CP ranks."""
    dp_group: dist.ProcessGroup
    """The ranks holding the same CP rank in every replica."""
    dp_size: int
    dp_rank: int

    @classmethod
    def create(cls, group: dist.ProcessGroup, *, cp_size: int, tile, **mesh_options) -> DataContextParallel:
        """Split ``group`` into ``size / cp_size`` replicas of ``cp_size`` consecutive ranks; ``tile`` and
        ``mesh_options`` (``topology``, ``shape``, ``memory_budget``) go to :meth:`CPMesh.create`."""
        if group is None:
            raise ValueError("group=None is not accepted: pass the process group to split (e.g. dist.group.WORLD)")
        world = dist.get_world_size(group)
        if not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"cp_size {cp_size!r} must divide the {world} ranks of the group; choose one of {divisors}"
            )
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        dp_rank, cp_rank = divmod(me, cp_size)
        backend = dist.get_backend(group)
        # Every rank creates its CP group, then its DP group; groups of one kind are disjoint.
        cp_group = dist.new_group(
            ranks[dp_rank * cp_size : (dp_rank + 1) * cp_size], backend=backend, use_local_synchronization=True
        )
        dp_group = dist.new_group(ranks[cp_rank::cp_size], backend=backend, use_local_synchronization=True)
        mesh = CPMesh.create(cp_group, tile=tile, **mesh_options)
        return cls(mesh=mesh, group=group, dp_group=dp_group, dp_size=world // cp_size, dp_rank=dp_rank)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum gradients over CP and average them over DP (one all-reduce over all DP x CP ranks)."""
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.dp_size)

    def __str__(self) -> str:
        return f"DP({self.dp_size}) x {self.mesh}, replica {self.dp_rank}"


def mesh_cp_trainer_class():
    """``transformers.Trainer`` subclass that trains with a :class:`DataContextParallel` layout.

    ``MeshCPTrainer(model=..., args=..., train_dataset=..., layout=layout, pad_token_id=...)``: attaches
    the layout's mesh to the model, feeds every rank of a CP group the same examples (a
    ``DistributedSampler`` over the DP replicas) through :class:`ShardingCollator`, and lets Trainer's
    own token counting do the rest: with ``average_tokens_across_devices`` (required) the loss is the
    model's sum over this rank's tokens over the label count of all ranks, times the world size, so
    the DDP gradient mean over all DP x CP ranks is the gradient of the global mean loss. Evaluation
    and prediction raise (Trainer gathers them as if every rank held different examples).

    With DeepSpeed (``TrainingArguments(deepspeed="ds_config.json")``, or ``--deepspeed`` on the command
    line) leave ``layout`` out: the trainer builds it from the config's ``"mesh_attention"`` block
    (:mod:`mesh_cp.integrations.deepspeed`), and DeepSpeed's gradient mean over all ranks is exact at
    every ZeRO stage for the same reason.
    """
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import Trainer

    class MeshCPTrainer(Trainer):
        def __init__(self, *args, layout: DataContextParallel | None = None, pad_token_id: int, **kwargs):
            if args:
                raise ValueError("MeshCPTrainer takes keyword arguments only (model=..., args=..., ...)")
            if layout is None:
                layout = _layout_from_deepspeed_args(kwargs.get("args"), kwargs.get("model"))
            elif isinstance(layout, DataContextParallel):
                attach(kwargs["model"], layout.mesh)
            else:
                raise ValueError(f"layout must be a DataContextParallel, got {type(layout).__name__}")
            kwargs.setdefault("data_collator", ShardingCollator(layout.mesh, pad_token_id=pad_token_id))
            super().__init__(**kwargs)
            if not self.args.average_tokens_across_devices:
                raise ValueError(
                    "MeshCPTrainer needs TrainingArguments(average_tokens_across_devices=True): the loss of a CP "
                    "rank is its share of the global token mean"
                )
            self.layout = layout

        def get_train_dataloader(self) -> DataLoader:
            if self.train_dataset is None:
                raise ValueError("Trainer: training requires a train_dataset.")
            sampler = DistributedSampler(
                self.train_dataset,
                num_replicas=self.layout.dp_size,
                rank=self.layout.dp_rank,
                shuffle=True,
                seed=self.args.seed,
            )
            return DataLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                sampler=sampler,
                collate_fn=self.data_collator,
                drop_last=self.args.dataloader_drop_last,
            )

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            raise NotImplementedError(
                "MeshCPTrainer trains only: Trainer's evaluation loop gathers predictions as if every rank held "
                "different examples, which CP ranks do not; evaluate the trained model without CP"
            )

        def get_test_dataloader(self, test_dataset) -> DataLoader:
            return self.get_eval_dataloader(test_dataset)

    return MeshCPTrainer


def _layout_from_deepspeed_args(training_args, model) -> DataContextParallel:
    """The layout of an enabled ``"mesh_attention"`` block in ``training_args.deepspeed`` (model switched)."""
    ds_config = getattr(training_args, "hf_deepspeed_config", None)
    if ds_config is None:
        raise ValueError(
            "MeshCPTrainer needs layout=DataContextParallel.create(...), or TrainingArguments(deepspeed=...) whose "
            'config has an enabled "mesh_attention" block'
        )
    from mesh_cp.integrations.deepspeed import layout_from_config

    mesh_attention = layout_from_config(ds_config.config, model)
    if mesh_attention is None:
        raise ValueError(
            'the DeepSpeed config has no enabled "mesh_attention" block: add {"enabled": true, "cp_size": ..., '
            '"tile": ...} to it, or pass layout= to MeshCPTrainer'
        )
    return mesh_attention.layout
