"""Exactness of mesh_attn_func against a single-process fp64 reference, with the bytes it sends.

For every P in {1, 2, 3, 4, 6, 8} a gloo group of P ranks (the first P of one spawned group of 8, the whole of it
for P = 8) runs every tile a x b of P, with both schedules (overlapped and collective), over a matrix of
causal/full, layouts, MHA/GQA/MQA, head dims 64/80, batch 2, odd chunk lengths, both backward modes and four kernels
(the default, the reference and two with the flash kernels' varlen call structure).
Every rank compares its shard of out, lse, dq, dk, dv (with a gradient on the lse too) and counts what it sent per
group against the plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch

import mesh_cp
from mesh_cp.core import factorizations, make_plan
from mesh_cp.core.numerics import reference_attention
from mesh_cp.runtime.attention import attention_shape
from mesh_cp.testing import spawn_gloo
from tests.group_sizes import by_group_size, size_results
from tests.runtime.test_masks import GapsKernel, SegmentsKernel

TOL = 1e-5


@dataclass(frozen=True)
class Case:
    causal: bool
    layout: str
    heads: int
    kv_heads: int
    head_dim: int
    half_chunk: int = 3
    """Tokens per half-chunk (zigzag) or per chunk (contiguous): odd on purpose."""
    batch: int = 2
    backward: str = "regather"
    kernel: str = "auto"

    def seq_len(self, world: int) -> int:
        return (2 * world if self.layout == "zigzag" else world) * self.half_chunk

    def name(self, tile: tuple[int, int], schedule: str) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"{tile[0]}x{tile[1]} {schedule} {mask}/{self.layout} h{self.heads}/kv{self.kv_heads} d{self.head_dim} "
            f"S/P~{self.half_chunk} bwd={self.backward} kernel={self.kernel}"
        )


CASES = (
    Case(causal=True, layout="zigzag", heads=4, kv_heads=4, head_dim=64),
    Case(causal=True, layout="zigzag", heads=8, kv_heads=2, head_dim=80),
    Case(causal=True, layout="zigzag", heads=4, kv_heads=1, head_dim=64),
    Case(causal=False, layout="contiguous", heads=4, kv_heads=4, head_dim=80, half_chunk=5),
    Case(causal=False, layout="contiguous", heads=8, kv_heads=2, head_dim=64, half_chunk=5),
    Case(causal=True, layout="contiguous", heads=4, kv_heads=1, head_dim=80, half_chunk=5),
    Case(causal=False, layout="zigzag", heads=4, kv_heads=2, head_dim=64),
    Case(causal=True, layout="zigzag", heads=8, kv_heads=2, head_dim=64, backward="reuse"),
    Case(causal=True, layout="zigzag", heads=4, kv_heads=4, head_dim=80, kernel="reference"),
    Case(causal=True, layout="zigzag", heads=8, kv_heads=2, head_dim=64, backward="reuse", kernel="segments_gaps"),
    Case(causal=True, layout="zigzag", heads=4, kv_heads=2, head_dim=64, kernel="segments"),
)
"""The last two run on the flash kernels' call structure (:data:`SEGMENT_KERNELS`): a Q move's blocks in one call over
the phase's layout of keys (Note [Keys laid once per phase] in :mod:`mesh_cp.core.program`)."""

SEGMENT_KERNELS = {"segments": SegmentsKernel(), "segments_gaps": GapsKernel()}
"""Kernels that take blocks as varlen ``segments``, the rows between sequences read in place (``gaps``) or not."""


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


SCHEDULES = ("overlap", "collective")


