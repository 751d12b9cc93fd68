"""The public API on real process groups: bad inputs, sharding, DeviceMesh / DP x CP, low precision, the collator's
examples (tests/runtime/test_batch.py).

The cases on 4 ranks share one spawned group (:func:`world4`); each test reads its own section of it."""

from __future__ import annotations

import pytest
import torch

import mesh_cp
from mesh_cp.core import Tiling, layout_permutation
from mesh_cp.core.numerics import reference_attention
from mesh_cp.testing import expect_error, run_sections, section_results, spawn_gloo
from tests.runtime.test_batch import check_examples_section, examples_section


def errors_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    res: dict = {}
    world_group = dist.group.WORLD
    expect_error(
        res, "group None", ValueError, r"group=None is not accepted", lambda: mesh_cp.CPMesh.create(None, tile=(1, 2))
    )
    expect_error(
        res,
        "group type",
        ValueError,
        r"must be a torch.distributed ProcessGroup",
        lambda: mesh_cp.CPMesh.create("world", tile=(1, 2)),
    )
    expect_error(
        res,
        "tile does not factor P",
        ValueError,
        r"tile 3x1 does not factor the CP group size 2 .*choose one of: 1x2, 2x1",
        lambda: mesh_cp.CPMesh.create(world_group, tile=(3, 1)),
    )
    expect_error(
        res,
        "tiles differ across ranks",
        ValueError,
        r"asked for different meshes: tile \(rank 0: '1x2', rank 1: '2x1'\)",
        lambda: mesh_cp.CPMesh.create(world_group, tile=(1, 2) if rank == 0 else (2, 1)),
    )
    mesh = mesh_cp.CPMesh.create(world_group, tile=(1, 2))
    res["str"] = str(mesh) == f"CP(1x2) rank {rank}: Q-group [{rank}], KV-group [0, 1]" or str(mesh)

    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 4, 2, 8)

    def call(*args, **kwargs):
        kwargs.setdefault("mesh", mesh)
        return mesh_cp.mesh_attn_func(*args, **kwargs)

    expect_error(
        res, "mesh None", ValueError, r"mesh must be a mesh_cp.CPMesh .*CPMesh.create", lambda: call(q, k, k, mesh=None)
    )
    expect_error(
        res,
        "dtypes differ",
        ValueError,
        r"share one dtype, got torch.float32, torch.float64",
        lambda: call(q, k.double(), k),
    )
    expect_error(
        res, "devices differ", ValueError, r"one device, got cpu, meta", lambda: call(q, k.to("meta"), k.to("meta"))
    )
    expect_error(
        res, "3-D input", ValueError, r"q must be 4-D \(batch, seq_local, heads, head_dim\)", lambda: call(q[0], k, k)
    )
    expect_error(
        res, "k/v shapes differ", ValueError, r"k and v must have the same shape", lambda: call(q, k, k[:, :2])
    )
    expect_error(
        res,
        "seq differs",
        ValueError,
        r"batch, seq_local and head_dim must be equal",
        lambda: call(q, k[:, :2], k[:, :2]),
    )
    expect_error(
        res,
        "heads not divisible",
        ValueError,
        r"q heads 4 must be a multiple of k/v heads 3",
        lambda: call(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)),
    )
    expect_error(
        res,
        "zero kv heads",
        ValueError,
        r"k/v have 0 heads \(shape \(1, 4, 0, 8\)\); kv_heads must be at least 1",
        lambda: call(q, torch.randn(1, 4, 0, 8), torch.randn(1, 4, 0, 8)),
    )
    expect_error(
        res,
        "zigzag odd local length",
        ValueError,
        r"seq_local 3 must be even for the zigzag layout .*multiple of 2\*P = 4",
        lambda: call(q[:, :3], k[:, :3], k[:, :3], causal=True),
    )
    expect_error(
        res,
        "int dtype",
        NotImplementedError,
        r"dtype torch.int64 is not supported",
        lambda: call(q.long(), k.long(), k.long()),
    )
    expect_error(
        res, "layout", ValueError, r"layout 'striped' is not supported", lambda: call(q, k, k, layout="striped")
    )
    expect_error(res, "kernel", ValueError, r"unknown kernel 'xformers'", lambda: call(q, k, k, kernel="xformers"))
    expect_error(
        res,
        "schedule",
        ValueError,
        r"schedule .ring. is not supported; choose one of \['collective', 'overlap'\]",
        lambda: call(q, k, k, schedule="ring"),
    )
    expect_error(
        res, "backward mode", ValueError, r"backward 'keep' is not supported", lambda: call(q, k, k, backward="keep")
    )
    expect_error(
        res,
        "shard not divisible",
        ValueError,
        r"seq_len 6 must be a positive multiple of 4 .*pad the sequence to 8",
        lambda: mesh_cp.shard_sequence(torch.zeros(6), mesh=mesh, dim=0, layout="zigzag"),
    )
    expect_error(
        res,
        "unshard with grad",
        NotImplementedError,
        r"not differentiable; pass x_local.detach\(\)",
        lambda: mesh_cp.unshard_sequence(torch.zeros(2, requires_grad=True), mesh=mesh, dim=0, layout="zigzag"),
    )
    res.update(counter_checks(rank, mesh))
    return res


