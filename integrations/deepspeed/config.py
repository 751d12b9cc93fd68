"""The ``"mesh_attention"`` block of a DeepSpeed config: loaded with the config, validated by
:class:`mesh_cp.config.MeshConfig` (the one validator of the block), and checked against the
``deepspeed.initialize`` arguments it replaces.

::

    "mesh_attention": {"enabled": true, "cp_size": 4, "tile": "2x2", "schedule": "overlap"}
    "mesh_attention": {"enabled": true, "cp_size": 8, "head_parallel": 2, "tile": "2x2"}   # head-parallel x mesh
"""

from __future__ import annotations

from typing import Any

import torch

from mesh_cp.config import BLOCK, MeshConfig


def load_config(
    args: Any, config: str | dict | None, config_params: str | dict | None
) -> tuple[dict, MeshConfig | None]:
    """The DeepSpeed config ``deepspeed.initialize`` would read (``args.deepspeed_config``, else ``config``,
    else ``config_params``: a path or a dict), loaded, and its block validated (``None`` when there is
    none), so that every error of the block is raised before DeepSpeed starts."""
    import deepspeed

    source = getattr(args, "deepspeed_config", None) or config or config_params
    if source is None:
        raise ValueError("no DeepSpeed config: pass config= (a path or a dict) or args.deepspeed_config")
    loaded = deepspeed.load_ds_config(source)
    return loaded, MeshConfig.from_ds_config(loaded)


def check_no_conflicts(loaded: dict, *, mpu: Any, mesh_param: Any) -> None:
    """An enabled block builds the DP x CP layout itself: refuse the ``deepspeed.initialize`` arguments and
    config keys that would build another one."""
    conflicts = {
        "mpu": mpu is not None,
        "mesh_param": mesh_param is not None,
        '"sequence_parallel_size" in the config': "sequence_parallel_size" in loaded,
    }
    if any(conflicts.values()):
        given = [name for name, on in conflicts.items() if on]
        raise ValueError(
            f'"{BLOCK}" builds the data-parallel x context-parallel layout itself, so {given} cannot be used with '
            f"it: leave out mpu/mesh_param/sequence_parallel_size (no tensor or pipeline model parallelism with "
            f"it yet)"
        )


def check_training_options(loaded: dict) -> None:
    """Refuse the DeepSpeed options an enabled block cannot keep exact: a gradient all-reduce that sums (the loss
    scaling of Note [DeepSpeed gradient averaging] relies on DeepSpeed's mean), elasticity and random-LTD (they
    size batches, or drop tokens, per rank of all DP x CP ranks), AutoTP and the checkpoint writer (they need
    another mpu)."""
    refused = {}
    op = loaded.get("gradient_allreduce_op", "mean")
    if str(op).lower() != "mean":
        refused['"gradient_allreduce_op"'] = f'{op!r}: the loss is scaled for DeepSpeed\'s mean; use "mean"'
    if loaded.get("elasticity", {}).get("enabled", False):
        refused['"elasticity"'] = "sizes batches over all DP x CP ranks as data-parallel ranks; switch it off"
    routing = loaded.get("data_efficiency", {}).get("data_routing", {})
    if routing.get("random_ltd", {}).get("enabled", False):
        refused['"data_routing": {"random_ltd"}'] = "drops tokens per rank, not per sequence; switch it off"
    if (loaded.get("tensor_parallel", {}).get("autotp_size") or 1) > 1:
        refused['"tensor_parallel": {"autotp_size"}'] = "replaces the DP x CP mpu with its own; leave it at 1"
    if loaded.get("checkpoint", {}).get("writer"):
        refused['"checkpoint": {"writer"}'] = "reads pipeline and data-parallel ranks the DP x CP mpu does not have"
    if refused:
        shown = "; ".join(f"{name} {why}" for name, why in refused.items())
        raise ValueError(f'"{BLOCK}" cannot keep these DeepSpeed options exact: {shown}')


def replica_batch_size(loaded: dict, cp_size: int) -> dict:
    """``loaded`` with ``train_batch_size`` (sequences per step over the DP replicas, as without CP) counted the way
    DeepSpeed counts it under the block: over all DP x CP ranks, ``cp_size`` times as many (its gradient
    accumulation steps and micro batch come out as without CP); unchanged without one."""
    total = loaded.get("train_batch_size")
    if not isinstance(total, int) or isinstance(total, bool):
        return loaded
    return {**loaded, "train_batch_size": total * cp_size}


def check_training_data(loaded: dict, training_data: Any, collate_fn: Any) -> None:
    """``training_data`` under an enabled block: a map-style dataset (sampled over the DP replicas), and no
    DeepSpeed curriculum sampler (it would replace that sampler and split over all DP x CP ranks);
    ``collate_fn`` only with it (it collates the examples that are then sharded)."""
    if training_data is None:
        if collate_fn is not None:
            raise ValueError(
                f'"{BLOCK}": collate_fn without training_data: it collates the examples of training_data before '
                f"they are sharded for the CP group (engine.deepspeed_io would sample over all DP x CP ranks); pass "
                f"training_data with it, or collate yourself and shard through engine.mesh_attention.shard"
            )
        return
    if isinstance(training_data, torch.utils.data.IterableDataset) or not (
        hasattr(training_data, "__getitem__") and hasattr(training_data, "__len__")
    ):
        raise ValueError(
            f'"{BLOCK}": training_data {type(training_data).__name__} is not a map-style dataset (__getitem__ and '
            f"__len__), which the loader samples over the DP replicas; pass one, or feed each DP replica's batches "
            f"(engine.mesh_attention.parallel.dp_rank of dp_size; the same batch on every rank of a CP group) "
            f"through engine.mesh_attention.shard"
        )
    sampling = loaded.get("data_efficiency", {}).get("data_sampling", {})
    if sampling.get("curriculum_learning", {}).get("enabled", False):
        raise ValueError(
            f'"{BLOCK}": training_data with "data_efficiency": {{"data_sampling": {{"curriculum_learning": '
            f'{{"enabled": true}}}}}}: '
            f"DeepSpeed's curriculum sampler would split the data over all DP x CP ranks, not the DP replicas; switch curriculum learning off, or leave out training_data and shard each DP "
            f"replica's batches through engine.mesh_attention.shard"
        )


__all__ = [
    "BLOCK",
    "MeshConfig",
    "check_no_conflicts",
    "check_training_data",
    "check_training_options",
    "load_config",
    "replica_batch_size",
]
