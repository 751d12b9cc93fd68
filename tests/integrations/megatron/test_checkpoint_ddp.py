"""Megatron distributed checkpoints of a model wrapped in Megatron's ``DistributedDataParallel``, on 4 gloo ranks.

Under TP1 x CP2 x DP2: a checkpoint saved from the DDP-wrapped GPT (with a torch AdamW that has taken a step) loads
into an unwrapped model and optimizer with every parameter and state tensor equal, and one saved from an unwrapped
model loads into a wrapped one; the keys are Megatron-LM's (no ``module.``); the parameters are written by more
than one replica (fully parallel save); every rank's RNG states (Python, NumPy, torch) come back as that rank saved
them, while ``common`` holds only what was given; an asynchronous save holds the state of the moment it was
called and becomes a checkpoint when finalized. Under TP2 x CP2 x DP1 the same checkpoint loads (resharded) and the
RNG states, saved in another grid, are left alone. With the distributed optimizer and ``overlap_param_gather``, a
save holds every rank's updated shard (gathered first, as Megatron-LM saves).

Megatron's DDP allocates its gradient buffers on ``torch.cuda.current_device()``; on a CPU-only torch that is
pointed at the CPU while the wrapper is built (nothing else of DDP is used here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from mesh_cp.testing import spawn_gloo  # noqa: E402

WORLD = 4


def _gpt(tp: int, cp: int, seed: int):
    from megatron.core.models.gpt import GPTModel

    from mesh_cp.integrations import megatron as mcp
    from tests.integrations.megatron.test_megatron import SEQ, VOCAB, _config

    layout = mcp.MeshLayout.from_parallel_state(tile=(1, cp))
    torch.manual_seed(seed)  # the full weights, split over TP by use_cpu_initialization
    return GPTModel(
        config=_config(tp, cp), transformer_layer_spec=layout.layer_spec(), vocab_size=VOCAB, max_sequence_length=SEQ
    )


def _ddp(model, **ddp_options):
    """Megatron's DistributedDataParallel around ``model``, on the CPU when torch has no CUDA."""
    from unittest import mock

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(**ddp_options)
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu" if not torch.cuda.is_available() else 0):
        return DistributedDataParallel(config=model.config, ddp_config=config, module=model)


def _gathered_save(tmp_path: Path) -> dict:
    """The distributed optimizer with ``overlap_param_gather``: after a step each rank holds only its own shard of
    every bucket updated (here: shard ``i`` of the DP x CP group gets ``i + 1`` added, as an optimizer step would),
    the rest comes with the next forward. A save holds every update, and the forward pre-hooks are back after it."""
    from megatron.core import parallel_state as ps

    from mesh_cp.integrations.megatron import checkpoint

    ddp = _ddp(_gpt(1, 2, seed=6), use_distributed_optimizer=True, overlap_param_gather=True)
    hooks = len(ddp.remove_forward_pre_hook_handles)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    shards, me = group.size(), group.rank()
    expected = {}
    with torch.no_grad():
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                flat = bucket.param_data.view(-1)
                size = flat.numel() // shards
                owner = torch.arange(flat.numel()) // size
                truth = flat + (owner + 1).to(flat.dtype)  # every shard's update, as the gather will give it
                for param in bucket.params:
                    start, end = bucket.param_to_index[param]
                    expected[param] = truth[start:end].view(param.shape).clone()
                flat[me * size : (me + 1) * size] += me + 1  # this rank's step
    names = {p: n for n, p in ddp.module.named_parameters()}
    checkpoint.save(tmp_path / "gathered", ddp)
    fresh = _gpt(1, 2, seed=7)
    checkpoint.load(tmp_path / "gathered", fresh)
    loaded = dict(fresh.named_parameters())
    error = max((loaded[names[p]].detach() - want).abs().max().item() for p, want in expected.items())
    return {"gathered": error, "hooks back": len(ddp.remove_forward_pre_hook_handles) == hooks > 0}


def _adamw_step(model) -> torch.optim.AdamW:
    """AdamW after one step on the same gradients on every rank (so the replicas stay equal)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _seed_rank(rank: int) -> None:
    import random

    import numpy as np

    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)


def _scramble() -> None:
    _seed_rank(999)


def _max_diff(a, b) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys(), pa.keys() ^ pb.keys()
    return max((pa[n].detach() - pb[n].detach()).abs().max().item() for n in pa)


def _optim_diff(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    return max(
        (sa[i][k].float() - sb[i][k].float()).abs().max().item() for i in sa for k in ("step", "exp_avg", "exp_avg_sq")
    )


def _param_files(directory: Path) -> dict:
    """The files holding the model's parameters, and every key of the checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    keys = sorted(metadata.state_dict_metadata)
    files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn.startswith("decoder.")}
    return {"keys": keys, "files": sorted(files)}


