"""Gradient reduction in buckets (Note [Gradient buckets]): one all-reduce per bucket, the sums of the per-parameter
all-reduces, over the CP group alone and over a DP x CP layout."""

from __future__ import annotations

import pytest
import torch

from mesh_cp.runtime.gradients import gradient_buckets
from mesh_cp.testing import spawn_gloo


def test_buckets_keep_order_dtype_and_size() -> None:
    f32 = [torch.zeros(10), torch.zeros(20), torch.zeros(5)]  # 40, 80, 20 bytes
    bf16 = [torch.zeros(30, dtype=torch.bfloat16)]  # 60 bytes
    big = [torch.zeros(100)]  # 400 bytes: over a bucket, alone
    buckets = gradient_buckets([*f32[:2], *bf16, f32[2], *big], bucket_bytes=128)
    assert [[id(g) for g in b] for b in buckets] == [
        [id(f32[0]), id(f32[1])],
        [id(bf16[0])],
        [id(f32[2])],
        [id(big[0])],
    ]
    assert len(gradient_buckets(f32, bucket_bytes=2**20)) == 1
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
        gradient_buckets(f32, bucket_bytes=0)
    with pytest.raises(NotImplementedError, match="sparse gradients"):
        gradient_buckets([torch.zeros(4, 4).to_sparse()])


def model_with_grads(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8, bias=False))
    model[2].to(torch.bfloat16)
    gen = torch.Generator().manual_seed(100 + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    model[1].bias.grad = None  # no gradient on any rank: stays None
    if rank == 1:
        model[0].bias.grad = None  # on some ranks only: the others' sum, on every rank
    return model


def gradients_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import mesh_cp
    from mesh_cp.debug import CommCounter

    results = {}
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    layout = mesh_cp.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile=(1, 2))
    for name, bucket_bytes in (("default buckets", None), ("small buckets", 1200)):
        for over in ("cp", "dp x cp"):
            model = model_with_grads(rank)
            before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            with CommCounter() as counter:
                if over == "cp":
                    count = mesh_cp.reduce_gradients(model, mesh, **options)
                else:
                    count = layout.reduce_gradients(model, **options)
            reduces = sum(r.op == "all_reduce" for r in counter.records)
            gathered = [None] * world
            dist.all_gather_object(gathered, before)
            divide = 1 if over == "cp" else layout.dp_size
            errors = []
            for i, p in enumerate(model.parameters()):
                had = [g[i].double() for g in gathered if g[i] is not None]
                if p.grad is None or not had:
                    errors.append(0.0 if p.grad is None and not had else float("inf"))
                    continue
                want = sum(had) / divide
                errors.append((p.grad.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30))
            results[f"{name}, {over}"] = {"count": count, "reduces": reduces, "errors": errors}
    return results


def test_buckets_reduce_like_per_parameter_all_reduces() -> None:
    results = spawn_gloo(gradients_worker, 4)
    params = list(model_with_grads(0).parameters())  # those without a gradient too (Note [Used flags])
    expected = {
        "default buckets": len(gradient_buckets(params)),
        "small buckets": len(gradient_buckets(params, bucket_bytes=1200)),
    }
    # fp32 / bf16; with 1200-byte buckets the 2 KiB weight alone, then the biases with the 1 KiB weight
    assert expected == {"default buckets": 2, "small buckets": 3}
    for rank, result in enumerate(results):
        for key, r in result.items():
            want = expected[key.split(",")[0]]
            assert r["count"] == r["reduces"] == want < len(params), (rank, key, r)
            tol = [1e-6, 1e-6, 1e-6, 0.0, 1e-2]  # relative; the bf16 weight is rounded to bf16 once
            assert all(e <= t for e, t in zip(r["errors"], tol, strict=True)), (rank, key, r["errors"])
