"""DeepSpeed: switch Mesh-Attention on with a ``"mesh_attention"`` block in the DeepSpeed config.

::

    # ds_config.json: {..., "zero_optimization": {"stage": 3},
    #                  "mesh_attention": {"enabled": true, "cp_size": 4, "tile": "2x2"}}
    from mesh_cp.integrations import deepspeed as mesh_ds

    engine, optimizer, _, _ = mesh_ds.initialize(model=model, model_parameters=model.parameters(),
                                                 config="ds_config.json")      # deepspeed.initialize's signature
    cp = engine.mesh_attention                                                 # MeshAttention
    batch = cp.shard(input_ids, device=engine.device)   # this DP replica's (batch, seq), same on its CP ranks
    logits = engine(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    engine.backward(cp.loss(logits, batch))
    engine.step()

:func:`initialize` reads the block (:class:`MeshAttentionConfig`, every error raised before DeepSpeed
starts), splits the ranks into DP x CP replicas (:class:`~mesh_cp.integrations.hf.DataContextParallel`:
``cp_size`` consecutive ranks per replica, tiled ``tile``), switches the model's attention, and hands
DeepSpeed an ``mpu`` (:class:`DataContextParallelMPU`) whose data-parallel group holds *all* DP x CP
ranks. Hugging Face models switch to ``attn_implementation="mesh_cp"``; any other model uses
:class:`MeshDistributedAttention` (shaped like ``deepspeed.sequence.layer.DistributedAttention``)
where it computes attention.

Gradients (see Note [DeepSpeed gradient averaging]) are those of the mean over DP replicas of each
replica's token-mean loss, at every ZeRO stage: the same as DeepSpeed data parallelism without CP on
the same global batches. DeepSpeed counts every CP rank as a data-parallel rank, so its
``train_batch_size`` is ``micro_batch x gradient_accumulation x world`` although a step trains on
``micro_batch x gradient_accumulation x (world / cp_size)`` sequences.

With the Hugging Face ``Trainer``, pass the same config to ``TrainingArguments(deepspeed=...)`` and
use :func:`mesh_cp.integrations.hf.mesh_cp_trainer_class` without a ``layout``: it reads the block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError
from torch import Tensor

import mesh_cp
from mesh_cp.core import AttentionShape, Tiling, most_square_tile
from mesh_cp.integrations import hf
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh

BLOCK = "mesh_attention"

# Note [DeepSpeed gradient averaging]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed averages gradients over the data-parallel group of its mpu (the world without one).
# mesh_cp gives it all DP x CP ranks: measured on DeepSpeed 0.19.8, that group averages correctly at
# ZeRO 0-3, while an mpu exposing sequence-parallel methods makes ZeRO-3 average over a different
# group and a DP-only group gives ZeRO-3 wrong gradients. A CP rank's share of its replica's
# token-mean loss, s_r = (sum of its token losses) / (labels of the replica), sums to the replica's
# loss over the CP group; so the rank back-propagates cp_size * s_r, and DeepSpeed's mean over all
# dp * cp ranks, (1/dp) sum_replicas (1/cp) sum_cp cp * s_r, is the mean of the replicas' losses.


class MeshAttentionConfig(BaseModel):
    """The ``"mesh_attention"`` block of a DeepSpeed config (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    cp_size: PositiveInt | None = None
    """Ranks per context-parallel group (consecutive ranks); must divide the world size."""
    tile: str | None = None
    """``"AxB"`` with ``A * B = cp_size``, or ``"auto"`` (needs ``topology`` and ``seq_len``); default the most
    square tile."""
    schedule: Literal["overlap", "collective"] = "overlap"
    backward: Literal["regather", "reuse"] = "regather"
    topology: str | None = None
    """A :class:`mesh_cp.sim.Topology` preset (``"h100"``, ``"a100"``): orders the overlapped schedule's
    transfers by link speed, and is what ``tile="auto"`` predicts for."""
    seq_len: PositiveInt | None = None
    """Tokens per sequence (the whole sequence, before sharding); needed by ``tile="auto"``."""

    @classmethod
    def from_ds_config(cls, config: dict[str, Any]) -> MeshAttentionConfig | None:
        """Validate the block of a loaded DeepSpeed config; ``None`` when there is none."""
        block = config.get(BLOCK)
        if block is None:
            return None
        if not isinstance(block, dict):
            raise ValueError(f'"{BLOCK}" must be a JSON object, got {block!r}')
        try:
            parsed = cls(**block)
        except ValidationError as err:
            raise ValueError(_describe(err)) from None
        if parsed.enabled:
            parsed.check()
        return parsed

    def check(self) -> None:
        """The checks that need no process group (``cp_size`` against the world is :meth:`tiling`'s)."""
        if self.cp_size is None:
            raise ValueError(f'"{BLOCK}": "enabled": true needs "cp_size" (ranks per context-parallel group)')
        if self.tile == "auto":
            missing = [k for k in ("topology", "seq_len") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f'"{BLOCK}": "tile": "auto" predicts the fastest tile and needs {missing} '
                    f'(for example "topology": "h100", "seq_len": 131072), or give a tile such as "2x2"'
                )
        elif self.tile is not None:
            Tiling.parse(self.tile, self.cp_size)
        if self.topology is not None:
            from mesh_cp.sim import Topology

            Topology.preset(self.topology)
        if self.seq_len is not None and self.seq_len % (2 * self.cp_size):
            raise ValueError(
                f'"{BLOCK}": "seq_len" {self.seq_len} must be a multiple of 2 * cp_size = {2 * self.cp_size} '
                f"(the zig-zag layout gives every rank two equal half-chunks)"
            )

    def tile_for(self, world: int) -> str | tuple[int, int]:
        """The tile to build, after checking that ``cp_size`` divides ``world``."""
        if world % self.cp_size:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f'"{BLOCK}": "cp_size" {self.cp_size} does not divide the {world} ranks; choose one of {divisors}'
            )
        return self.tile or most_square_tile(self.cp_size)


