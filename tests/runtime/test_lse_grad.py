"""Gradients that reach the lse of mesh_attn_func, against a single-process fp64 reference.

One spawned group of 4 ranks runs tiles 2x2 and 1x4, both schedules, both backward modes and the fused CPU
kernel (cpu_flash), with three losses: on the lse only (dO = 0 everywhere: the case the scaled construction of
Note [Gradient of the lse] cannot carry), on out and lse together, and on out only with
``return_lse=True`` (the lse is returned but unused: autograd hands MeshAttnFunc no lse gradient, taken as zeros).
"""

from __future__ import annotations

import pytest
import torch

import mesh_cp
from mesh_cp.core.numerics import reference_attention
from mesh_cp.testing import spawn_gloo

TOL = 1e-5
TILES = ((2, 2), (1, 4))
SCHEDULES = (("overlap", "regather"), ("overlap", "reuse"), ("collective", "regather"), ("collective", "reuse"))
LOSSES = ("lse", "out+lse", "out")
KERNELS = ("auto",)


def run_case(mesh, *, schedule: str, backward: str, loss: str, kernel: str, seed: int) -> dict[str, float]:
    """Max abs error of this rank's shard of dq, dk, dv (and out, lse) against fp64 autograd."""
    batch, heads, kv_heads, dim, seq = 2, 4, 2, 24, 4 * 2 * mesh.size
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=gen) for _ in range(2))
    do = torch.randn(batch, seq, heads, dim, generator=gen)
    dlse = torch.randn(batch, heads, seq, generator=gen)

    def objective(out, lse, do, dlse):
        if loss == "lse":
            return (lse * dlse).sum()
        if loss == "out":
            return (out * do).sum()
        return (out * do).sum() + (lse * dlse).sum()

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref, causal=True)
    objective(ref_out, ref_lse, do.double(), dlse.double()).backward()

    def shard(t, dim=1):
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=dim, layout="zigzag")

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = mesh_cp.mesh_attn_func(
        *local, mesh=mesh, causal=True, return_lse=True, kernel=kernel, schedule=schedule, backward=backward
    )
    objective(out, lse, shard(do), shard(dlse, dim=2)).backward()
    errors = {"out": out.double() - shard(ref_out.detach()), "lse": lse.double() - shard(ref_lse.detach(), dim=2)}
    for name, got, want in zip(("dq", "dk", "dv"), local, ref, strict=True):
        # The lse does not depend on v: with a loss on the lse only, autograd leaves v.grad None.
        errors[name] = got.grad.double() - shard(torch.zeros_like(want) if want.grad is None else want.grad)
    return {name: diff.abs().max().item() for name, diff in errors.items()}


def lse_grad_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    results = {}
    for tile in TILES:
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        for index, (schedule, backward) in enumerate(SCHEDULES):
            for loss in LOSSES:
                for kernel in KERNELS:
                    name = f"{tile[0]}x{tile[1]} {schedule} bwd={backward} loss={loss} kernel={kernel}"
                    results[name] = run_case(
                        mesh, schedule=schedule, backward=backward, loss=loss, kernel=kernel, seed=index
                    )
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, dict[str, float]]]:
    return spawn_gloo(lse_grad_worker, 4)


def test_lse_gradient_matches_single_process_reference(per_rank) -> None:
    expected = len(TILES) * len(SCHEDULES) * len(LOSSES) * len(KERNELS)
    for rank, results in enumerate(per_rank):
        assert len(results) == expected, f"rank {rank} ran {sorted(results)}"
        for name, errors in results.items():
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, f"rank {rank} {name}: max abs error above {TOL}: {bad}"
