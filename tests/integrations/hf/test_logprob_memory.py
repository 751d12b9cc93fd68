"""The log-prob path of the whole-sequence trainers under CP holds no fp32 ``[B, S, V]`` tensor: a model given TRL's
fused LM head and sharded over the mesh (``shard_fused_calls``, Note [Whole sequences under CP] in
:mod:`mesh_cp.integrations.hf.scores`) scores full rows with at most one of TRL's vocabulary tiles at a time, in its
forward and its backward, and so does one training step of ``hf.mesh_cp_trainer_class(DPOTrainer)``.

One spawned group of 2 gloo ranks (CP 2). A dispatch mode (:class:`LargestTensors`) records the storage of every
tensor every op returns, backward included. The vocabulary (100000) is larger than TRL's tile width
(``_CHUNKED_LOGPROB_CHUNK_SIZE``, 32768; on CPU TRL scores every position of the shard in tiles of
``[B * S_local, 32768]``): the largest fp32 storage of the sharded fused path must be at most one tile, under a third
of the shard's ``[B, S_local, V]`` logits (``B * S * V / (3 * cp)`` elements). The plain model's forward and backward
of the same rows each hold at least ``B * S * V`` fp32 elements, and the sharded fused call with TRL's tile widened to the
whole vocabulary holds the shard's ``B * S_local * V``: the record sees such tensors (the checks can fail). The hidden size is tiny (16) so the weights (``[V, 16]``) stay under the bound.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mesh_cp.testing import run_sections, section_results, spawn_gloo

WORLD = 2
VOCAB = 100_000
"""Larger than TRL's tile width (32768): the tiles are a third of the vocabulary or less."""
BATCH, SEQ = 2, 128
LENGTHS = (128, 101)
"""Real tokens of each row (the second padded on the right)."""
TILES_PER_SHARD_LOGITS = 3
"""The bound: the largest fp32 storage of the fused sharded path is under ``1 / 3`` of the shard's logits."""


