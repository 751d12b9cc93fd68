"""DeepSpeed with a ``"mesh_attention"`` config block against training without CP.

On 4 gloo ranks, for ZeRO stages 0-3 and the layouts CP 4 (2x2) and DP 2 x CP 2 (1x2), and at ZeRO 2 for the
head-parallel x mesh hybrid CP 4 = head_parallel 2 x 1x2 (``"head_parallel": 2``), a tiny Llama
trained 3 steps through :func:`mesh_cp.integrations.deepspeed.initialize` ends with the parameters of
the same model trained in one process with ``torch.optim.SGD`` (momentum 0.9) on the same global batches (the mean of
the replicas' token-mean losses); the losses are printed side by side. A model that is not a Hugging
Face model runs through ``MeshDistributedAttention``. ``initialize(training_data=...)`` on DP 2 x CP 2 (ZeRO 2
and 3, and the hybrid with a ``collate_fn``) ends with the hand-sharded run's parameters, its sampler drawing
the same examples on a CP group and disjoint ones on the replicas. Bad blocks stop with their reason before
DeepSpeed starts. The example script runs under the deepspeed launcher and under torchrun, and resuming
from an engine checkpoint gives the losses of not stopping.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from mesh_cp.testing import expect_error, spawn_gloo  # noqa: E402
from mesh_cp.testing.models import VOCAB, tiny_causal_lms  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5
STEPS, SEQ, LR = 3, 48, 1e-2
LAYOUTS = {"CP4(2x2)": (4, "2x2"), "DP2xCP2(1x2)": (2, "1x2")}


def ds_config(stage: int, cp_size: int, tile: str, **block) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        # SGD, not Adam: Adam divides each gradient by its own size, which turns the roundoff of near-zero
        # gradients (1e-9 against 1e-6) into 1e-5 differences of the weights in 3 steps.
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "mesh_attention": {"enabled": True, "cp_size": cp_size, "tile": tile, **block},
    }


def tiny_llama():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa", dtype=torch.float32
    )


def batches(dp_size: int) -> list[list[torch.Tensor]]:
    """``batches[step][replica]``: one ``(1, SEQ)`` sequence per replica and step."""
    gen = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(dp_size)] for _ in range(STEPS)]


def train_reference(model, data: list[list[torch.Tensor]], forward) -> list[float]:
    """One process, no CP: SGD with momentum on the mean over replicas of each replica's token-mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step_batches in data:
        loss = sum(forward(model, ids) for ids in step_batches) / len(step_batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(engine) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)  # ZeRO 1-3: the optimizer's fp32 copy, gathered
        out.append((p if full is None else full).detach().clone())
    return out


def train_mesh(model, config: dict, data, forward_sharded) -> tuple[list[float], list[torch.Tensor]]:
    from mesh_cp.integrations import deepspeed as mesh_ds

    engine, *_ = mesh_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    cp = engine.mesh_attention
    losses = []
    for step_batches in data:
        batch = cp.shard(step_batches[cp.parallel.dp_rank], device=engine.device)
        loss = cp.loss(forward_sharded(engine, batch), batch)
        engine.backward(loss)
        engine.step()
        losses.append(cp.mean_loss(loss))
    return losses, full_params(engine)


def hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def hf_logits(engine, batch):
    return engine(input_ids=batch.input_ids, position_ids=batch.position_ids).logits


