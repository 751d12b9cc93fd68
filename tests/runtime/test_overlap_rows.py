"""The overlapped schedule runs the blocks a Q move unlocks as one call (Note [Rows of the overlapped schedule]).

A 4-rank gloo group, tiles 2x2 and 4x1, GQA 8:2 and MHA 4:4 (the greedy path differs), causal and a packed row: on a
kernel that takes segments, every rank's forward makes one kernel call per run of compute actions with one Q offset
(blocks the mask leaves single count one each), fewer than its blocks where a Q move unlocks several; output, lse
and dq, dk, dv stay those of the fp64 single-process reference.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import mesh_cp
from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, make_plan
from mesh_cp.testing import spawn_gloo
from tests.runtime.reference import errors_against_reference
from tests.runtime.test_masks import GapsKernel, SegmentsKernel

HALF = 4
SEQ = 2 * 4 * HALF
CASES = {
    "causal": None,
    "packed": AttentionMask.from_lengths([[3, 2 * HALF + 1, 1, SEQ - 2 * HALF - 5]]),
}


class Counting(SegmentsKernel):
    """Counts its forward calls."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


def expected_calls(plan, rank: int) -> tuple[int, int]:
    """Forward kernel calls of the overlapped schedule by Note [Rows of the overlapped schedule] on a kernel that
    takes segments, and the blocks: a run of two or more unmasked blocks of one Q offset is one call, any other block
    one call (a masked one its runs when its documents are not one segment each, Note [Block segments])."""
    actions, t, calls, blocks = plan.overlap("forward").actions, 0, 0, 0
    while t < len(actions):
        if actions[t].op != "compute":
            t += 1
            continue
        end = t
        while end < len(actions) and actions[end].op == "compute" and actions[end].block[0] == actions[t].block[0]:
            end += 1
        run = [w for w in (plan.block_at(rank, *a.block) for a in actions[t:end]) if w is not None]
        if len(run) > 1 and all(w.kind is not MaskKind.MASKED for w in run):
            calls += 1
        else:
            calls += sum(1 if plan.block_segments(w) is not None else len(plan.tiles(w, runs=True)) for w in run)
        blocks += len(run)
        t = end
    return calls, blocks


def worker(rank: int, world: int) -> dict:
    out = {}
    for tile in ((2, 2), (4, 1)):
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        for heads, kv_heads in ((8, 2), (4, 4)):
            for name, mask in CASES.items():
                kernel = Counting()
                errors = errors_against_reference(
                    mesh, (1, SEQ, heads, kv_heads, 8), seed=7, layout="zigzag", causal=True, mask=mask,
                    schedule="overlap", kernel=kernel,
                )  # fmt: skip
                shape = AttentionShape(
                    batch=1, seq_local=SEQ // 4, heads=heads, kv_heads=kv_heads, head_dim=8, itemsize=4
                )
                plan = make_plan(mesh.tiling, shape, causal=True, layout="zigzag", schedule="overlap", mask=mask)
                out[f"{tile} {heads}:{kv_heads} {name}"] = (errors, kernel.calls, expected_calls(plan, mesh.mesh_rank))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_gloo(worker, 4)


def test_rows_of_the_overlapped_schedule_are_one_call_and_exact(results) -> None:
    fewer = 0
    for rank, res in enumerate(results):
        assert len(res) == 8, res
        for key, (errors, calls, (expected, blocks)) in res.items():
            assert max(errors.values()) <= 1e-5, (rank, key, errors)
            assert calls == expected, (rank, key, calls, expected)
            fewer += calls < blocks
    assert fewer > 0  # some Q move unlocks several blocks: one call for them


class CountingGaps(Counting, GapsKernel):
    """Counts its forward calls; reads the rows between sequences in place (``gaps``)."""


def worker_six(rank: int, world: int) -> dict:
    """Tiles of six ranks, where several Q moves of a phase each run one call over the KV chunks held then, all reading
    one layout of the phase (Note [Keys laid once per phase]), beside the blocks of a packed row that stay single: with
    all KV chunks kept (``reuse``) or moved again (tests/runtime/test_exactness.py runs the causal rows of every tile of
    P up to 8 on these kernels)."""
    out, seq = {}, 2 * world * HALF
    packed = AttentionMask.from_lengths([[3, seq - 6, 3]])  # chunk 0 cut by the documents, the others in one
    for tile in ((3, 2), (2, 3)):
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        for backward in ("regather", "reuse"):
            kernel = CountingGaps()
            errors = errors_against_reference(
                mesh, (1, seq, 8, 2, 8), seed=11, layout="zigzag", causal=True, mask=packed, schedule="overlap",
                kernel=kernel, backward=backward,
            )  # fmt: skip
            shape = AttentionShape(batch=1, seq_local=seq // world, heads=8, kv_heads=2, head_dim=8, itemsize=4)
            plan = make_plan(
                mesh.tiling, shape, causal=True, layout="zigzag", schedule="overlap", mask=packed, backward=backward
            )
            out[f"{tile} {backward}"] = (errors, kernel.calls, expected_calls(plan, mesh.mesh_rank))
    return out


def test_packed_runs_of_six_ranks_share_one_layout_and_are_exact() -> None:
    fewer = 0
    for rank, res in enumerate(spawn_gloo(worker_six, 6)):
        assert len(res) == 4, res
        for key, (errors, calls, (expected, blocks)) in res.items():
            assert max(errors.values()) <= 1e-5, (rank, key, errors)
            assert calls == expected, (rank, key, calls, expected)
            fewer += calls < blocks
    assert fewer > 0
