"""Row partials sent as the kernel returns them (Note [Partials as computed] in ``mesh_cp/core/row_partials.py``).

Where every rank computes each Q chunk in one call of a kernel that returns ``dq`` in the input dtype, the collective
schedule sends ``o`` and ``dq`` in the input dtype (``plan.partials == "input"``). Checked here: which programs qualify;
the plan's bytes; and, on FlashAttention 4's CPU emulation in bf16 over a gloo group of 4, that every tile gives the
very values of the same call sending fp32 partials, with the bytes the plan states.
"""

from __future__ import annotations

import pytest
import torch

import mesh_cp
from mesh_cp.core import AttentionMask, AttentionShape, Tiling, factorizations, make_plan
from mesh_cp.core.program import KernelMode
from mesh_cp.core.row_partials import rows_as_computed
from mesh_cp.testing import spawn_gloo

WORLD, SEQ = 4, 64
SEGMENTS = KernelMode(frozenset({"segments", "softcap"}), None, True)
MASKS = KernelMode(frozenset({"mask"}))


def shape(itemsize: int = 2) -> AttentionShape:
    return AttentionShape(batch=1, seq_local=64, heads=8, kv_heads=2, head_dim=16, itemsize=itemsize)


@pytest.mark.parametrize("tile", [(2, 2), (4, 4), (2, 8), (8, 2), (1, 16), (16, 1)])
def test_one_call_per_q_chunk_qualifies(tile) -> None:
    plan = make_plan(Tiling(tile[0] * tile[1], *tile), shape(), causal=True, layout="zigzag", schedule="collective")
    assert rows_as_computed(plan, SEGMENTS)
    assert rows_as_computed(plan, MASKS) is (tile[0] * tile[1] == tile[0])  # two calls per row group on a diagonal
    world = tile[0] * tile[1]
    packed = AttentionMask(documents=(((0, 24 * world), (24 * world, 64 * world - 4)),))
    plan = make_plan(Tiling(world, *tile), shape(), causal=True, layout="zigzag", schedule="collective", mask=packed)
    assert rows_as_computed(plan, SEGMENTS)
    assert not rows_as_computed(plan, KernelMode(frozenset({"segments"}), 30.0, True))  # softcap: tiles by reference


def test_plan_bytes_follow_the_partials() -> None:
    options = {"causal": True, "layout": "zigzag", "schedule": "collective"}
    acc, inp = (make_plan(Tiling(16, 4, 4), shape(), partials=p, **options) for p in ("accumulator", "input"))
    s = acc.mesh_shape
    saved = 3 * s.chunk_elems * (s.acc_itemsize - s.itemsize)  # (a - 1) row partials of o, then of dq
    assert acc.bytes_sent("forward") - inp.bytes_sent("forward") == saved
    assert acc.bytes_sent("backward") - inp.bytes_sent("backward") == saved
    with pytest.raises(ValueError, match="partials 'bf16'"):
        make_plan(Tiling(16, 4, 4), shape(), partials="bf16", **options)


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import mesh_cp.runtime.attention as attention
    from mesh_cp.kernels.flash_attn4 import FlashAttn4Kernel
    from mesh_cp.testing import fa4_emulation

    results = {}
    packed = AttentionMask(documents=(((0, 3 * SEQ // 8), (3 * SEQ // 8, SEQ - 4)),))
    with fa4_emulation.installed(arch=90):
        kernel = FlashAttn4Kernel.without_device_check()
        for tile in factorizations(world):
            mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
            for name, mask in (("causal", None), ("packed", packed)):
                gen = torch.Generator().manual_seed(7)
                q, do = (torch.randn(1, SEQ, 4, 16, generator=gen).bfloat16() for _ in range(2))
                k, v = (torch.randn(1, SEQ, 2, 16, generator=gen).bfloat16() for _ in range(2))
                local = [mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag") for t in (q, k, v, do)]
                runs = {}
                for partials in ("input", "accumulator"):
                    decide = attention.row_partials
                    if partials == "accumulator":
                        attention.row_partials = lambda *args: "accumulator"
                    try:
                        inputs = [t.clone().requires_grad_() for t in local[:3]]
                        fwd, bwd = mesh_cp.CommCounter(), mesh_cp.CommCounter()
                        options = {"mesh": mesh, "kernel": kernel, "schedule": "collective", "mask": mask}
                        with fwd:
                            out = mesh_cp.mesh_attn_func(*inputs, causal=True, **options)
                        with bwd:
                            out.backward(local[3])
                    finally:
                        attention.row_partials = decide
                    plan = make_plan(
                        mesh.tiling,
                        attention.attention_shape(*local[:3]),
                        causal=True,
                        layout="zigzag",
                        schedule="collective",
                        mask=mask,
                        partials=partials,
                    )
                    runs[partials] = {
                        "values": [out.detach(), *(t.grad for t in inputs)],
                        "bytes": tuple(sum(c.bytes_by_role(mesh).get(g, 0) for g in ("q", "kv")) for c in (fwd, bwd)),
                        "planned": (plan.bytes_sent("forward"), plan.bytes_sent("backward")),
                    }
                same = all(
                    torch.equal(x, y)
                    for x, y in zip(runs["input"]["values"], runs["accumulator"]["values"], strict=True)
                )
                results[f"{tile[0]}x{tile[1]} {name}"] = (
                    same,
                    {p: (r["bytes"], r["planned"]) for p, r in runs.items()},
                )
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return spawn_gloo(worker, WORLD)


def test_the_same_values_and_the_planned_bytes(spawned) -> None:
    for rank, results in enumerate(spawned):
        assert len(results) == 2 * len(factorizations(WORLD)), sorted(results)
        for key, (same, comm) in results.items():
            assert same, (rank, key)
            for partials, (sent, planned) in comm.items():
                assert sent == planned, (rank, key, partials, sent, planned)
            a = int(key.split("x")[0])
            if a > 1:  # fewer bytes where partials are reduced at all
                assert comm["input"][0][0] < comm["accumulator"][0][0], (rank, key, comm)
                assert comm["input"][0][1] < comm["accumulator"][0][1], (rank, key, comm)
