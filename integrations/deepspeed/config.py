"""The ``"mesh_attention"`` block of a DeepSpeed config: loaded with the config, validated by
:class:`mesh_cp.config.MeshConfig` (the one validator of the block), and checked against the
``deepspeed.initialize`` arguments it replaces.

::

    "mesh_attention": {"enabled": true, "cp_size": 4, "tile": "2x2", "schedule": "overlap"}
    "mesh_attention": {"enabled": true, "cp_size": 8, "heads": 2, "tile": "2x2"}   # head-parallel x mesh
"""

from __future__ import annotations

from typing import Any

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


def check_no_conflicts(loaded: dict, *, mpu: Any, mesh_param: Any, training_data: Any) -> None:
    """An enabled block builds the DP x CP layout itself: refuse the ``deepspeed.initialize`` arguments and
    config keys that would build another one, or feed batches past :meth:`MeshAttention.shard`."""
    conflicts = {
        "mpu": mpu is not None,
        "mesh_param": mesh_param is not None,
        "training_data": training_data is not None,
        '"sequence_parallel_size" in the config': "sequence_parallel_size" in loaded,
    }
    if any(conflicts.values()):
        given = [name for name, on in conflicts.items() if on]
        raise ValueError(
            f'"{BLOCK}" builds the data-parallel x context-parallel layout itself, so {given} cannot be used with '
            f"it: leave out mpu/mesh_param/sequence_parallel_size (no tensor or pipeline model parallelism with "
            f"it yet), and instead of training_data feed each DP replica's batches (engine.mesh_attention.parallel."
            f"dp_rank of dp_size; the same batch on every rank of a CP group) through engine.mesh_attention.shard"
        )


__all__ = ["BLOCK", "MeshConfig", "check_no_conflicts", "load_config"]
