"""Head-parallel x mesh attention (Note [Head-parallel x mesh]) against a single-process fp64 reference.

One gloo group per P (4, 8, 16: the first P ranks of one spawned group of 16; 16 ranks oversubscribe the two
cores, which exactness does not mind) runs u in {2, 4} with several tiles of the P / u mesh ranks, both schedules,
MHA, GQA (u below and above the K/V head count: split and repeated K/V heads) and MQA, causal (zig-zag) and full
attention, plus packed documents with a window. Every rank compares its piece of the output and lse and dq, dk, dv
(a loss on out and on the lse, and for GQA causal on out only with the lse returned) with the reference, and the
bytes it sent on the head group with the all-to-all formula and with the plan's count (no lse gradient sent when no
loss reads the lse).
"""

from __future__ import annotations

import zlib

import pytest

import mesh_cp
from mesh_cp.core import AttentionMask, AttentionShape, make_plan
from mesh_cp.debug import CommCounter
from mesh_cp.testing import expect_error, spawn_gloo
from tests.group_sizes import by_group_size, size_results
from tests.runtime.reference import errors_against_reference

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


def run_case(mesh, case: dict, schedule: str, seed: int, lse_loss: bool = True) -> dict[str, float]:
    """Errors against the reference, and the head group's bytes against the all-to-all formula and the plan's count
    (a loss on out and the lse, or on out only with the lse returned: then no lse gradient is sent)."""
    (heads, kv_heads), batch, dim, seq = case["heads"], 2, 8, 4 * mesh.size
    layout = "zigzag" if case["causal"] else "contiguous"
    options = {"causal": case["causal"], "mask": case.get("mask"), "schedule": schedule}
    with CommCounter() as counter:
        errors = errors_against_reference(
            mesh, (batch, seq, heads, kv_heads, dim), seed=seed, layout=layout, lse_loss=lse_loss, **options
        )
    # Each all-to-all sends (u - 1) / u of its input: q, k, v (K/V repeated to u heads when u > Hkv), out and
    # lse forward; dout, dlse (when a loss reads the lse), dq, dk, dv backward.
    u, item, local = mesh.head_parallel, 4, batch * seq // mesh.size
    q_bytes, kv_bytes = local * heads * dim * item, local * kv_heads * dim * item * max(1, u // kv_heads)
    want_bytes = (u - 1) * (4 * q_bytes + 4 * kv_bytes + (1 + lse_loss) * local * heads * item) // u
    shape = AttentionShape(
        batch=batch, seq_local=seq // mesh.size, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=4
    )
    plan = make_plan(mesh.tiling, shape, causal=case["causal"], layout=layout, mask=case.get("mask"),
                     head_parallel=u, return_lse=True)  # fmt: skip
    planned = plan.bytes_sent("forward", "heads") + plan.bytes_sent("backward", "heads", lse_grad=lse_loss)
    sent = counter.bytes_by_role(mesh).get("heads", 0)
    errors["head bytes"], errors["head bytes vs plan"] = abs(sent - want_bytes), abs(sent - planned)
    return errors


def refusals(group, world: int) -> dict:
    """Bad head-parallel degrees and head counts, refused on every rank with the value and the fix."""
    import torch

    results: dict = {}
    expect_error(
        results,
        "head_parallel not dividing P",
        ValueError,
        rf"head_parallel=3 does not divide the CP group size P={world}; choose one of \[1, 2, 4\]",
        lambda: mesh_cp.CPMesh.create(group, tile=(1, 1), head_parallel=3),
    )
    expect_error(
        results,
        "former spelling",
        ValueError,
        r"CPMesh.create: 'heads' was renamed 'head_parallel' .*pass head_parallel=2",
        lambda: mesh_cp.CPMesh.create(group, tile=(1, 2), heads=2),
    )
    expect_error(
        results,
        "tile='auto' is the cost model's",
        ValueError,
        r"tile='auto': choosing the tile from a cluster topology is mesh_cp.auto_mesh\(group, topology=",
        lambda: mesh_cp.CPMesh.create(group, tile="auto"),
    )
    expect_error(
        results,
        "tile not of P / head_parallel",
        ValueError,
        r"with head_parallel=2 the tile tiles P / head_parallel = 2 mesh ranks: tile 2x2 does not factor",
        lambda: mesh_cp.CPMesh.create(group, tile=(2, 2), head_parallel=2),
    )
    mesh = mesh_cp.CPMesh.create(group, tile=(1, 1), head_parallel=world)
    q, kv = torch.zeros(1, 8, 6, 8), torch.zeros(1, 8, 6, 8)
    expect_error(
        results,
        "query heads not split",
        ValueError,
        rf"head_parallel={world} does not divide the 6 query heads; choose head_parallel among \[1, 2\]",
        lambda: mesh_cp.mesh_attn_func(q, kv, kv, mesh=mesh),
    )
    kv3 = torch.zeros(1, 8, 3, 8)  # 3 K/V heads over 4 head-parallel ranks: neither split nor repeated
    expect_error(
        results,
        "K/V heads neither split nor repeated",
        ValueError,
        r"head_parallel=4 and the 3 K/V heads must divide one another",
        lambda: mesh_cp.mesh_attn_func(torch.zeros(1, 8, 12, 8), kv3, kv3, mesh=mesh),
    )
    debug = mesh_cp.CPMesh.create(group, tile=(1, 2), head_parallel=2, debug=True)
    q = torch.randn(1, 4, 4, 8, requires_grad=True)
    out, lse = mesh_cp.mesh_attn_func(q, q, q, mesh=debug, return_lse=True)
    loss = out.sum() + (lse.sum() if debug.rank % 2 == 0 else 0)  # the lse read on half the ranks
    expect_error(
        results,
        "lse read on some ranks only (debug)",
        ValueError,
        r"with and without a loss reading the lse .* add 0 \* lse.sum\(\) .*: a loss reads the returned lse "
        r"\(rank 0: True, rank 1: False, rank 2: True, rank 3: False\)",
        loss.backward,
    )
    return results


def heads_cases(group, rank: int, world: int) -> dict:
    results: dict = refusals(group, world) if world == 4 else {}
    for u, tile in LAYOUTS[world]:
        mesh = mesh_cp.CPMesh.create(group, tile=tile, head_parallel=u)
        for name, case in cases(world).items():
            for schedule in ("overlap", "collective"):
                key = f"P{world} u{u} {tile[0]}x{tile[1]} {schedule} {name}"
                results[key] = run_case(mesh, case, schedule, seed=zlib.crc32(key.encode()) % 1000)
                if name == "GQA causal":  # the lse returned, no loss reading it: no lse gradient sent, still exact
                    results[f"{key}, loss on out only"] = run_case(mesh, case, schedule, seed=7, lse_loss=False)
    return results


def heads_worker(rank: int, world: int) -> dict[int, dict]:
    return by_group_size(LAYOUTS, heads_cases, rank, world)


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, dict]]:
    """One spawned group of 16 ranks; P = 4 and 8 run on its first P ranks."""
    return spawn_gloo(heads_worker, max(LAYOUTS))


@pytest.fixture(scope="module", params=[4, 8, 16])
def heads_results(request, spawned) -> tuple[int, list[dict]]:
    return request.param, size_results(spawned, request.param)


def test_hybrid_matches_single_process_reference(heads_results) -> None:
    world, results = heads_results
    expected = len(LAYOUTS[world]) * (len(cases(world)) + 1) * 2  # + GQA causal with a loss on out only
    for rank, result in enumerate(results):
        refused = {k: result.pop(k) for k in list(result) if not isinstance(result[k], dict)}
        assert len(refused) == (7 if world == 4 else 0) and all(v is True for v in refused.values()), refused
        assert len(result) == expected, sorted(result)
        bad = {k: v for k, v in result.items() if max(v.values()) > TOL}
        assert not bad, f"rank {rank}: {bad}"