def _describe(err: ValidationError) -> str:
    known = ", ".join(MeshAttentionConfig.model_fields)
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f'unknown key "{where}" (the keys are: {known})')
        else:
            lines.append(f'"{where}": {e["msg"]}, got {e.get("input")!r}')
    return f'invalid "{BLOCK}" block in the DeepSpeed config: ' + "; ".join(lines)


class DataContextParallelMPU:
    """The ``mpu`` DeepSpeed gets: data parallelism over all DP x CP ranks, no model parallelism.

    It deliberately exposes no ``get_sequence_parallel_*`` methods (see Note [DeepSpeed gradient
    averaging]); its model-parallel group is this rank alone. Constructing it is collective over
    ``layout.group``: the singletons are subgroups of it (:func:`mesh_cp.runtime.groups.new_subgroups`, a split
    of that group when the default group is bound to a GPU, as DeepSpeed binds it on CUDA).
    """

    def __init__(self, layout: hf.DataContextParallel):
        self.layout = layout
        ranks = dist.get_process_group_ranks(layout.group)
        self._alone = new_subgroups(layout.group, [[r] for r in ranks])

    def get_data_parallel_group(self):
        return self.layout.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.layout.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.layout.group)

    def get_model_parallel_group(self):
        return self._alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class MeshAttention:
    """The mesh an engine trains with (``engine.mesh_attention``): sharding and the loss to back-propagate."""

    config: MeshAttentionConfig
    layout: hf.DataContextParallel

    @property
    def mesh(self) -> CPMesh:
        return self.layout.mesh

    def shard(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> hf.ShardedBatch:
        """This rank's shard of its replica's ``(batch, seq)`` batch (every rank of the CP group passes the
        same batch); labels are shifted on the full sequence, right padding is exact.

        ``device``: where the shard goes, the engine's (``engine.device``: DeepSpeed moved the model there);
        ``None`` keeps the input's device. The batch is cut where it is (the host, for a data loader's) and
        only this rank's shard is copied."""
        return hf.shard_batch(input_ids, mesh=self.mesh, labels=labels, attention_mask=attention_mask, device=device)

    def loss(self, logits: Tensor, batch: hf.ShardedBatch) -> Tensor:
        """The loss to pass to ``engine.backward``: ``cp_size`` times this rank's share of its replica's
        token-mean loss (see Note [DeepSpeed gradient averaging])."""
        return hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch) * self.mesh.size

    def mean_loss(self, loss: Tensor) -> float:
        """The step's loss, the mean over replicas of their token-mean losses, from every rank's :meth:`loss`
        (collective over all ranks)."""
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=self.layout.group)
        return total.item() / dist.get_world_size(self.layout.group)  # host sync: printed


