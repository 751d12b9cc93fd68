# ruff: noqa: E402  (the version check runs before the imports)
"""Hugging Face transformers: the ``mesh_cp`` attention implementation and exact sequence sharding.

::

    import mesh_cp
    from mesh_cp.integrations import hf               # registers attn_implementation="mesh_cp" with transformers

    model = hf.attach(AutoModelForCausalLM.from_config(config), mesh)   # every attention layer runs over mesh
    ddp = hf.data_parallel(model, mesh=mesh)          # torch DDP over the CP group, gradients summed over it
    batch = hf.shard_batch(input_ids, mesh=mesh)      # this rank's input_ids, global position_ids, shift_labels
    logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()                                   # DDP sums every parameter gradient over the CP group

Each rank's ``loss`` is its share of the global mean (token losses summed over its shard, divided by
the label count of the whole sequence), so the loss is the sum over the CP group and so is every
parameter gradient (:func:`data_parallel`; over DP x CP, ``DataContextParallel.data_parallel`` sums over CP and
averages over DP). Labels are shifted on the *full* sequence before
sharding, so the last token of every shard keeps its label.

What a model hands mesh_cp is either computed exactly or refused with the feature named, never
dropped: every keyword of the attention call (:data:`ATTENTION_KEYWORDS`), every mask transformers
composes (:func:`mesh_cp_mask`), the switch itself and the RoPE variants that read the sequence
length (:func:`attach`). Packed padding-free batches (``shard_batch(documents=...)``,
``ShardingCollator(packed=True)``), left and right padding (``attention_mask`` given to :func:`shard_batch`),
per-layer sliding windows and softcapped logits are exact: a batch with documents or left padding carries a
``mesh_cp_mask`` that ``model(**batch)`` hands every attention layer. Inner padding, masks given to the model,
attention dropout, caches other than mesh_cp's and models that do not compute their attention through
transformers' ``AttentionInterface`` raise with the reason.

Importing this package registers ``attn_implementation="mesh_cp"`` (:func:`register`), so
``from_pretrained(..., attn_implementation="mesh_cp")`` and ``from_config(...)`` take it; such a model still needs
``hf.attach(model, mesh)`` before its first forward (the attention refuses to run without a mesh).

Importing this package also checks the installed transformers against the supported releases
(:mod:`mesh_cp.integrations.versions`: an older one is refused, one newer than tested warns once); accelerate and TRL
are checked where they are used (:func:`mesh_cp_trainer_class`, :func:`parallel_from_accelerate`,
:func:`accelerator_parallelism_config`).

Under ``accelerate launch``, :func:`parallel_from_accelerate` builds the DP x CP layout from the config file's
``parallelism_config`` block, and :func:`accelerator_parallelism_config` is what the ``Accelerator`` is given instead
(Note [accelerate's parallelism_config] in :mod:`mesh_cp.integrations.hf.accelerate_config`).

TRL's trainers of whole sequences (``DPOTrainer``, ``GRPOTrainer``, ``RewardTrainer``) keep every CP rank's batch
whole and shard the model calls instead (:func:`shard_fused_calls` for TRL's fused LM head,
:func:`shard_classification_calls` for a reward model; Note [Whole sequences under CP] in
:mod:`mesh_cp.integrations.hf.scores`).

Generation: :func:`generate` (or :func:`prefill`, then ``model.generate(past_key_values=cache)``) prefills the
prompts sharded over the mesh and decodes with Tree Attention over a :class:`ShardedKVCache` (Note [Sharded
generation] in :mod:`mesh_cp.integrations.hf.generation`).
"""

from __future__ import annotations

from mesh_cp.integrations.versions import require

require("transformers")  # first: an unsupported release is refused before a module here imports it

from mesh_cp.integrations.hf.accelerate_config import accelerator_parallelism_config, parallel_from_accelerate
from mesh_cp.integrations.hf.attach import LENGTH_DEPENDENT_ROPE, attach
from mesh_cp.integrations.hf.attention import ATTENTION_KEYWORDS, NAME, PACKING_KEYWORDS, mesh_cp_attention, register
from mesh_cp.integrations.hf.collate import BATCH_KEYS, PadExamples, ShardCollated, shard_collated
from mesh_cp.integrations.hf.fsdp import check_sharded, fsdp_mesh
from mesh_cp.integrations.hf.generation import ShardedKVCache, generate, prefill
from mesh_cp.integrations.hf.masks import MASK_KEYWORDS, mesh_cp_mask
from mesh_cp.integrations.hf.reward import shard_classification_calls
from mesh_cp.integrations.hf.scores import shard_fused_calls
from mesh_cp.integrations.hf.tiled import fused_lm_head, tile_mlp
from mesh_cp.integrations.hf.trainer import MeshCPTrainerMixin, mesh_cp_trainer_class
from mesh_cp.runtime.batch import IGNORE_INDEX, ShardedBatch, ShardingCollator, causal_lm_loss, shard_batch
from mesh_cp.runtime.parallel import DataContextParallel, data_parallel, reduce_gradients

register()  # attn_implementation="mesh_cp" works in from_pretrained / from_config once this package is imported

__all__ = [
    "ATTENTION_KEYWORDS",
    "BATCH_KEYS",
    "IGNORE_INDEX",
    "LENGTH_DEPENDENT_ROPE",
    "MASK_KEYWORDS",
    "MeshCPTrainerMixin",
    "NAME",
    "PadExamples",
    "PACKING_KEYWORDS",
    "DataContextParallel",
    "ShardedBatch",
    "ShardCollated",
    "ShardedKVCache",
    "ShardingCollator",
    "accelerator_parallelism_config",
    "attach",
    "causal_lm_loss",
    "check_sharded",
    "data_parallel",
    "fsdp_mesh",
    "fused_lm_head",
    "generate",
    "mesh_cp_attention",
    "mesh_cp_mask",
    "mesh_cp_trainer_class",
    "parallel_from_accelerate",
    "prefill",
    "reduce_gradients",
    "register",
    "shard_batch",
    "shard_classification_calls",
    "shard_collated",
    "shard_fused_calls",
    "tile_mlp",
]