class TinyGPT(torch.nn.Module):
    """A model that is not a Hugging Face model: learned positions, one attention layer whose core is a
    ``MeshDistributedAttention`` (local fallback: SDPA), called in ``(seq, batch, heads, dim)`` layout."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        from mesh_cp.integrations.deepspeed import MeshDistributedAttention

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Embedding(SEQ, width)
        self.q = torch.nn.Linear(width, width)
        # No K bias: its exact gradient is zero, and Adam would turn roundoff into full-size steps.
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)
        self.attn = MeshDistributedAttention(self.local_attention, causal=True)
        self.out = torch.nn.Linear(width, VOCAB)

    def local_attention(self, q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (seq, batch, h, d) -> (batch, h, seq, d)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.permute(2, 0, 1, 3)

    def forward(self, input_ids, position_ids):
        x = (self.embed(input_ids) + self.pos(position_ids)).transpose(0, 1)  # (seq, batch, width)
        s, b, _ = x.shape
        q = self.q(x).view(s, b, self.heads, self.head_dim)
        k, v = self.kv(x).view(s, b, 2, self.kv_heads, self.head_dim).unbind(2)
        o = self.attn(q, k, v, batch_dim_idx=1).reshape(s, b, -1)
        return self.out(x + o).transpose(0, 1)  # logits (batch, seq, vocab)


def tiny_gpt_loss(model, ids):
    logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0))
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def tiny_gpt_logits(engine, batch):
    return engine(batch.input_ids, batch.position_ids)


def _max_err(a: list[torch.Tensor], b) -> float:
    return max((x.double() - y.detach().double()).abs().max().item() for x, y in zip(a, b, strict=True))


def deepspeed_worker(rank: int, world: int) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)  # what DeepSpeed's launchers set
    results: dict = {"cases": {}}
    hand_params = {}
    for name, (cp_size, tile) in LAYOUTS.items():
        data = batches(world // cp_size)
        reference = tiny_llama()
        ref_losses = train_reference(reference, data, hf_loss)
        for stage in range(4):
            losses, params = train_mesh(tiny_llama(), ds_config(stage, cp_size, tile), data, hf_logits)
            results["cases"][(name, stage)] = (losses, ref_losses, _max_err(params, reference.parameters()))
            hand_params[(cp_size, stage)] = params
        if cp_size == 2:
            results["training_data"] = _training_data_cases(data, reference, hand_params)
    # The head-parallel x mesh hybrid from the block: CP 4 = head_parallel 2 x tile 1x2, ZeRO 2.
    data = batches(1)
    reference = tiny_llama()
    ref_losses = train_reference(reference, data, hf_loss)
    losses, params = train_mesh(tiny_llama(), ds_config(2, 4, "1x2", head_parallel=2), data, hf_logits)
    results["cases"][("CP4(head_parallel 2 x 1x2)", 2)] = (losses, ref_losses, _max_err(params, reference.parameters()))
    torch.manual_seed(0)
    gpt = TinyGPT()
    reference = copy.deepcopy(gpt)
    ref_losses = train_reference(reference, data, tiny_gpt_loss)
    losses, params = train_mesh(gpt, ds_config(2, 4, "2x2"), data, tiny_gpt_logits)
    results["cases"][("TinyGPT CP4(2x2)", 2)] = (losses, ref_losses, _max_err(params, reference.parameters()))
    results["errors"] = _bad_blocks(world)
    results["batch size"] = _batch_size_case(world)
    results["other blocks"] = _other_blocks()
    results["mpu"] = _mpu_groups()
    return results


def _dataset_in_sampler_order(data: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The examples placed so that DeepSpeed's default sampler over the DP replicas (shuffled, seed 0) draws
    ``data[step][replica]`` at ``step`` on ``replica``: the hand-sharded path's batches in its order."""
    from torch.utils.data import DistributedSampler

    dp, n = len(data[0]), len(data) * len(data[0])
    dataset: list = [None] * n
    for replica in range(dp):
        for step, index in enumerate(DistributedSampler(range(n), num_replicas=dp, rank=replica, seed=0)):
            dataset[index] = data[step][replica][0]
    return dataset