def counter_checks(rank: int, mesh) -> dict:
    """CommCounter on ops the attention does not use: p2p, broadcast, all-reduce, functional collectives."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    x = torch.zeros(10)  # 40 bytes
    with mesh_cp.CommCounter() as counter:
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
    p2p = counter.bytes_sent() == (40 if rank == 0 else 0)
    with mesh_cp.CommCounter() as counter:
        dist.broadcast(x, src=1)
    bcast = counter.bytes_sent() == (40 if rank == 1 else 0)
    with mesh_cp.CommCounter() as counter:
        dist.all_reduce(torch.zeros(100))
    allreduce = counter.bytes_sent() == 400 and counter.bytes_by_role(mesh) == {"cp": 400}  # mesh.group is WORLD
    with mesh_cp.CommCounter() as counter:
        fc.all_gather_tensor(torch.zeros(25), 0, mesh.kv_group).wait()
    functional = counter.bytes_sent() == 100 and counter.bytes_by_role(mesh) == {"kv": 100}
    return {
        "count send/recv": p2p,
        "count broadcast": bcast,
        "count all_reduce": allreduce,
        "count functional": functional,
    }


def test_bad_inputs_raise_clear_errors() -> None:
    for rank, res in enumerate(spawn_gloo(errors_worker, 2)):
        assert len(res) == 25, sorted(res)
        failures = {name: outcome for name, outcome in res.items() if outcome is not True}
        assert not failures, f"rank {rank}: {failures}"


def sharding_worker(rank: int, world: int) -> dict:
    """DP 2 x CP 2 from a DeviceMesh: sharding round trips and exact attention in each CP group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    res: dict = {}
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    mesh = mesh_cp.CPMesh.from_device_mesh(device_mesh, "cp", tile=(2, 1))
    dp_rank = device_mesh.get_local_rank("dp")
    res["cp members"] = list(mesh.global_ranks)
    for layout in ("contiguous", "zigzag"):
        x = torch.arange(3 * 16 * 2, dtype=torch.float32).view(3, 16, 2) + 1000 * dp_rank
        local = mesh_cp.shard_sequence(x, mesh=mesh, dim=1, layout=layout)
        res[f"round trip {layout}"] = torch.equal(mesh_cp.unshard_sequence(local, mesh=mesh, dim=1, layout=layout), x)
        pos = mesh_cp.position_ids(16, mesh=mesh, layout=layout)
        res[f"positions {layout}"] = torch.equal(local[0, :, 0], x[0, pos, 0])
        res[f"permutation {layout}"] = (
            layout_permutation(16, 2, layout)[8 * mesh.rank : 8 * mesh.rank + 8] == pos.tolist()
        )

    # Different data per DP replica: each CP group must compute its own sequence exactly.
    gen = torch.Generator().manual_seed(7 + dp_rank)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    ref, _ = reference_attention(q, k, v, causal=True)
    local = [mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag") for t in (q, k, v)]
    out = mesh_cp.mesh_attn_func(*local, mesh=mesh, causal=True)
    res["dp x cp exact"] = (
        out - mesh_cp.shard_sequence(ref, mesh=mesh, dim=1, layout="zigzag")
    ).abs().max().item() < 1e-12
    res["dp rank"] = dp_rank
    dist.barrier()
    return res


def test_device_mesh_dp_by_cp_and_sharding_round_trips(world4) -> None:
    results = section_results(world4, "sharding")
    assert [r["cp members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for rank, res in enumerate(results):
        failures = {k: v for k, v in res.items() if k not in ("cp members", "dp rank") and v is not True}
        assert not failures, f"rank {rank}: {failures}"
    assert [r["dp rank"] for r in results] == [0, 0, 1, 1]


def low_precision_worker(rank: int, world: int) -> dict:
    """Distributed error vs fp64 against plain single-process attention's error, same low dtype."""
    import torch.distributed as dist

    res = {}
    for tile in ((2, 2), (1, 4)):
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        for dtype in (torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(11)
            q = torch.randn(2, 256, 8, 64, generator=gen).to(dtype)
            k, v = (torch.randn(2, 256, 2, 64, generator=gen).to(dtype) for _ in range(2))
            do = torch.randn(2, 256, 8, 64, generator=gen).to(dtype)

            def run(fn, inputs):
                leaves = [t.clone().requires_grad_() for t in inputs]
                out = fn(*leaves)
                out.backward(do.to(out.dtype) if out.shape == do.shape else None)
                return [out.detach(), *(leaf.grad for leaf in leaves)]

            gold = run(lambda *t: reference_attention(*t, causal=True)[0], [t.double() for t in (q, k, v)])
            plain = run(
                lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
                    q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True, enable_gqa=True
                ).transpose(1, 2),
                [q, k, v],
            )

            def shard(t):
                return mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag")

            leaves = [shard(t).requires_grad_() for t in (q, k, v)]
            out = mesh_cp.mesh_attn_func(*leaves, mesh=mesh, causal=True)
            out.backward(shard(do))
            mine = [out.detach(), *(leaf.grad for leaf in leaves)]
            for name, got, base, want in zip(("out", "dq", "dk", "dv"), mine, plain, gold, strict=True):
                dist_err = (got.double() - shard(want)).abs().max().item()
                plain_err = (shard(base).double() - shard(want)).abs().max().item()
                res[f"{tile} {dtype} {name}"] = (dist_err, plain_err, got.dtype == dtype)
    return res


def test_low_precision_error_at_most_twice_plain_attention(world4) -> None:
    for rank, res in enumerate(section_results(world4, "low precision")):
        assert len(res) == 16
        for name, (dist_err, plain_err, dtype_kept) in res.items():
            assert dtype_kept, name
            assert dist_err <= 2 * plain_err, (
                f"rank {rank} {name}: distributed {dist_err:.3g} > 2 x plain {plain_err:.3g}"
            )


def test_tiling_of_the_mesh_is_the_core_tiling() -> None:
    assert Tiling.parse("2x2", 4) == Tiling(world=4, a=2, b=2)
    with pytest.raises(ValueError, match="does not factor"):
        Tiling.parse("3x3", 4)


def _runs_exactly(mesh) -> bool | float:
    """Whether causal attention over ``mesh`` matches the single-process reference (else the error)."""
    from mesh_cp.core.numerics import reference_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8 * mesh.size, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    want, _ = reference_attention(q, k, v, causal=True)
    local = [mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag") for t in (q, k, v)]
    got = mesh_cp.mesh_attn_func(*local, mesh=mesh, causal=True)
    error = (got - mesh_cp.shard_sequence(want, mesh=mesh, dim=1, layout="zigzag")).abs().max().item()
    return error < 1e-10 or error


def auto_tile_worker(rank: int, world: int) -> dict:
    """``mesh_cp.auto_mesh``: the cost model's choice, used exactly, with topology-ordered rings."""
    import torch.distributed as dist

    from mesh_cp.core import AttentionShape
    from mesh_cp.sim import Topology, choose

    res: dict = {}
    # Two "nodes" of two ranks, inter-node links 20x slower: the Q ring of a 2x2 tile stays inside a node.
    topology = Topology(ranks_per_node=2, intra_bandwidth=2e10, inter_bandwidth=1e9, pairs_per_second=1e12)
    shape = AttentionShape(batch=1, seq_local=8192, heads=8, kv_heads=8, head_dim=64, itemsize=2)
    world_group = dist.group.WORLD
    mesh = mesh_cp.auto_mesh(world_group, topology=topology, shape=shape, head_parallel=1)
    expected = choose(world, shape, topology, head_parallel=1)
    res["auto tile"] = (mesh.tiling == expected.tiling and mesh.head_parallel == 1) or (mesh.tile, expected)
    res["reason"] = (mesh.reason == expected.reason and expected.reason.startswith(f"tile {expected.tiling}")) or (
        mesh.reason
    )
    # Without head_parallel=1 the choice spans head-parallel layouts too (hybrids, USP, Ulysses).
    hybrid = mesh_cp.auto_mesh(world_group, topology=topology, shape=shape)
    chosen = choose(world, shape, topology)
    got = (hybrid.head_parallel, hybrid.tiling, hybrid.reason)
    res["auto layout"] = got == (chosen.head_parallel, chosen.tiling, chosen.reason) or got
    res["auto layout runs"] = _runs_exactly(hybrid)
    fixed = mesh_cp.auto_mesh(world_group, tile=(2, 2), topology=topology)
    res["link cost"] = (fixed.link_cost[0] == 1.0 and fixed.link_cost[1] == 20.0) or fixed.link_cost
    expect_error(
        res,
        "auto needs shape",
        ValueError,
        r"tile='auto' needs topology= .* and shape=",
        lambda: mesh_cp.auto_mesh(world_group, topology=topology),
    )
    expect_error(
        res,
        "budget below every tile",
        ValueError,
        r"memory_budget 1 bytes is below the peak of every tile",
        lambda: mesh_cp.auto_mesh(world_group, topology=topology, shape=shape, memory_budget=1),
    )
    expect_error(
        res,
        "create refuses the cost model's arguments",
        ValueError,
        r"CPMesh.create got topology=: choosing the tile from a cluster topology is mesh_cp.auto_mesh",
        lambda: mesh_cp.CPMesh.create(world_group, tile=(2, 2), topology=topology),
    )
    expect_error(
        res,
        "auto_mesh refuses the former spelling",
        ValueError,
        r"'heads' was renamed 'head_parallel'",
        lambda: mesh_cp.auto_mesh(world_group, topology=topology, shape=shape, heads=1),
    )
    # A buffer budget at the least any path needs streams one ring; one byte less is refused.
    from mesh_cp.core import make_plan
    from mesh_cp.core.schedule import minimum_budget
    from mesh_cp.runtime.attention import attention_shape

    q4, k4, v4 = (torch.randn(1, 8, 4, 16, dtype=torch.float64) for _ in range(3))
    plan = make_plan(fixed.tiling, attention_shape(q4, k4, v4), causal=True, layout="zigzag")
    q_bytes, kv_bytes = plan.chunk_bytes()
    least = minimum_budget(2, 2, False, q_bytes, kv_bytes)
    enough = minimum_budget(2, 2, False, 2 * q_bytes, kv_bytes)  # backward holds q and dO per Q chunk
    expect_error(
        res,
        "budget too small",
        ValueError,
        rf"buffer budget {least - 1} bytes is too small for the 2x2 tile.* at least {least} bytes",
        lambda: mesh_cp.mesh_attn_func(q4, k4, v4, mesh=fixed, buffer_budget=least - 1),
    )
    # The chosen mesh, the topology-ordered schedule and the streaming one under a budget are exact.
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 32, 4, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    ref, _ = reference_attention(q, k, v, causal=True)
    for name, m, budget in (("auto", mesh, None), ("topology 2x2", fixed, None), ("budget", fixed, enough)):
        local = [mesh_cp.shard_sequence(t, mesh=m, dim=1, layout="zigzag") for t in (q, k, v)]
        out = mesh_cp.mesh_attn_func(*local, mesh=m, causal=True, buffer_budget=budget)
        err = (out - mesh_cp.shard_sequence(ref, mesh=m, dim=1, layout="zigzag")).abs().max().item()
        res[f"{name} exact"] = err < 1e-12 or err
    return res


def test_auto_tile_uses_the_cost_model_choice(world4) -> None:
    for rank, res in enumerate(section_results(world4, "auto tile")):
        failures = {k: v for k, v in res.items() if v is not True}
        assert not failures, f"rank {rank}: {failures}"


def test_sharding_collator_honours_the_documents_of_examples(world4) -> None:
    """``ShardingCollator`` over TRL's packed examples (tests/runtime/test_batch.py)."""
    check_examples_section(section_results(world4, "collator examples"))


WORLD4_SECTIONS = {
    "sharding": sharding_worker,
    "low precision": low_precision_worker,
    "auto tile": auto_tile_worker,
    "collator examples": examples_section,
}


def world4_worker(rank: int, world: int) -> dict[str, dict]:
    """Every section on 4 ranks in one spawned group."""
    return run_sections(WORLD4_SECTIONS, rank, world)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, dict]]:
    return spawn_gloo(world4_worker, 4)