class MeshDistributedAttention(torch.nn.Module):
    """Context-parallel attention for models that are not Hugging Face models, in the place and with the
    call of ``deepspeed.sequence.layer.DistributedAttention``.

    ``MeshDistributedAttention(local_attention, causal=True)(query, key, value, batch_dim_idx)`` takes this
    rank's shard, ``(batch, seq_local, heads, head_dim)`` when ``batch_dim_idx == 0`` or ``(seq_local,
    batch, heads, head_dim)`` when it is 1, with K/V of ``kv_heads`` heads and RoPE already applied at the
    tokens' global positions, and returns the attention output in the same layout. :func:`initialize`
    attaches the mesh; without one (no ``mesh_attention`` block) it calls ``local_attention(query, key,
    value, *args, **kwargs)`` on the whole sequence, so the same model runs with and without CP.
    """

    def __init__(self, local_attention: torch.nn.Module | None = None, *, causal: bool = True, softmax_scale=None):
        super().__init__()
        self.local_attn = local_attention
        self.causal, self.softmax_scale = causal, softmax_scale
        self.mesh: CPMesh | None = None
        self.options: dict[str, Any] = {}

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int = 0, rotary_pos_emb=None, *args, **kwargs
    ):
        if self.mesh is None:
            if self.local_attn is None:
                raise ValueError(
                    "MeshDistributedAttention has no mesh (initialize with a mesh_attention block) and no "
                    "local_attention to fall back on"
                )
            return self.local_attn(query, key, value, *args, **kwargs)
        if rotary_pos_emb is not None:
            raise ValueError(
                "MeshDistributedAttention does not apply rotary_pos_emb: rotate query and key at their global "
                "positions (mesh_cp.position_ids) before calling it"
            )
        if args or kwargs:
            raise ValueError(
                f"MeshDistributedAttention computes causal or full softmax attention only; it got extra arguments "
                f"{len(args)} positional, {sorted(kwargs)} (masks, dropout, ...) it would have to drop"
            )
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 (batch, seq, ...) or 1 (seq, batch, ...), got {batch_dim_idx}")
        q, k, v = (t.transpose(0, 1) if batch_dim_idx == 1 else t for t in (query, key, value))
        out = mesh_cp.mesh_attn_func(
            q, k, v, mesh=self.mesh, causal=self.causal, softmax_scale=self.softmax_scale, **self.options
        )
        return out.transpose(0, 1) if batch_dim_idx == 1 else out


def _is_hf_model(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _attention_shape(model: torch.nn.Module, cfg: MeshAttentionConfig, micro_batch: int, itemsize: int):
    if not _is_hf_model(model):
        raise ValueError(
            f'"{BLOCK}": "tile": "auto" reads heads and head size from a Hugging Face model config; '
            f"{type(model).__name__} has none: give a tile such as "
            f'"{"x".join(map(str, most_square_tile(cfg.cp_size)))}"'
        )
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return AttentionShape(
        batch=micro_batch,
        seq_local=cfg.seq_len // cfg.cp_size,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        itemsize=itemsize,
    )


def switch_attention(model: torch.nn.Module, mesh: CPMesh, options: dict[str, Any]) -> None:
    """Run ``model``'s attention over ``mesh``: a Hugging Face model through ``attn_implementation="mesh_cp"``,
    any other through its :class:`MeshDistributedAttention` modules."""
    if _is_hf_model(model):
        hf.attach(model, mesh, **options)
        return
    modules = [m for m in model.modules() if isinstance(m, MeshDistributedAttention)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} is neither a Hugging Face model nor has MeshDistributedAttention modules: "
            f"compute its attention with mesh_cp.integrations.deepspeed.MeshDistributedAttention"
        )
    for m in modules:
        m.mesh, m.options = mesh, dict(options)


