"""Head-parallel x mesh attention (Note [Head-parallel x mesh]) against a single-process fp64 reference.

One spawned group per P (4, 8, 16; 16 ranks oversubscribe the two cores, which exactness does not mind) runs
u in {2, 4} with several tiles of the P / u mesh ranks, both schedules, MHA, GQA (u below and above the K/V head
count: split and repeated K/V heads) and MQA, causal (zig-zag) and full attention, plus packed documents with a
window. Every rank compares its piece of the output and lse and dq, dk, dv (a loss on out and on the lse) with the
reference, and the bytes it sent on the head group with the all-to-all formula.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import mesh_cp
from mesh_cp.core import AttentionMask
from mesh_cp.core.numerics import reference_attention
from mesh_cp.debug import CommCounter
from mesh_cp.testing import spawn_gloo

TOL = 1e-5
HEADS = {"MHA": (8, 8), "GQA": (8, 2), "MQA": (8, 1)}
# P -> (u, tile) pairs: tile (1, m) is USP, (1, 1) Ulysses.
LAYOUTS = {
    4: ((2, (1, 2)), (2, (2, 1)), (4, (1, 1))),
    8: ((2, (2, 2)), (2, (1, 4)), (4, (1, 2)), (4, (2, 1))),
    16: ((4, (2, 2)), (2, (2, 4))),
}


def cases(world: int) -> dict[str, dict]:
    seq = 4 * world
    packed = AttentionMask.from_lengths([[1, 5, seq - 9], [seq - 3]], window=5)
    out = {f"{name} causal": {"heads": hk, "causal": True} for name, hk in HEADS.items()}
    out["GQA full"] = {"heads": HEADS["GQA"], "causal": False}
    out["MHA packed, window"] = {"heads": HEADS["MHA"], "causal": True, "mask": packed}
    return out if world != 16 else {k: out[k] for k in ("GQA causal", "MQA causal")}


def run_case(mesh, case: dict, schedule: str, seed: int) -> dict[str, float]:
    (heads, kv_heads), batch, dim, seq = case["heads"], 2, 8, 4 * mesh.size
    layout = "zigzag" if case["causal"] else "contiguous"
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=gen) for _ in range(2))
    do, dlse = torch.randn(batch, seq, heads, dim, generator=gen), torch.randn(batch, heads, seq, generator=gen)
    options = {"causal": case["causal"], "mask": case.get("mask")}

    def objective(out, lse, do, dlse):
        return (out * do).sum() + (torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) * dlse).sum()

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref, **options)
    objective(ref_out, ref_lse, do.double(), dlse.double()).backward()

    def shard(t, dim=1):
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=dim, layout=layout)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    with CommCounter() as counter:
        out, lse = mesh_cp.mesh_attn_func(
            *local, mesh=mesh, layout=layout, return_lse=True, schedule=schedule, **options
        )
        objective(out, lse, shard(do), shard(dlse, dim=2)).backward()
    want_lse = shard(ref_lse.detach(), dim=2)
    finite = ~torch.isinf(want_lse)
    errors = {
        "out": (out.double() - shard(ref_out.detach())).abs().max().item(),
        "lse": (lse.double()[finite] - want_lse[finite]).abs().max().item(),
        "lse empty": float(not torch.equal(torch.isinf(lse), ~finite)),
    }
    for name, got, want in zip(("dq", "dk", "dv"), local, ref, strict=True):
        errors[name] = (got.grad.double() - shard(want.grad)).abs().max().item()
    # Each all-to-all sends (u - 1) / u of its input: q, k, v (K/V repeated to u heads when u > Hkv), out and
    # lse forward; dout, dlse, dq, dk, dv backward.
    u, item = mesh.heads, 4
    q_bytes, kv_bytes = q.numel() // mesh.size * item, k.numel() // mesh.size * item * max(1, u // kv_heads)
    lse_bytes = dlse.numel() // mesh.size * item
    want_bytes = (u - 1) * (4 * q_bytes + 4 * kv_bytes + 2 * lse_bytes) // u
    errors["head bytes"] = abs(counter.bytes_by_role(mesh).get("heads", 0) - want_bytes)
    return errors


def heads_worker(rank: int, world: int) -> dict:
    results: dict = {}
    for u, tile in LAYOUTS[world]:
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile, heads=u)
        for name, case in cases(world).items():
            for schedule in ("overlap", "collective"):
                key = f"P{world} u{u} {tile[0]}x{tile[1]} {schedule} {name}"
                results[key] = run_case(mesh, case, schedule, seed=zlib.crc32(key.encode()) % 1000)
    return results


@pytest.fixture(scope="module", params=[4, 8, 16])
def heads_results(request) -> tuple[int, list[dict]]:
    return request.param, spawn_gloo(heads_worker, request.param)


def test_hybrid_matches_single_process_reference(heads_results) -> None:
    world, results = heads_results
    expected = len(LAYOUTS[world]) * len(cases(world)) * 2
    for rank, result in enumerate(results):
        assert len(result) == expected, sorted(result)
        bad = {k: v for k, v in result.items() if max(v.values()) > TOL}
        assert not bad, f"rank {rank}: {bad}"
