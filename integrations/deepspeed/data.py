"""``engine.training_dataloader`` under context parallelism: DeepSpeed's own ``DeepSpeedDataLoader``
(``engine.deepspeed_io``) with a sampler over the DP replicas and a collate that shards each batch for the
CP group.

::

    engine, _, loader, _ = mesh_ds.initialize(model=model, model_parameters=model.parameters(),
                                              training_data=dataset, config=ds_config)
    cp = engine.mesh_attention
    for epoch in range(epochs):
        loader.data_sampler.set_epoch(epoch)
        for batch in loader:                          # a ShardedBatch on engine.device, as cp.shard returns
            logits = engine(input_ids=batch.input_ids, position_ids=batch.position_ids, mesh_cp_mask=batch.mask).logits
            engine.backward(cp.loss(logits, batch))
            engine.step()

The sampler is DeepSpeed's default one, a ``DistributedSampler`` (shuffled, seed 0, no drop_last), over the
``dp_size`` replicas instead of all DP x CP ranks: every rank of a CP group draws the same examples, the
replicas disjoint ones. Batch size (``train_micro_batch_size_per_gpu``), ``dataloader_drop_last`` and the
throughput timer are DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mesh_cp.runtime.batch import ShardedBatch, pad_batch, shard_batch
from mesh_cp.runtime.mesh import CPMesh

FIELDS = ("input_ids", "labels", "attention_mask")
"""What the collate shards: token ids, labels (default: the ids; ``-100``: no label), the padding mask."""


class ShardingCollate:
    """The ``collate_fn`` of ``engine.training_dataloader``: examples to this rank's :class:`ShardedBatch`.

    The examples (token id sequences, or mappings of :data:`FIELDS`) are right-padded into a ``(batch, seq)``
    batch, or ``collate_fn`` (the user's, given to :func:`initialize`) collates them into one: a ``(batch,
    seq)`` tensor of token ids or a mapping of :data:`FIELDS`. The batch is then right-padded to a multiple of
    the mesh's ``seq_multiple`` (:func:`mesh_cp.runtime.batch.pad_batch`: token 0, no label, ``attention_mask``
    0; no real token attends to it), its labels shifted on the full sequence and this rank's shard put on
    ``device`` (:func:`mesh_cp.shard_batch`, the same as :meth:`MeshAttention.shard`).
    """

    def __init__(self, mesh: CPMesh, *, device: torch.device | str | None = None, collate_fn: Callable | None = None):
        self.mesh, self.device, self.collate_fn = mesh, device, collate_fn
        self.multiple = mesh.seq_multiple("zigzag")

    def __call__(self, examples: Sequence[Any]) -> ShardedBatch:
        if self.collate_fn is None:
            rows = [_fields(e, "a training_data example") for e in examples]
        else:
            batch = _fields(self.collate_fn(examples), "the collate_fn's batch", batched=True)
            rows = [dict(zip(batch, row, strict=True)) for row in zip(*batch.values(), strict=True)]
        ids, labels, mask = pad_batch(
            [r["input_ids"] for r in rows],
            [r.get("labels", r["input_ids"]) for r in rows],
            [r.get("attention_mask", torch.ones_like(r["input_ids"])) for r in rows],
            multiple=self.multiple,
        )
        return shard_batch(ids, mesh=self.mesh, labels=labels, attention_mask=mask, device=self.device)


def _fields(value: Any, what: str, *, batched: bool = False) -> dict[str, Tensor]:
    """``value``'s :data:`FIELDS` as long tensors (one example: 1-D, a batch: 2-D); other keys are refused."""
    if not isinstance(value, Mapping):
        value = {"input_ids": value}
    extra = sorted(str(k) for k in value if k not in FIELDS)
    if extra or "input_ids" not in value:
        raise ValueError(
            f"{what} has keys {sorted(map(str, value))}: the context-parallel collate shards only {list(FIELDS)} "
            f"(input_ids required){f' and cannot shard {extra}' if extra else ''}; give examples (or a collate_fn "
            f"returning a batch) with just those, or shard other inputs yourself through engine.mesh_attention.shard"
        )
    out = {k: torch.as_tensor(value[k], dtype=torch.long) for k in FIELDS if value.get(k) is not None}
    dims = 2 if batched else 1
    for key, t in out.items():
        if t.dim() != dims or t.shape != out["input_ids"].shape:
            raise ValueError(
                f"{what}'s {key} has shape {tuple(t.shape)}: expected {'(batch, seq)' if batched else '(seq,)'} "
                f"tensors of one shape, input_ids' {tuple(out['input_ids'].shape)}"
            )
    return out


def training_dataloader(engine, dataset: Any, mesh_attention, collate_fn: Callable | None = None):
    """DeepSpeed's ``DeepSpeedDataLoader`` over ``dataset`` for this DP replica (see the module doc).

    No loader workers and no pinning: the collate copies only this rank's shard to ``engine.device`` in the
    main process (a forked worker cannot put tensors on a GPU), so batches arrive where the engine runs."""
    parallel = mesh_attention.parallel
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=parallel.dp_size, rank=parallel.dp_rank)
    collate = ShardingCollate(mesh_attention.mesh, device=engine.device, collate_fn=collate_fn)
    return engine.deepspeed_io(
        dataset, data_sampler=sampler, collate_fn=collate, pin_memory=False, num_local_io_workers=0
    )


__all__ = ["FIELDS", "ShardingCollate", "training_dataloader"]