def _training_data_cases(data, reference, hand_params: dict) -> dict:
    """``initialize(training_data=...)`` on DP 2 x CP 2 (ZeRO 2 and 3, and the hybrid CP 2 = head_parallel 2 with a
    user collate_fn at ZeRO 2): parameters against the hand-sharded runs and single-process training on the
    same batches; what the sampler draws; the collate against ``cp.shard`` on ragged examples."""
    from mesh_cp.integrations import deepspeed as mesh_ds

    dataset, out = _dataset_in_sampler_order(data), {}
    for stage, block, collate in ((2, {}, None), (3, {}, None), (2, {"head_parallel": 2}, torch.stack)):
        model = tiny_llama()
        config = ds_config(stage, 2, "1x1" if block else "1x2", **block)
        engine, _, loader, _ = mesh_ds.initialize(
            model=model, model_parameters=model.parameters(), config=config, training_data=dataset, collate_fn=collate
        )
        cp = engine.mesh_attention
        for batch in loader:
            engine.backward(cp.loss(hf_logits(engine, batch), batch))
            engine.step()
        params = full_params(engine)
        hand = _max_err(params, hand_params[(2, stage)]) if not block else None
        out[(stage, str(block))] = (len(loader), hand, _max_err(params, reference.parameters()))
    epoch0 = list(loader.data_sampler)
    loader.data_sampler.set_epoch(1)
    out["sampler"] = (cp.parallel.dp_rank, epoch0, list(loader.data_sampler), loader is engine.training_dataloader)
    out["collate"] = _collate_checks(cp)
    return out


def _collate_checks(cp) -> dict:
    """Ragged examples: the collate right-pads to the mesh's multiple and shards like ``cp.shard`` on the padded
    batch; a collate_fn returning keys it cannot shard is refused by name."""
    from mesh_cp.integrations.deepspeed.data import ShardingCollate

    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]}, {"input_ids": [3, 4, 5]}]
    batch = ShardingCollate(cp.mesh)(examples)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0], [3, 4, 5, 0, 0, 0, 0, 0]])
    labels = torch.tensor([[-100, 6, 7, 8, 9] + [-100] * 3, [3, 4, 5] + [-100] * 5])
    want = cp.shard(ids, labels=labels, attention_mask=(labels != -100) | (ids != 0))
    same = all(torch.equal(getattr(batch, k), getattr(want, k)) for k in ("input_ids", "position_ids", "shift_labels"))
    counts = (batch.num_items_in_batch, want.num_items_in_batch)
    errors: dict = {"same as cp.shard": (same and counts == (6, 6)) or counts}
    extra = ShardingCollate(cp.mesh, collate_fn=lambda ex: {"input_ids": torch.ones(1, 4), "pixel_values": 0})
    expect_error(errors, "extra key", ValueError, r"keys \['input_ids', 'pixel_values'\].*cannot shard \['pixel_values'\]",
                 lambda: extra([0]))  # fmt: skip
    flat = ShardingCollate(cp.mesh, collate_fn=lambda ex: torch.ones(4))
    expect_error(errors, "1-D batch", ValueError, r"input_ids has shape \(4,\): expected \(batch, seq\)",
                 lambda: flat([0]))  # fmt: skip
    return errors


def _mpu_groups() -> dict:
    """The mpu's model-parallel group (this rank alone) is made by ``new_subgroups`` over all DP x CP ranks,
    every rank's singleton at once: a split of that group where the default group is bound to a GPU (as
    DeepSpeed binds it on CUDA), never a ``new_group`` of one rank, which would then split the world."""
    import torch.distributed as dist

    from mesh_cp.integrations import deepspeed as mesh_ds
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.deepspeed import engine

    layout = hf.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile="1x2")
    calls = []
    real = engine.new_subgroups

    def recorder(parent, partition, **kwargs):
        calls.append((dist.get_process_group_ranks(parent), [list(p) for p in partition]))
        return real(parent, partition, **kwargs)

    engine.new_subgroups = recorder
    try:
        mpu = mesh_ds.DataContextParallelMPU(layout)
    finally:
        engine.new_subgroups = real
    return {"calls": calls, "alone": dist.get_process_group_ranks(mpu.get_model_parallel_group())}