def worker(rank: int, world: int, tmp: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mesh_cp.integrations.megatron import checkpoint

    tmp_path = Path(tmp)
    out: dict = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2)

    # Wrapped -> unwrapped, with the optimizer and every rank's RNG states.
    source = _ddp(_gpt(1, 2, seed=0))
    source_opt = _adamw_step(source)
    _seed_rank(rank)
    checkpoint.save(tmp_path / "wrapped", source, source_opt, common={"iteration": 7})
    out["draws after save"] = _draws()
    _scramble()
    target = _gpt(1, 2, seed=1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.01)
    out["differs before load"] = _max_diff(source.module, target)
    common = checkpoint.load(tmp_path / "wrapped", target, target_opt)
    out["draws after load"] = _draws()
    out["common"] = common
    out["wrapped -> unwrapped"] = _max_diff(source.module, target)
    out["optimizer"] = _optim_diff(source_opt, target_opt)
    out["saved"] = _param_files(tmp_path / "wrapped")
    out["common.pt"] = dist_checkpointing.load_common_state_dict(str(tmp_path / "wrapped"))

    # Unwrapped -> wrapped.
    plain = _gpt(1, 2, seed=2)
    checkpoint.save(tmp_path / "plain", plain)
    wrapped = _ddp(_gpt(1, 2, seed=3))
    checkpoint.load(tmp_path / "plain", wrapped)
    out["unwrapped -> wrapped"] = _max_diff(plain, wrapped.module)

    # Asynchronous: the state of the moment save() was called; a checkpoint once finalized.
    before = {n: p.detach().clone() for n, p in source.module.named_parameters()}
    index = checkpoint.save(tmp_path / "async", source, async_save=True)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)  # training goes on
    out["async index"] = index
    out["async pending"] = checkpoint.pending_async_saves()
    out["async finalized"] = checkpoint.finalize_async_saves(blocking=True)
    out["async is checkpoint"] = dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path / "async"))
    fresh = _gpt(1, 2, seed=4)
    checkpoint.load(tmp_path / "async", fresh)
    out["async"] = max((p.detach() - before[n]).abs().max().item() for n, p in fresh.named_parameters())
    out |= _gathered_save(tmp_path)
    ps.destroy_model_parallel()

    # Another layout: resharded parameters; the RNG states of another grid are not this rank's, so left alone.
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    expected = _gpt(2, 2, seed=2)
    resharded = _ddp(_gpt(2, 2, seed=5))
    _seed_rank(rank)
    checkpoint.load(tmp_path / "plain", resharded)
    out["resharded"] = _max_diff(expected, resharded.module)
    after_load = _draws()
    _seed_rank(rank)
    out["rng left alone"] = after_load == _draws()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_gloo(worker, WORLD, str(tmp_path_factory.mktemp("ckpt")), deadline=300)


def test_ddp_wrapped_and_unwrapped_load_each_other(results) -> None:
    for res in results:
        assert res["differs before load"] > 0
        assert res["wrapped -> unwrapped"] == 0.0
        assert res["optimizer"] == 0.0
        assert res["unwrapped -> wrapped"] == 0.0
        assert res["resharded"] == 0.0


def test_keys_are_megatron_lms_and_every_replica_writes(results) -> None:
    saved = results[0]["saved"]
    assert not [k for k in saved["keys"] if k.startswith("module.")], saved["keys"]
    assert "decoder.layers.self_attention.linear_qkv.weight" in saved["keys"], saved["keys"]
    # TP1 x CP2 x DP2: every rank holds a replica of every parameter; replica 0 alone would write one file
    # (Megatron stacks the layers: decoder.layers.<name> with the layer as its first dimension).
    assert len(saved["files"]) > 1, saved["files"]


def test_rng_states_round_trip_per_rank_and_common_is_common(results) -> None:
    draws = [res["draws after save"] for res in results]
    assert len({repr(d) for d in draws}) == WORLD  # every rank has its own RNG states
    for res in results:
        assert res["draws after load"] == res["draws after save"]
        assert res["rng left alone"] is True
        assert res["common"] == {"iteration": 7}
        assert "rng_state" not in res["common.pt"]  # in its own sharded objects, not in common
        assert res["common.pt"]["rng_state_grid"] == [1, 1, 2, 2]


def test_save_gathers_the_distributed_optimizers_shards_first(results) -> None:
    for res in results:
        assert res["gathered"] == 0.0 and res["hooks back"] is True, res


def test_async_save_holds_the_state_it_was_called_with(results) -> None:
    for res in results:
        assert res["async index"] == 0 and res["async pending"] == 1
        assert res["async finalized"] == [0]
        assert res["async is checkpoint"] is True
        assert res["async"] == 0.0
