"""TRL's ``DPOTrainer`` under a DP x CP layout (``hf.mesh_cp_trainer_class(trl.DPOTrainer)``): exactly the single
process's training (Note [Whole sequences under CP] in :mod:`mesh_cp.integrations.hf.scores`).

::

    DPOTrainer = hf.mesh_cp_trainer_class(trl.DPOTrainer)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(..., use_cpu=True), train_dataset=pairs,
                         processing_class=tokenizer, parallel=parallel)

Every CP rank of a DP replica collates the replica's pairs with TRL's collator (chosen rows, then rejected rows);
the policy's and the reference's fused calls run over the mesh and give every rank the per-token log-probs of the
full rows, which TRL sums per sequence, keeping chosen and rejected paired. Every loss type TRL has (a list with
``loss_weights`` included), ``ld_alpha``, ``use_weighting``, ``sync_ref_model`` and a PEFT adapter as reference are
TRL's own code on those sums. ``precompute_ref_log_probs=True`` computes the reference log-probs over the mesh as
well: each DP replica takes every ``dp_size``-th batch of the set and the replicas' results are gathered in the set's
order. TRL's ``padding_free`` is off in the supported releases (TRL pads instead and says so); vision datasets and
MoE router losses are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from mesh_cp.integrations.hf.evaluation import ReplicaBatches
from mesh_cp.integrations.hf.sequence_trainer import MeshCPSequenceTrainerMixin


class MeshCPDPOMixin(MeshCPSequenceTrainerMixin):
    """What :func:`~mesh_cp.integrations.hf.mesh_cp_trainer_class` adds to TRL's ``DPOTrainer`` (module doc)."""

    mesh_cp_pairs = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "_is_vision_dataset", False):
            raise NotImplementedError(
                f"{type(self).__name__}: a vision dataset's images and image tokens are not split over the CP ranks; "
                f"train it without CP"
            )

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """``dataset`` with TRL's ``ref_chosen_logps`` and ``ref_rejected_logps`` columns, computed over the mesh (TRL
        splits the batches over every process and gathers them, so the ranks of a CP group would hold different
        rows): DP replica ``d`` computes batches ``d, d + dp_size, ...`` of the set in its order, with TRL's collator
        and ``compute_ref_log_probs``, and the replicas' values are gathered over the DP group."""
        from torch.utils.data import IterableDataset

        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
                "Dataset or set `precompute_ref_log_probs=False`."
            )
        self.mesh_cp_attach()
        parallel = self.parallel
        model = self.ref_model if self.ref_model is not None else self.model
        batches = ReplicaBatches(
            range(len(dataset)), batch_size, replica=parallel.dp_rank, replicas=parallel.dp_size, drop_last=False
        )
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=self.data_collator)
        mine: list[tuple[int, float, float]] = []
        for index, batch in enumerate(loader):
            batch = {k: v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            chosen, rejected = self.compute_ref_log_probs(model, batch)
            if index < batches.real_batches:
                mine += zip(batches.batches[index], chosen.float().tolist(), rejected.float().tolist(), strict=True)
        every: list[Any] = [None] * parallel.dp_size
        dist.all_gather_object(every, mine, group=parallel.dp_group)
        values = dict((row, (c, r)) for part in every for row, c, r in part)
        if sorted(values) != list(range(len(dataset))):
            raise RuntimeError(f"reference log-probs of {name}: {len(values)} of {len(dataset)} rows computed")
        ordered = [values[row] for row in range(len(dataset))]
        dataset = dataset.add_column("ref_chosen_logps", [c for c, _ in ordered])
        return dataset.add_column("ref_rejected_logps", [r for _, r in ordered])