def run_case(mesh, case: Case, schedule: str, seed: int) -> dict:
    """Run one case on this rank; return its errors and its bytes sent per group and phase."""
    world = mesh.size
    seq = case.seq_len(world)
    gen = torch.Generator().manual_seed(seed)
    shape_q = (case.batch, seq, case.heads, case.head_dim)
    shape_kv = (case.batch, seq, case.kv_heads, case.head_dim)
    # fp32 inputs; the reference runs in fp64 on the very same (fp32-representable) values.
    q, k, v, do = (torch.randn(s, generator=gen).float() for s in (shape_q, shape_kv, shape_kv, shape_q))
    dlse = torch.randn(case.batch, case.heads, seq, generator=gen).float()

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref, causal=case.causal)
    ((ref_out * do.double()).sum() + (ref_lse * dlse.double()).sum()).backward()

    def shard(t, dim=1):
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=dim, layout=case.layout)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    fwd, bwd = mesh_cp.CommCounter(), mesh_cp.CommCounter()
    with fwd:
        out, lse = mesh_cp.mesh_attn_func(
            *local,
            mesh=mesh,
            causal=case.causal,
            layout=case.layout,
            return_lse=True,
            kernel=SEGMENT_KERNELS.get(case.kernel, case.kernel),
            backward=case.backward,
            schedule=schedule,
        )
    with bwd:
        ((out * shard(do)).sum() + (lse * shard(dlse, dim=2)).sum()).backward()

    plan = make_plan(
        mesh.tiling,
        attention_shape(*local),
        causal=case.causal,
        layout=case.layout,
        backward=case.backward,
        schedule=schedule,
    )
    errors = {
        "out": _max_err(out, shard(ref_out.detach())),
        "lse": _max_err(lse, shard(ref_lse.detach(), dim=2)),
        "dq": _max_err(local[0].grad, shard(ref[0].grad)),
        "dk": _max_err(local[1].grad, shard(ref[1].grad)),
        "dv": _max_err(local[2].grad, shard(ref[2].grad)),
    }
    comm = {}
    for phase, counter in (("forward", fwd), ("backward", bwd)):
        measured = counter.bytes_by_role(mesh)
        planned = {g: plan.bytes_sent(phase, g) for g in ("q", "kv")}
        comm[phase] = (
            {g: measured.get(g, 0) for g in ("q", "kv", "cp", "other")},
            {**planned, "cp": 0, "other": 0},
        )
    ring_forward = 2 * plan.shape.kv_ratio * (world - 1) * plan.shape.chunk_elems * plan.shape.itemsize
    return {
        "dtype": str(out.dtype),
        "lse_dtype": str(lse.dtype),
        "errors": errors,
        "comm": comm,
        "ring_forward": ring_forward,
        "tile": mesh.tile,
    }


WORLDS = (1, 2, 3, 4, 6, 8)


def exactness_cases(group, rank: int, world: int) -> dict[str, dict]:
    """Every tile of ``world``, every case and schedule, on ``group`` (``world`` ranks)."""
    results = {}
    for tile in factorizations(world):
        mesh = mesh_cp.CPMesh.create(group, tile=tile)
        for index, case in enumerate(CASES):
            for schedule in SCHEDULES:
                results[case.name(tile, schedule)] = run_case(mesh, case, schedule, seed=1000 * world + index)
    return results


def exactness_worker(rank: int, world: int) -> dict[int, dict[str, dict]]:
    return by_group_size(WORLDS, exactness_cases, rank, world)


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, dict[str, dict]]]:
    """One spawned group of max(WORLDS) ranks; each P runs on its first P ranks."""
    return spawn_gloo(exactness_worker, max(WORLDS))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"P{world}")
def world_results(request, spawned) -> tuple[int, list[dict[str, dict]]]:
    """The results of one P, shared by the tests below."""
    return request.param, size_results(spawned, request.param)


def test_exact_against_fp64_for_every_tile(world_results) -> None:
    world, per_rank = world_results
    expected = {case.name(tile, s) for tile in factorizations(world) for case in CASES for s in SCHEDULES}
    for rank, results in enumerate(per_rank):
        assert set(results) == expected, f"rank {rank} ran {sorted(results)}"
        for name, res in results.items():
            assert res["dtype"] == "torch.float32" and res["lse_dtype"] == "torch.float32", (name, res)
            bad = {k: v for k, v in res["errors"].items() if not v <= TOL}
            assert not bad, f"rank {rank} {name}: max abs error above {TOL}: {bad}"


def test_bytes_sent_equal_plan_and_ring_formula(world_results) -> None:
    world, per_rank = world_results
    for rank, results in enumerate(per_rank):
        for name, res in results.items():
            for phase, (measured, planned) in res["comm"].items():
                assert measured == planned, f"rank {rank} {name} {phase}: sent {measured}, plan says {planned}"
            a, _ = res["tile"]
            if a == 1:  # 1 x P is Ring-Attention: 2r(P-1) C forward, all of it KV.
                sent = res["comm"]["forward"][0]
                assert sent["kv"] == res["ring_forward"] and sent["q"] == 0, (name, sent)
                if world > 1:
                    assert sent["kv"] > 0


def test_case_matrix_is_what_the_docstring_says() -> None:
    assert {c.head_dim for c in CASES} == {64, 80}
    assert {(c.heads == c.kv_heads, c.kv_heads == 1) for c in CASES} == {(True, False), (False, False), (False, True)}
    assert {(c.causal, c.layout) for c in CASES} == {
        (True, "zigzag"),
        (False, "contiguous"),
        (True, "contiguous"),
        (False, "zigzag"),
    }
    assert {c.backward for c in CASES} == {"regather", "reuse"} and all(c.half_chunk % 2 for c in CASES)
    assert asdict(CASES[0])["batch"] > 1