def layout_from_config(config: dict[str, Any], model: torch.nn.Module | None = None):
    """Build the DP x CP layout a DeepSpeed config's enabled ``"mesh_attention"`` block asks for (collective
    over the world) and, given ``model``, switch its attention; ``None`` when the block is absent or off."""
    cfg = MeshAttentionConfig.from_ds_config(config)
    if cfg is None or not cfg.enabled:
        return None
    tile = cfg.tile_for(dist.get_world_size())
    options: dict[str, Any] = {"topology": cfg.topology}
    if tile == "auto":
        micro = config.get("train_micro_batch_size_per_gpu")
        half = any(config.get(k, {}).get("enabled") is True for k in ("bf16", "fp16"))
        options["shape"] = _attention_shape(model, cfg, micro if isinstance(micro, int) else 1, 2 if half else 4)
    layout = hf.DataContextParallel.create(dist.group.WORLD, cp_size=cfg.cp_size, tile=tile, **options)
    if model is not None:
        switch_attention(model, layout.mesh, {"schedule": cfg.schedule, "backward": cfg.backward})
    return MeshAttention(config=cfg, layout=layout)


def _bind_local_device(accelerator) -> None:
    """Before the process group is made: this rank's GPU as the current device (``LOCAL_RANK``, set by the
    deepspeed launcher and torchrun), as DeepSpeed's engine would set it later. DeepSpeed binds the NCCL
    default group to that device (``init_process_group(device_id=...)``), and the layout's groups are made
    before the engine: without it their control collectives would run from GPU 0 on every rank."""
    if dist.is_initialized() or accelerator.device_name() == "cpu" or "LOCAL_RANK" not in os.environ:
        return
    accelerator.set_device(int(os.environ["LOCAL_RANK"]))


def initialize(
    args: Any = None,
    model: torch.nn.Module = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config: str | dict | None = None,
    mesh_param: Any = None,
    config_params: str | dict | None = None,
):
    """``deepspeed.initialize`` with the config's ``"mesh_attention"`` block switched on.

    Without the block (or with ``"enabled": false``) this is ``deepspeed.initialize``. With it: the
    block is validated, the DP x CP layout built, the model's attention switched, and DeepSpeed given a
    :class:`DataContextParallelMPU`; the engine carries the :class:`MeshAttention` as
    ``engine.mesh_attention``. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    forwarded = dict(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        mesh_param=mesh_param,
        config_params=config_params,
    )
    if distributed_port is not None:
        forwarded["distributed_port"] = distributed_port
    source = getattr(args, "deepspeed_config", None) or config or config_params
    if source is None:
        raise ValueError("no DeepSpeed config: pass config= (a path or a dict) or args.deepspeed_config")
    loaded = deepspeed.load_ds_config(source)
    cfg = MeshAttentionConfig.from_ds_config(loaded)
    if cfg is None or not cfg.enabled:
        return deepspeed.initialize(**forwarded)
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
            f"it yet), and instead of training_data feed each DP replica's batches (engine.mesh_attention.layout."
            f"dp_rank of dp_size; the same batch on every rank of a CP group) through engine.mesh_attention.shard"
        )
    if model is None:
        raise ValueError("initialize requires a model")
    _bind_local_device(get_accelerator())
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        dist_init_required=dist_init_required,
        **({"distributed_port": distributed_port} if distributed_port is not None else {}),
    )
    mesh_attention = layout_from_config(loaded, model)
    forwarded["mpu"] = DataContextParallelMPU(mesh_attention.layout)
    engine, *rest = deepspeed.initialize(**forwarded)
    engine.mesh_attention = mesh_attention
    return (engine, *rest)


__all__ = [
    "BLOCK",
    "DataContextParallelMPU",
    "MeshAttention",
    "MeshAttentionConfig",
    "MeshDistributedAttention",
    "initialize",
    "layout_from_config",
    "switch_attention",
]
