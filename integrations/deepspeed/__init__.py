# ruff: noqa: E402  (the version check runs before the imports)
"""DeepSpeed: switch Mesh-Attention on with a ``"mesh_attention"`` block in the DeepSpeed config.

::

    # ds_config.json: {..., "zero_optimization": {"stage": 3},
    #                  "mesh_attention": {"enabled": true, "cp_size": 4, "tile": "2x2"}}
    from mesh_cp.integrations import deepspeed as mesh_ds

    engine, optimizer, _, _ = mesh_ds.initialize(model=model, model_parameters=model.parameters(),
                                                 config="ds_config.json")      # deepspeed.initialize's signature
    cp = engine.mesh_attention                                                 # MeshAttention
    batch = cp.shard(input_ids, device=engine.device)   # this DP replica's (batch, seq), same on its CP ranks
    logits = engine(input_ids=batch.input_ids, position_ids=batch.position_ids, mesh_cp_mask=batch.mask).logits
    engine.backward(cp.loss(logits, batch))
    engine.step()

    # or let DeepSpeed's loader sample over the DP replicas and shard: the same batches, on engine.device
    engine, optimizer, loader, _ = mesh_ds.initialize(model=model, model_parameters=model.parameters(),
                                                      training_data=dataset, config="ds_config.json")
    for batch in loader:                                # loader.data_sampler.set_epoch(epoch) per epoch
        ...                                             # the three lines above

:func:`initialize` reads the block (:class:`mesh_cp.config.MeshConfig`, every error raised before
DeepSpeed starts), splits the ranks into DP x CP replicas (:class:`mesh_cp.runtime.parallel.DataContextParallel`:
``cp_size`` consecutive ranks per replica, tiled ``tile``), switches the model's attention, and hands
DeepSpeed an ``mpu`` (:class:`DataContextParallelMPU`) whose data-parallel group holds *all* DP x CP
ranks. ``"head_parallel": u`` in the block runs the head-parallel x mesh hybrid (groups of ``u`` consecutive CP
ranks exchange heads, ``"tile"`` tiles the ``cp_size / u`` others; :meth:`MeshAttention.shard` follows its layout);
the former key ``"heads"`` is refused, naming ``"head_parallel"``.
Hugging Face models switch to ``attn_implementation="mesh_cp"``; any other model uses
:class:`MeshDistributedAttention` (shaped like ``deepspeed.sequence.layer.DistributedAttention``)
where it computes attention.

Gradients (see Note [DeepSpeed gradient averaging]) are those of the mean over DP replicas of each
replica's token-mean loss, at every ZeRO stage: the same as DeepSpeed data parallelism without CP on
the same global batches. ``train_batch_size`` in the config is what a step trains on, as without CP:
``micro_batch x gradient_accumulation x (world / cp_size)`` sequences. DeepSpeed counts every CP rank as a
data-parallel rank, so it is handed ``cp_size`` times that (``engine.train_batch_size()`` and DeepSpeed's
throughput counters count each sequence once per CP rank). ``"gradient_allreduce_op": "sum"``, elasticity and
random-LTD are refused; ``engine.deepspeed_io`` needs a ``data_sampler`` (its default samples over all DP x CP
ranks).

With the Hugging Face ``Trainer``, pass the same config to ``TrainingArguments(deepspeed=...)`` and
use :func:`mesh_cp.integrations.hf.mesh_cp_trainer_class` without a ``layout``: it reads the block.
"""

from mesh_cp.integrations.versions import require

require("deepspeed")  # when installed: an unsupported release is refused here

from mesh_cp.integrations.deepspeed.attention import MeshDistributedAttention
from mesh_cp.integrations.deepspeed.config import BLOCK
from mesh_cp.integrations.deepspeed.engine import DataContextParallelMPU, MeshAttention, initialize, layout_from_config

__all__ = [
    "BLOCK",
    "DataContextParallelMPU",
    "MeshAttention",
    "MeshDistributedAttention",
    "initialize",
    "layout_from_config",
]