def _other_blocks() -> dict:
    """``"tile": "auto"`` picks a tile of cp_size with its reason; ``"enabled": false`` is plain DeepSpeed."""
    from mesh_cp.integrations import deepspeed as mesh_ds

    config = ds_config(0, 4, "auto", topology="h100", seq_len=4096)
    auto = mesh_ds.layout_from_config(config, tiny_llama())
    config["mesh_attention"] = {"enabled": False, "cp_size": 4}
    model = tiny_llama()
    engine, *_ = mesh_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return {
        **_engine_world(engine),
        "auto tile": auto.mesh.tile,
        "auto head_parallel": auto.mesh.head_parallel,
        "auto reason": auto.mesh.reason,
        "disabled": getattr(engine, "mesh_attention", "absent"),
        "disabled attention": model.config._attn_implementation,
    }


def _engine_world(engine) -> dict:
    """A DeepSpeed engine that averages over all 4 ranks (built without the layout's mpu) against a layout built on
    2 of them (a mesh on a subgroup): refused naming both worlds and the fix; against the world's own layout (the
    engine without the mpu averages over the same ranks), accepted."""
    import torch.distributed as dist

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.layout import check_ds_engine
    from mesh_cp.runtime.groups import new_subgroups

    half = new_subgroups(dist.group.WORLD, [[0, 1], [2, 3]])
    ranks = dist.get_process_group_ranks(half)
    errors: dict = {}
    on_half = hf.DataContextParallel.create(half, cp_size=2, tile="1x2")
    expect_error(errors, "engine over 4, layout over 2", ValueError,
                 rf"the DeepSpeed engine sees another world than mesh_cp's DP x CP group of 2 ranks \{ranks}.*: "
                 r"dp_world_size 4 \(expected 2\), seq_dp_world_size 4 \(expected 2\), data_parallel_group ranks "
                 rf"\[0, 1, 2, 3\] \(expected \{ranks}\);.*mesh_cp.integrations.deepspeed.initialize.*DS_ACCELERATOR=cpu",
                 lambda: check_ds_engine(engine, on_half))  # fmt: skip
    check_ds_engine(engine, hf.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile="1x2"))
    return {"engine world": errors}