class LargestTensors(TorchDispatchMode):
    """While active, the largest storage (in elements) each dtype's tensors have among the outputs of every op
    dispatched (the backward's ops included), and the op that returned it: ``largest[dtype] == (elements, op)``."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[torch.dtype, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                elements = tensor.untyped_storage().nbytes() // tensor.element_size()
                if elements > self.largest.get(tensor.dtype, (0, ""))[0]:
                    self.largest[tensor.dtype] = (elements, str(func))
        return out

    def fp32(self) -> tuple[int, str]:
        """``(elements, op)`` of the largest fp32 storage recorded (``(0, "")`` when none)."""
        return self.largest.get(torch.float32, (0, ""))


def config(**overrides):
    """A one-layer Llama of width 16 over :data:`VOCAB` tokens (untied head)."""
    from mesh_cp.testing.models import tiny_config

    sizes = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return tiny_config("LlamaConfig", **(sizes | heads | overrides))


def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of :data:`LENGTHS` right-padded rows of random tokens (the same on
    every rank); the labels are -100 on padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = (torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = ids * mask
    return ids, mask, ids.masked_fill(mask == 0, -100)


def fused_call_section(rank: int, world: int) -> dict:
    """The largest fp32 storages of the sharded fused call (forward, backward) and of the plain model on the same
    rows, the sizes they are compared with, and how far the fused log-probs are from the plain model's."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, add_fused_lm_head

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.scores import shard_fused_calls
    from mesh_cp.runtime.parallel import DataContextParallel

    mesh = DataContextParallel.create(dist.group.WORLD, cp_size=world, tile=(1, world)).mesh
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa")
    model = copy.deepcopy(plain)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    hf.attach(model, mesh)
    shard_fused_calls(model, mesh, grad_scale=mesh.size)
    local = []
    model.register_forward_pre_hook(lambda _m, _a, kw: local.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    ids, mask, labels = rows()
    out: dict = {"chunk": _CHUNKED_LOGPROB_CHUNK_SIZE}
    with LargestTensors() as forward:
        got = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    with LargestTensors() as backward:
        (got.loss + 0.1 * got.entropy.mean()).backward()
    out["fused"] = {"forward": forward.fp32(), "backward": backward.fp32(), "local shape": local[0]}
    with LargestTensors() as forward:
        logits = plain(input_ids=ids, attention_mask=mask).logits
        logps = logits[:, :-1].float().log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        logps = logps.masked_fill(labels[:, 1:] == -100, 0.0)
    with LargestTensors() as backward:
        (-logps.sum() / (labels[:, 1:] != -100).sum()).backward()
    out["plain"] = {"forward": forward.fp32(), "backward": backward.fp32()}
    out["log_probs"] = (got.log_probs - logps).abs().max().item()
    with mock.patch("trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE", 2 * VOCAB), LargestTensors() as wide:
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out["whole-vocabulary tile"] = wide.fp32()
    out["shape"] = tuple(got.log_probs.shape)
    return out


def dpo_step_section(rank: int, world: int) -> dict:
    """One step of ``hf.mesh_cp_trainer_class(DPOTrainer)`` at CP ``world`` (policy and reference with the big
    vocabulary): the largest fp32 storage of the whole ``train()`` and the fused calls' full and local shapes."""
    import os
    import tempfile

    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from mesh_cp.integrations import hf
    from tests.integrations.clients import SGD_RUN
    from tests.integrations.trl.sft_script import tokenizer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    parallel = hf.DataContextParallel.create(dist.group.WORLD, cp_size=world, tile=(1, world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as folder:
        args = DPOConfig(output_dir=folder, per_device_train_batch_size=2, max_steps=1,
                         **(SGD_RUN | {"learning_rate": 0.1, "bf16": False, "max_grad_norm": 1.0}))  # fmt: skip
        trainer = hf.mesh_cp_trainer_class(DPOTrainer)(
            model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=long_pairs(),
            processing_class=tokenizer(), parallel=parallel,
        )  # fmt: skip
        calls: list[dict] = []
        for module in (trainer.model, trainer.ref_model):
            module.register_forward_pre_hook(_record_full(calls), with_kwargs=True, prepend=True)
            module.register_forward_pre_hook(_record_local(calls), with_kwargs=True)
        with LargestTensors() as step:
            trainer.train()
        loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    AcceleratorState._reset_state(reset_partial_state=True)
    return {"largest": step.fp32(), "calls": calls, "loss": loss}


def long_pairs():
    """Prompts of 20 to 30 tokens with chosen and rejected completions of 30 to 60 (rows of about 90 tokens: the
    step's ``[B, S, V]`` logits would be ten times the parameters, which the optimizer step holds copies of)."""
    from datasets import Dataset

    from tests.integrations.trl.sft_script import texts

    prompts, chosen, rejected = texts(8, 20, 30, 11), texts(8, 30, 60, 12), texts(8, 30, 60, 13)
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def _record_full(calls: list[dict]):
    """A pre-hook (run before the sharding one) that records a fused call's full rows."""

    def hook(_module, _args, kwargs):
        if kwargs.get("fused_lm_head") is True:
            calls.append({"full": tuple(kwargs["input_ids"].shape)})

    return hook


def _record_local(calls: list[dict]):
    """A pre-hook (run after the sharding one) that records the shard the fused call runs."""

    def hook(_module, _args, kwargs):
        if kwargs.get("fused_lm_head") is True:
            calls[-1]["local"] = tuple(kwargs["input_ids"].shape)

    return hook


SECTIONS = {"fused call": fused_call_section, "dpo step": dpo_step_section}


def worker(rank: int, world: int) -> dict[str, dict]:
    import transformers

    transformers.logging.set_verbosity_error()
    return run_sections(SECTIONS, rank, world)


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn_gloo(worker, WORLD)


def test_fused_call_holds_one_tile_at_most(per_rank):
    for rank, res in enumerate(section_results(per_rank, "fused call")):
        chunk, fused = res["chunk"], res["fused"]
        batch, local_seq = fused["local shape"]
        full = BATCH * local_seq * WORLD * VOCAB  # [B, S, V], S the mesh's padded length
        bound = full // (TILES_PER_SHARD_LOGITS * WORLD)
        tile = batch * local_seq * chunk
        assert res["shape"] == (BATCH, SEQ - 1) and res["log_probs"] < 1e-4, (rank, res)
        for phase in ("forward", "backward"):
            elements, op = fused[phase]
            assert elements <= tile < bound, (
                f"rank {rank}: the sharded fused {phase} made an fp32 storage of {elements} elements ({op}), more than "
                f"one TRL tile [B * S_local, {chunk}] = {tile} or the bound B*S*V / (3 * cp) = {bound} (B*S*V = {full})"
            )


def test_plain_forward_and_backward_hold_full_logits(per_rank):
    """The record sees a [B, S, V] fp32 tensor where there is one, and the shard's [B, S_local, V] logits where
    TRL's tile is made as wide as the vocabulary: the checks above can fail."""
    for rank, res in enumerate(section_results(per_rank, "fused call")):
        batch, local_seq = res["fused"]["local shape"]
        elements, op = res["whole-vocabulary tile"]
        assert elements >= batch * local_seq * VOCAB > batch * local_seq * WORLD * VOCAB // (3 * WORLD), (rank, op)
        for phase in ("forward", "backward"):
            elements, op = res["plain"][phase]
            assert elements >= BATCH * SEQ * VOCAB, (rank, phase, elements, op)


def test_dpo_step_holds_one_tile_at_most(per_rank):
    results = section_results(per_rank, "dpo step")
    for rank, res in enumerate(results):
        calls = res["calls"]
        assert len(calls) == 2 and all("local" in call for call in calls), (rank, calls)  # policy, reference
        assert len(res["loss"]) == 1, (rank, res["loss"])
        (batch, seq), (_, local_seq) = calls[0]["full"], calls[0]["local"]
        assert all(call["full"] == (batch, seq) for call in calls) and local_seq * WORLD >= seq, (rank, calls)
        full = batch * local_seq * WORLD * VOCAB
        bound = full // (TILES_PER_SHARD_LOGITS * WORLD)
        elements, op = res["largest"]
        assert elements < bound, (
            f"rank {rank}: one DPO step made an fp32 storage of {elements} elements ({op}), over the bound "
            f"B*S*V / (3 * cp) = {bound} (B*S*V = {full}, rows {calls[0]['full']}, shard {calls[0]['local']})"
        )
    assert results[0]["loss"] == results[1]["loss"], [res["loss"] for res in results]
