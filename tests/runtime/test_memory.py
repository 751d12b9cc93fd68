"""Peak memory of one attention call measured against mesh_cp.sim.memory.peak_bytes.

The overlapped schedule (the default) must be within 20% of the plan. The collective schedule and the
head exchange of head-parallel layouts are checked within 30%: gloo stages their all-gathers and all-to-alls
through copies that it frees on its own threads, so where the peak lands varies from run to run.

One gloo group of P = 4 runs every tile with both schedules, both backward modes, MHA and GQA, and the
head-parallel x mesh layouts (head_parallel 2 with tiles 1x2 and 2x1, and Ulysses, head_parallel 4) with MHA and
GQA; each rank measures the bytes allocated at the peak of forward and of backward, the least of :data:`REPEATS`
calls.
"""

from __future__ import annotations

import pytest
import torch

import mesh_cp
from mesh_cp.core import factorizations, make_plan
from mesh_cp.kernels import get_kernel
from mesh_cp.runtime.attention import attention_shape
from mesh_cp.runtime.call import row_partials
from mesh_cp.sim.memory import peak_bytes
from mesh_cp.testing import MemoryPeak, spawn_gloo

WORLD = 4
CONFIGS = [
    (tile, schedule, backward, kv_heads)
    for tile in factorizations(WORLD)
    for schedule in ("overlap", "collective")
    for backward in ("regather", "reuse")
    for kv_heads in (8, 2)
]
# Head-parallel x mesh layouts: (u, tile of the P / u mesh ranks); the plan adds the head exchange's copies.
HYBRIDS = [(2, (1, 2)), (2, (2, 1)), (4, (1, 1))]
HYBRID_CONFIGS = [(u, tile, kv_heads) for u, tile in HYBRIDS for kv_heads in (8, 2)]
REPEATS = 3
"""Each call is measured this many times and its least peak kept: gloo's worker thread drops its references to a
collective's buffers after the wait returns, at a moment that varies, so a buffer the model counts as freed is
sometimes still held (up to 1.5x the peak); a later release only ever adds."""


def memory_worker(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    meshes = {(1, tile): mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile) for tile in factorizations(world)}
    meshes |= {(u, tile): mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile, head_parallel=u) for u, tile in HYBRIDS}
    configs = [(1, *config) for config in CONFIGS] + [
        (u, tile, "overlap", "regather", kv) for u, tile, kv in HYBRID_CONFIGS
    ]
    results = []
    for u, tile, schedule, backward, kv_heads in configs:
        mesh = meshes[(u, tile)]
        peaks = []
        for _ in range(REPEATS):
            gen = torch.Generator().manual_seed(rank)
            q = torch.randn(1, 256, 8, 64, generator=gen).requires_grad_()
            k, v = (torch.randn(1, 256, kv_heads, 64, generator=gen).requires_grad_() for _ in range(2))
            do = torch.randn(1, 256, 8, 64, generator=gen)
            with MemoryPeak() as fwd:
                out = mesh_cp.mesh_attn_func(q, k, v, mesh=mesh, schedule=schedule, backward=backward)
            with MemoryPeak() as bwd:
                out.backward(do)
            peaks.append((fwd.peak, bwd.peak))
            del out
        options = {"causal": True, "layout": "zigzag", "backward": backward, "schedule": schedule}
        plan = make_plan(mesh.tiling, attention_shape(q, k, v), head_parallel=u, **options)
        partials = row_partials(plan, get_kernel("cpu_flash"), None)  # as the call planned it
        plan = make_plan(mesh.tiling, attention_shape(q, k, v), head_parallel=u, partials=partials, **options)
        results.append(
            {
                "config": (tile, schedule, backward, kv_heads) if u == 1 else (u, tile, kv_heads),
                "measured": tuple(min(phase) for phase in zip(*peaks, strict=True)),
                "plan": (peak_bytes(plan, "forward", mesh.mesh_rank), peak_bytes(plan, "backward", mesh.mesh_rank)),
            }
        )
    return results


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    return spawn_gloo(memory_worker, WORLD)


TOLERANCE = {"overlap": 0.2, "collective": 0.3}


def test_peak_memory_matches_plan(measured) -> None:
    for rank, results in enumerate(measured):
        assert [r["config"] for r in results] == CONFIGS + HYBRID_CONFIGS
        for r in results:
            # The head exchange is all-to-alls, staged by gloo as the collective schedule's are.
            tol = TOLERANCE[r["config"][1] if len(r["config"]) == 4 else "collective"]
            for phase, got, want in zip(("forward", "backward"), r["measured"], r["plan"], strict=True):
                assert got > 0, (rank, r)
                assert 1 - tol <= want / got <= 1 + tol, (
                    f"rank {rank} {r['config']} {phase}: measured {got} B, plan {want} B"
                )


def test_overlap_holds_less_than_collective_and_reuse_trades_memory_for_traffic(measured) -> None:
    by_config = {r["config"]: r for r in measured[0]}
    for tile in factorizations(WORLD):
        for kv_heads in (8, 2):
            over = by_config[(tile, "overlap", "regather", kv_heads)]["measured"]
            coll = by_config[(tile, "collective", "regather", kv_heads)]["measured"]
            assert over[0] <= coll[0], (tile, kv_heads, over, coll)
    shape = mesh_cp.AttentionShape(batch=1, seq_local=256, heads=8, kv_heads=8, head_dim=64, itemsize=4)
    tiling = mesh_cp.Tiling(world=WORLD, a=2, b=2)
    plans = {
        mode: make_plan(tiling, shape, causal=True, layout="zigzag", backward=mode) for mode in ("regather", "reuse")
    }
    assert plans["reuse"].bytes_sent("backward") < plans["regather"].bytes_sent("backward")
    assert peak_bytes(plans["reuse"], "forward") > peak_bytes(plans["regather"], "forward")