def _batch_size_case(world: int) -> dict:
    """``train_batch_size`` on DP 2 x CP 2 (read from ``args.deepspeed_config``, as DeepSpeed's launchers pass it):
    the accumulation steps and micro batch DeepSpeed itself derives for the same config on the 2 replicas alone;
    ``engine.deepspeed_io`` refuses its default sampler (over all 4 ranks) and takes one over the replicas."""
    import argparse
    import tempfile

    from deepspeed.runtime.config import DeepSpeedConfig
    from torch.utils.data import DistributedSampler

    from mesh_cp.integrations import deepspeed as mesh_ds

    config = ds_config(0, 2, "1x2")
    del config["train_micro_batch_size_per_gpu"]
    config |= {"train_batch_size": 8, "gradient_accumulation_steps": 2}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    model = tiny_llama()
    args = argparse.Namespace(deepspeed_config=f.name, local_rank=int(os.environ["LOCAL_RANK"]))
    engine, *_ = mesh_ds.initialize(args=args, model=model, model_parameters=model.parameters())
    replicas = SimpleNamespace(get_data_parallel_world_size=lambda: world // 2)  # DeepSpeed's own arithmetic
    stock = DeepSpeedConfig({k: v for k, v in config.items() if k != "mesh_attention"}, mpu=replicas)
    out = {
        "gas": (engine.gradient_accumulation_steps(), stock.gradient_accumulation_steps),
        "micro": (engine.train_micro_batch_size_per_gpu(), stock.train_micro_batch_size_per_gpu),
    }
    expect_error(out, "default sampler", ValueError, r"default sampler samples over all DP x CP ranks; pass "
                 r"data_sampler=.*num_replicas=2", lambda: engine.deepspeed_io(list(range(8))))  # fmt: skip
    parallel = engine.mesh_attention.parallel
    sampler = DistributedSampler(range(8), num_replicas=parallel.dp_size, rank=parallel.dp_rank, shuffle=False)
    out["replica loader"] = len(engine.deepspeed_io(list(range(8)), data_sampler=sampler, batch_size=1))
    return out


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


def _bad_blocks(world: int) -> dict:
    from mesh_cp.integrations import deepspeed as mesh_ds

    def start(**block_and_kwargs):
        kwargs = {k: block_and_kwargs.pop(k) for k in ("mpu", "training_data", "collate_fn") if k in block_and_kwargs}
        config = ds_config(0, 4, "2x2") | block_and_kwargs.pop("config", {})
        config["mesh_attention"] = {"enabled": True, **block_and_kwargs}
        model = tiny_llama()
        mesh_ds.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)

    errors: dict = {}
    # cp_size 3 with tile 2x2 on 4 ranks: both broken rules in one message, and blocks that satisfy every rule.
    expect_error(errors, "cp_size 3, tile 2x2", ValueError, r'"mesh_attention" on 4 ranks: "cp_size" 3 does not divide '
                 r'the 4 ranks \(divisors: 1, 2, 4\); "tile" 2x2 with head_parallel 1 spans 4 ranks, not cp_size 3\. '
                 r".*on 4 ranks use cp_size 4 with tile 2x2, or cp_size 2 with tile 2x1$",
                 lambda: start(cp_size=3, tile="2x2"))  # fmt: skip
    expect_error(errors, "tile 3x1", ValueError, r'"tile" 3x1 with head_parallel 1 spans 3 ranks, not cp_size 4.*'
                 r"use cp_size 4 with tile 2x2", lambda: start(cp_size=4, tile="3x1"))  # fmt: skip
    expect_error(errors, "unknown key", ValueError, r'unknown key "tiles"', lambda: start(cp_size=4, tiles="2x2"))
    expect_error(errors, "no cp_size", ValueError, r'needs "cp_size"', lambda: start(tile="2x2"))
    expect_error(errors, "schedule", ValueError, r"\"mesh_attention\": schedule 'ring' is not supported; choose one of \['collective', 'overlap'\]",
                 lambda: start(cp_size=4, schedule="ring"))  # fmt: skip
    expect_error(errors, "auto", ValueError, r"needs \['topology', 'seq_len'\]", lambda: start(cp_size=4, tile="auto"))
    expect_error(errors, "seq_len", ValueError, r'"seq_len" 100 is not a multiple of 2 \* cp_size = 8.*'
                 r"cp_size 4 with tile 2x2 and seq_len 104", lambda: start(cp_size=4, seq_len=100))  # fmt: skip
    expect_error(errors, "head_parallel 3", ValueError,
                 r'"head_parallel" 3 does not divide cp_size 4 \(divisors: 1, 2, 4\).*cp_size 4, head_parallel 2',
                 lambda: start(cp_size=4, head_parallel=3))  # fmt: skip
    expect_error(errors, "former heads key", ValueError,
                 r"\"mesh_attention\": 'heads' was renamed 'head_parallel'.*pass head_parallel=2",
                 lambda: start(cp_size=4, heads=2))  # fmt: skip
    expect_error(errors, "mpu", ValueError, r"\['mpu'\] cannot be used", lambda: start(cp_size=4, mpu=object()))
    expect_error(errors, "iterable training_data", ValueError, r"training_data Stream is not a map-style dataset.*"
                 r"engine.mesh_attention.shard", lambda: start(cp_size=4, training_data=Stream()))  # fmt: skip
    expect_error(errors, "collate_fn alone", ValueError, r"collate_fn without training_data.*pass training_data",
                 lambda: start(cp_size=4, collate_fn=torch.stack))  # fmt: skip
    curriculum = {"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}}
    expect_error(errors, "gradient_allreduce_op sum", ValueError, r"\"gradient_allreduce_op\" 'sum': the loss is scaled for DeepSpeed's mean",
                 lambda: start(cp_size=4, config={"gradient_allreduce_op": "sum"}))  # fmt: skip
    expect_error(errors, "elasticity", ValueError, r'"elasticity" sizes batches over all DP x CP ranks',
                 lambda: start(cp_size=4, config={"elasticity": {"enabled": True}}))  # fmt: skip
    expect_error(errors, "autotp", ValueError, r'"tensor_parallel": \{"autotp_size"\} replaces the DP x CP mpu',
                 lambda: start(cp_size=4, config={"tensor_parallel": {"autotp_size": 2}}))  # fmt: skip
    expect_error(errors, "checkpoint writer", ValueError, r'"checkpoint": \{"writer"\} reads pipeline',
                 lambda: start(cp_size=4, config={"checkpoint": {"writer": {"type": "fast"}}}))  # fmt: skip
    ltd = {"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}}
    expect_error(errors, "random_ltd", ValueError, r"random_ltd.*drops tokens per rank",
                 lambda: start(cp_size=4, config=ltd))  # fmt: skip
    expect_error(errors, "curriculum", ValueError, r'"curriculum_learning": \{"enabled": true\}.*switch curriculum '
                 r"learning off", lambda: start(cp_size=4, training_data=[1], config=curriculum))  # fmt: skip
    return errors


@pytest.fixture(scope="module")
def deepspeed_results() -> list[dict]:
    return spawn_gloo(deepspeed_worker, 4)


def test_every_zero_stage_trains_like_no_cp(deepspeed_results: list[dict]) -> None:
    print(f"\n{'layout':<18} {'ZeRO':>4} {'step':>4} {'mesh_cp loss':>14} {'no-CP loss':>14} {'param err':>10}")
    for (name, stage), (losses, ref_losses, err) in deepspeed_results[0]["cases"].items():
        for step, (mine, ref) in enumerate(zip(losses, ref_losses, strict=True), start=1):
            print(f"{name:<18} {stage:>4} {step:>4} {mine:>14.8f} {ref:>14.8f} {err if step == STEPS else '':>10}")
    for rank, result in enumerate(deepspeed_results):
        assert len(result["cases"]) == 10
        for case, (losses, ref_losses, err) in result["cases"].items():
            assert len(losses) == STEPS, case
            assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= TOL, (rank, case)
            assert err <= TOL, (rank, case, err)


def test_training_data_trains_like_hand_sharding(deepspeed_results: list[dict]) -> None:
    """``initialize(training_data=...)``: DP 2 x CP 2 ends with the hand-sharded run's parameters (and
    single-process training's), a CP group draws the same examples, the replicas disjoint ones, set_epoch
    reshuffles."""
    print(f"\n{'training_data case':<24} {'batches':>7} {'vs hand':>10} {'vs no-CP':>10}")
    for case, value in deepspeed_results[0]["training_data"].items():
        if isinstance(case, tuple):
            print(f"{str(case):<24} {value[0]:>7} {value[1] if value[1] is not None else '-':>10} {value[2]:>10.3g}")
    draws = {}
    for rank, result in enumerate(deepspeed_results):
        out = result["training_data"]
        for case in ((2, "{}"), (3, "{}"), (2, "{'head_parallel': 2}")):
            batches_seen, hand, err = out[case]
            assert batches_seen == STEPS, (rank, case)
            assert (hand is None or hand <= TOL) and err <= TOL, (rank, case, hand, err)
        dp_rank, epoch0, epoch1, attached = out["sampler"]
        assert attached and dp_rank == rank // 2 and len(epoch0) == len(epoch1) == STEPS, out["sampler"]
        draws.setdefault(dp_rank, []).append((epoch0, epoch1))
        assert all(v is True for v in out["collate"].values()), out["collate"]
    assert draws[0][0] == draws[0][1] and draws[1][0] == draws[1][1], draws  # one CP group: the same examples
    for epoch in range(2):  # the replicas: disjoint examples, all of them; set_epoch draws another order
        assert sorted(draws[0][0][epoch] + draws[1][0][epoch]) == list(range(2 * STEPS)), draws
    assert draws[0][0][0] != draws[0][0][1], draws


def test_train_batch_size_means_the_replicas_sequences(deepspeed_results: list[dict]) -> None:
    for rank, result in enumerate(deepspeed_results):
        out = result["batch size"]
        assert out.pop("gas") == (2, 2) and out.pop("micro") == (2, 2), (rank, out)
        assert out == {"default sampler": True, "replica loader": 4}, (rank, out)


def test_bad_blocks_stop_before_training(deepspeed_results: list[dict]) -> None:
    for result in deepspeed_results:
        assert len(result["errors"]) == 18
        assert all(v is True for v in result["errors"].values()), {
            k: v for k, v in result["errors"].items() if v is not True
        }


SMALL = ["--seq-len", "512", "--hidden", "32", "--corpus-mb", "0.5", "--vocab", "512", "--reference"]


@pytest.fixture(scope="module")
def deepspeed_launch(tmp_path_factory) -> list[str]:
    """One launch of 4 CPU processes by the deepspeed launcher, its runs one after another in them (launched_runs.py):
    the example at ZeRO 2 for 4 steps (by path, without the repository on ``PYTHONPATH``); then trainer_script.py with
    ``--deepspeed`` and the shipped Trainer config (ZeRO 3), its block set to DP 2 x CP 2 as the head-parallel x mesh
    hybrid (``"head_parallel": 2``, tile 1x1: the trainer builds the hybrid from the block), its output on every rank.
    What each run printed."""
    from tests.integrations.clients import launched_runs

    tmp_path = tmp_path_factory.mktemp("deepspeed")
    config = json.loads((ROOT / "configs" / "ds_mesh_cp.json").read_text())
    config["mesh_attention"] |= {"cp_size": 2, "head_parallel": 2, "tile": "1x1"}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    trainer = ROOT / "tests" / "integrations" / "accelerate" / "trainer_script.py"
    runs = [
        (EXAMPLE, _example_args(2, "--steps", "4")),
        (trainer, [str(tmp_path / "out"), "--deepspeed", str(path), "--head-parallel", "2"]),
    ]
    cmd, env = _launcher("deepspeed", 29621)
    cmd.append("--no_local_rank")  # launched_runs.py takes the runs' file alone; LOCAL_RANK is in the environment
    return launched_runs(cmd, runs, tmp_path / "runs", (29622, 29624), every_rank={1}, timeout=900, env=env, cwd=ROOT)


def torchrun_runs(
    stage: int, runs: list[tuple[str, ...]], out: Path, port: int
) -> list[dict[int, tuple[float, float]]]:
    """The example with each of ``runs``' flags in turn, one after another in the processes of one torchrun launch
    of 4 CPU processes (launched_runs.py: by path, without the repository on ``PYTHONPATH``); each run's
    (mesh_cp, reference) loss per step. Torchrun's port is ``port``, run ``i``'s store ``port + 1 + i``."""
    from tests.integrations.clients import launched_runs

    cmd, env = _launcher("torchrun", port)
    runs = [(EXAMPLE, _example_args(stage, *args)) for args in runs]
    ports = range(port + 1, port + 1 + len(runs))
    outputs = launched_runs(cmd, runs, out, ports, timeout=900, env=env, cwd=ROOT)
    return [_example_steps(output, stage) for output in outputs]


EXAMPLE = ROOT / "examples" / "deepspeed" / "finetune.py"


def _launcher(launcher: str, port: int) -> tuple[list[str], dict]:
    bin_dir = Path(sys.executable).parent
    if launcher == "deepspeed":
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "4", "--master_port", str(port)]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc-per-node", "4", "--master-port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return cmd, env


def _example_args(stage: int, *args: str) -> list[str]:
    return ["--deepspeed_config", str(ROOT / "configs" / f"ds_mesh_cp_zero{stage}.json"), *SMALL, *args]


def _example_steps(stdout: str, stage: int) -> dict[int, tuple[float, float]]:
    from examples.common import read_result

    result = read_result(stdout)
    assert result["example"] == "deepspeed" and result["zero_stage"] == stage, result
    assert result["layout"].startswith("DP(1) x CP(2x2)"), result["layout"]
    start = result["first_step"] - 1  # the step a resumed run starts after
    assert result["resumed_from"] == (start or None) and result["steps"] == start + len(result["losses"]), result
    pairs = zip(result["losses"], result["reference_losses"], strict=True)
    return {result["first_step"] + i: pair for i, pair in enumerate(pairs)}


def test_example_under_both_launchers_and_resume_equals_not_stopping(deepspeed_launch, tmp_path: Path) -> None:
    """4 steps under the deepspeed launcher (ZeRO 2); under torchrun (ZeRO 3), one after another in the processes of
    one launch, 2 steps saving a checkpoint and 4 steps resuming from it."""
    straight = _example_steps(deepspeed_launch[0], 2)
    assert sorted(straight) == [1, 2, 3, 4]
    for step, (mesh, ref) in straight.items():
        assert abs(mesh - ref) <= 1e-5, (step, mesh, ref)
    assert straight[4][0] < straight[1][0]  # it learns
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2")
    first, resumed = torchrun_runs(3, [("--steps", "2", *ckpt), ("--steps", "4", *ckpt)], tmp_path / "runs", 29625)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    for step, losses in (first | resumed).items():
        assert abs(losses[0] - straight[step][0]) <= 1e-5, (step, losses, straight[step])  # ZeRO 3 vs 2
        assert abs(losses[1] - straight[step][1]) <= 1e-6, (step, losses, straight[step])


def test_trainer_with_deepspeed_flag_equals_single_process(deepspeed_launch) -> None:
    """``--deepspeed`` with the shipped Trainer config (ZeRO 3), its block set to DP 2 x CP 2 as the head-parallel
    x mesh hybrid (``"head_parallel": 2``, tile 1x1: the trainer builds the hybrid from the block)."""
    stdout = deepspeed_launch[1]  # every rank's
    errors = {int(m[1]): float(m[2]) for m in re.finditer(r"rank (\d+) params err ([0-9.e+-]+)", stdout)}
    assert sorted(errors) == [0, 1, 2, 3], stdout[-2000:]
    assert max(errors.values()) <= TOL, errors


def test_mpu_model_parallel_group_is_a_subgroup_of_all_ranks(deepspeed_results: list[dict]) -> None:
    for rank, result in enumerate(deepspeed_results):
        assert result["mpu"]["calls"] == [([0, 1, 2, 3], [[0], [1], [2], [3]])], result["mpu"]
        assert result["mpu"]["alone"] == [rank], result["mpu"]


def test_auto_tile_and_disabled_block(deepspeed_results: list[dict]) -> None:
    for result in deepspeed_results:
        other = result["other blocks"]
        (a, b), u = other["auto tile"], other["auto head_parallel"]  # a mesh, or the hybrid with a head group
        assert a * b * u == 4 and (u == 1 or f"head_parallel={u}" in other["auto reason"]), other
        assert "predicted" in other["auto reason"], other
        assert other["disabled"] == "absent" and other["disabled attention"] == "sdpa", other
        assert other["engine world"] == {"engine over 4, layout over 2": True}, other["engine world"]


def test_distributed_attention_states_what_it_computes() -> None:
    """``MeshDistributedAttention`` needs ``causal`` (with a mesh its local attention is not called), and refuses
    ``rotary_pos_emb`` without a mesh too, where DeepSpeed's class would apply it."""
    from mesh_cp.integrations.deepspeed import MeshDistributedAttention

    def local(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with pytest.raises(TypeError, match="causal"):
        MeshDistributedAttention(local)
    attention = MeshDistributedAttention(local, causal=True)
    q = torch.randn(1, 4, 2, 8)
    assert torch.equal(attention(q, q, q, 0), local(q, q, q))
    with pytest.raises(ValueError, match=r"does not apply rotary_pos_emb"):
        attention(q, q, q, 0, (torch.ones(4, 1, 1, 8), torch.zeros(4, 1, 1, 8)))
