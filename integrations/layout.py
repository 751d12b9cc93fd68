"""What the adapters share of a config block: the DP x CP layout it asks for and the attention shape its
``"tile": "auto"`` predicts for (read by the DeepSpeed adapter and by the Hugging Face ``Trainer`` given a DeepSpeed
config)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mesh_cp.config import BLOCK, MeshConfig
from mesh_cp.core import AttentionShape, most_square_tile


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (``False`` when transformers is not installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def parallel_from_config(config: MeshConfig, group: Any = None, *, shape: AttentionShape | None = None) -> Any:
    """The :class:`mesh_cp.DataContextParallel` an enabled ``config`` asks for, over ``group`` (default: the world).

    A concrete tile without a topology is ``CPMesh.create``'s; ``"tile": "auto"`` or a ``"topology"`` go through
    :func:`mesh_cp.auto_mesh` (the cost model), which needs ``shape`` (the per-rank
    :class:`~mesh_cp.core.AttentionShape`) for ``"auto"``."""
    import torch.distributed as dist

    from mesh_cp.runtime import DataContextParallel

    if not config.enabled:
        raise ValueError(f"the mesh config is not enabled ({config}); set enabled=True to build a layout")
    group = dist.group.WORLD if group is None else group
    tile = config.tile_for(dist.get_world_size(group))
    if tile != "auto" and config.topology is None:
        return DataContextParallel.create(
            group, cp_size=config.cp_size, tile=tile, head_parallel=config.head_parallel or 1
        )
    from mesh_cp.auto import auto_mesh

    options = {"topology": config.topology, "shape": shape, "tile": tile, "head_parallel": config.head_parallel}
    return DataContextParallel.create(group, cp_size=config.cp_size, mesh=lambda cp: auto_mesh(cp, **options))


def check_ds_engine(engine: Any, parallel: Any) -> None:
    """Refuse a DeepSpeed engine that does not see ``parallel``'s DP x CP ranks as its data-parallel group.

    mesh_cp's loss scaling (Note [DeepSpeed gradient averaging]) relies on DeepSpeed averaging over exactly the ranks
    of ``parallel.group`` (a :class:`mesh_cp.DataContextParallel`), with no sequence or model parallelism of its own.
    The engine's ``dp_world_size``, ``seq_dp_world_size`` (ZeRO-3 partitions over that group) and the ranks of its
    ``data_parallel_group`` are compared with the layout's; any other world (an engine built without the layout's
    ``mpu``, a layout built on another group, a rank that sees a world of its own) is refused naming both sizes."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(parallel.group)
    seen = {
        "dp_world_size": engine.dp_world_size,
        "seq_dp_world_size": getattr(engine, "seq_dp_world_size", engine.dp_world_size),
        "data_parallel_group ranks": dist.get_process_group_ranks(engine.data_parallel_group),
        "sequence_parallel_size": getattr(engine, "sequence_parallel_size", 1),
        "mp_world_size": getattr(engine, "mp_world_size", 1),
    }
    want = {**dict.fromkeys(("dp_world_size", "seq_dp_world_size"), len(ranks)), "data_parallel_group ranks": ranks}
    want |= {"sequence_parallel_size": 1, "mp_world_size": 1}
    wrong = {name: value for name, value in seen.items() if value != want[name]}
    if wrong:
        shown = ", ".join(f"{name} {value} (expected {want[name]})" for name, value in wrong.items())
        raise ValueError(
            f"the DeepSpeed engine sees another world than mesh_cp's DP x CP group of {len(ranks)} ranks {ranks} "
            f"({parallel}): {shown}; its gradient average would not be the replicas' mean. Build the engine with "
            f"mesh_cp.integrations.deepspeed.initialize (it hands DeepSpeed the layout's mpu), over the ranks the "
            f"layout was built on, every rank launched alike (on CPU: DS_ACCELERATOR=cpu for the deepspeed launcher "
            f"and torchrun)"
        )


def ds_attention_shape(model: Any, config: MeshConfig, ds_config: Mapping[str, Any]) -> AttentionShape:
    """The per-rank :class:`~mesh_cp.core.AttentionShape` that ``"tile": "auto"`` of ``config`` (a
    :class:`mesh_cp.config.MeshConfig` with ``seq_len``) predicts for: heads and head size from the Hugging
    Face model config of ``model``, the micro batch (``train_micro_batch_size_per_gpu``, else 1) and the
    element size (2 bytes when ``bf16`` or ``fp16`` is enabled, else 4) from the DeepSpeed config
    ``ds_config``."""
    if not is_hf_model(model):
        raise ValueError(
            f'"{BLOCK}": "tile": "auto" reads heads and head size from a Hugging Face model config; '
            f"{type(model).__name__} has none: give a tile such as "
            f'"{"x".join(map(str, most_square_tile(config.cp_size)))}"'
        )
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    half = any(ds_config.get(k, {}).get("enabled") is True for k in ("bf16", "fp16"))
    c = model.config
    heads = c.num_attention_heads
    return AttentionShape(
        batch=micro if isinstance(micro, int) else 1,
        seq_local=config.seq_len // config.cp_size,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        itemsize=2 if half else 4,
    )
