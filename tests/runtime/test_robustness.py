"""The runtime under adverse conditions: subgroups of a parent group (lazy or device-bound default
group), timeouts, ranks that disagree, autocast, copies of a mesh."""

from __future__ import annotations

import contextlib
import datetime
import re

import pytest
import torch

from mesh_cp.testing import expect_error, spawn_gloo


def subgroups_checks(rank: int) -> dict:
    """``new_subgroups`` on gloo for real, and the split path with a mocked device-bound default group."""
    import torch.distributed as dist

    from mesh_cp.runtime.groups import group_timeout, new_subgroups

    res: dict = {}
    world_timeout = group_timeout(dist.group.WORLD)
    res["world timeout read"] = world_timeout == datetime.timedelta(seconds=300) or world_timeout

    # Parent {0, 2} / {1, 3} (itself a subgroup), then singletons of it.
    parent = new_subgroups(dist.group.WORLD, [[0, 2], [1, 3]])
    res["parent members"] = dist.get_process_group_ranks(parent) == [rank % 2, rank % 2 + 2]
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=parent)
    res["parent all_reduce"] = total.item() == 2 * (rank % 2) + 2
    res["inherits timeout"] = group_timeout(parent) == world_timeout or group_timeout(parent)
    short = datetime.timedelta(seconds=42)
    child = new_subgroups(parent, [[0], [2]] if rank % 2 == 0 else [[3], [1]], timeout=short)
    res["child members"] = dist.get_process_group_ranks(child) == [rank]
    res["timeout= wins"] = group_timeout(child) == short or group_timeout(child)

    partner = [[0, 2], [1, 3]][rank % 2]
    expect_error(
        res,
        "partition misses a rank",
        ValueError,
        rf"must cover every rank of the parent {re.escape(str(partner))} exactly once",
        lambda: new_subgroups(parent, [partner[:1]]),
    )
    expect_error(
        res,
        "partition overlaps",
        ValueError,
        r"exactly once",
        lambda: new_subgroups(parent, [partner, partner[:1]]),
    )
    expect_error(
        res,
        "rank outside the parent",
        ValueError,
        r"names rank 9, not a member of the parent",
        lambda: new_subgroups(parent, [partner, [9]]),
    )
    expect_error(
        res,
        "parent None",
        ValueError,
        r"parent must be a .*ProcessGroup, got NoneType",
        lambda: new_subgroups(None, [[0]]),
    )

    # A device-bound default group with an NCCL parent takes split_group on the parent, with the
    # parent's group ranks and timeout (split_group needs NCCL: mocked, it records and builds the group).
    calls = []

    fake_split = _recording_split_group(rank, calls)
    real_backend, real_split = dist.get_backend, getattr(dist, "split_group", None)
    world_group = dist.group.WORLD
    try:
        world_group.bound_device_id = torch.device("cuda", 0)
        # A gloo parent keeps new_group even on a bound default group.
        gloo_child = new_subgroups(parent, [[0], [2]] if rank % 2 == 0 else [[1], [3]])
        res["gloo parent on bound world"] = dist.get_process_group_ranks(gloo_child) == [rank]
        dist.get_backend = lambda group=None: "nccl" if group is parent else real_backend(group)
        dist.split_group = fake_split
        split_child = new_subgroups(parent, [[2], [0]] if rank % 2 == 0 else [[1], [3]])
        res["split called once"] = len(calls) == 1 or calls
        if calls:
            pg, ranks, timeout = calls[0]
            res["split parent"] = pg is parent
            res["split ranks are parent group ranks"] = ranks == [[1], [0]] if rank % 2 == 0 else ranks == [[0], [1]]
            res["split timeout"] = timeout == world_timeout or timeout
        res["split child members"] = dist.get_process_group_ranks(split_child) == [rank]
        del dist.split_group
        expect_error(
            res,
            "split_group missing",
            NotImplementedError,
            r"need torch.distributed.split_group \(torch >= 2.5",
            lambda: new_subgroups(parent, [[0], [2]] if rank % 2 == 0 else [[1], [3]]),
        )
    finally:
        world_group.bound_device_id = None
        dist.get_backend = real_backend
        _restore_split_group(real_split)
    return res


def _recording_split_group(rank: int, calls: list):
    """A stand-in for ``dist.split_group`` (which needs NCCL): it records its arguments in ``calls`` and
    builds this rank's subgroup of the partition with ``new_group``."""
    import torch.distributed as dist

    def split(*, parent_pg, split_ranks, timeout):
        calls.append((parent_pg, split_ranks, timeout))
        mine = next(g for g in split_ranks if dist.get_group_rank(parent_pg, rank) in g)
        members = [dist.get_global_rank(parent_pg, r) for r in mine]
        return dist.new_group(members, timeout=timeout, use_local_synchronization=True)

    return split


def _restore_split_group(real_split) -> None:
    """Put back ``dist.split_group`` as it was before a test replaced (or deleted) it."""
    import torch.distributed as dist

    if real_split is not None:
        dist.split_group = real_split
    elif hasattr(dist, "split_group"):
        del dist.split_group


def _inputs(seed: int, batch: int = 1, seq: int = 32, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=gen) for _ in range(2))
    do = torch.randn(batch, seq, heads, dim, generator=gen)
    return q, k, v, do


def _shard(mesh, t, layout="zigzag"):
    import mesh_cp

    return mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout=layout)


def _exact(mesh, seed: int, **kwargs) -> float:
    """Max abs error of ``mesh_attn_func`` (forward) against the fp64 reference, causal zig-zag."""
    import mesh_cp
    from mesh_cp.core.numerics import reference_attention

    q, k, v, _ = (t.double() for t in _inputs(seed))
    ref, _ = reference_attention(q, k, v, causal=True)
    out = mesh_cp.mesh_attn_func(*(_shard(mesh, t) for t in (q, k, v)), mesh=mesh, causal=True, **kwargs)
    return (out - _shard(mesh, ref)).abs().max().item()


def mesh_checks(rank: int) -> dict:
    """CPMesh.create: split path on a mocked device-bound world, timeouts, non-members, copies."""
    import copy

    import torch.distributed as dist

    import mesh_cp
    from mesh_cp.runtime.groups import group_device, group_timeout, new_subgroups

    res: dict = {}
    world = dist.group.WORLD
    # The Q/KV subgroups take the CP group's timeout (the init_process_group one here), or timeout=.
    mesh = mesh_cp.CPMesh.create(world, tile=(2, 2))
    for name in ("q_group", "kv_group", "check_group"):
        got = group_timeout(getattr(mesh, name))
        res[f"{name} inherits timeout"] = got == datetime.timedelta(seconds=300) or got
    short = mesh_cp.CPMesh.create(world, tile=(2, 2), timeout=datetime.timedelta(seconds=42))
    got = [group_timeout(g) for g in (short.q_group, short.kv_group, short.check_group)]
    res["timeout= reaches subgroups"] = got == [datetime.timedelta(seconds=42)] * 3 or got
    expect_error(
        res,
        "timeout type",
        ValueError,
        r"timeout must be a datetime.timedelta or None, got 5",
        lambda: mesh_cp.CPMesh.create(world, tile=(2, 2), timeout=5),
    )
    expect_error(
        res,
        "debug differs across ranks",
        ValueError,
        r"different meshes: debug \(rank 0: False, rank 1: True, rank 2: False, rank 3: False\)",
        lambda: mesh_cp.CPMesh.create(world, tile=(2, 2), debug=rank == 1),
    )

    # A mesh is a handle: copies are the mesh itself, and objects holding one can be deep-copied.
    holder = torch.nn.Linear(2, 2)
    holder.mesh = mesh
    clone = copy.deepcopy(holder)
    res["deepcopy mesh"] = copy.deepcopy(mesh) is mesh and copy.copy(mesh) is mesh
    res["deepcopy holder"] = clone.mesh is mesh and clone.weight is not holder.weight
    res["deepcopy holder weights"] = torch.equal(clone.weight, holder.weight)

    # new_group (without local synchronization) gives non-members GroupMember.NON_GROUP_MEMBER. Every
    # rank builds one mesh on its pair (member-local groups are named by the count of groups before).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = mesh_cp.CPMesh.create(pairs[rank // 2], tile=(1, 2))
    res["member mesh"] = str(mine).startswith(f"CP(1x2) rank {rank % 2}") or str(mine)
    other = (rank // 2 + 1) % 2
    expect_error(
        res,
        "non-member",
        ValueError,
        rf"global rank {rank} is not a member of the CP group it passed \(new_group returns "
        r"GroupMember.NON_GROUP_MEMBER",
        lambda: mesh_cp.CPMesh.create(pairs[other], tile=(1, 2)),
    )
    expect_error(
        res,
        "None names non-members",
        ValueError,
        r"group=None is not accepted.*returns None to ranks outside the group",
        lambda: mesh_cp.CPMesh.create(None, tile=(2, 2)),
    )

    # A DP 2 x CP 2 layout on a default group bound to a device, with NCCL CP groups (mocked): the
    # mesh's subgroups are splits of the CP group (group ranks), with its timeout, and work.
    cp = new_subgroups(world, [[0, 1], [2, 3]])
    calls = []

    fake_split = _recording_split_group(rank, calls)
    real_backend, real_split = dist.get_backend, getattr(dist, "split_group", None)
    try:
        world.bound_device_id = torch.device("cuda", 0)
        dist.get_backend = lambda group=None: "nccl" if group is cp else real_backend(group)
        dist.split_group = fake_split
        split_mesh = mesh_cp.CPMesh.create(cp, tile=(2, 1))
    finally:
        world.bound_device_id = None
        dist.get_backend = real_backend
        _restore_split_group(real_split)
    res["split from the CP group"] = [c[0] is cp for c in calls] == [True] * 3 or calls
    res["split partitions"] = [c[1] for c in calls] == [[[0, 1]], [[0], [1]], [[0, 1]]] or [c[1] for c in calls]
    res["split timeout"] = all(c[2] == datetime.timedelta(seconds=300) for c in calls) or calls
    err = _exact(split_mesh, seed=3)
    res["split mesh exact"] = err < 1e-12 or err

    # The device of control collectives: CPU when the group has a CPU backend, else its bound device,
    # else the current device (torch.cuda.set_device(local_rank) first).
    class FakeNcclGroup:
        _device_types = [torch.device("cuda")]
        bound_device_id = torch.device("cuda", 1)

    res["device of gloo group"] = group_device(world) == torch.device("cpu")
    res["device of bound nccl group"] = group_device(FakeNcclGroup()) == torch.device("cuda", 1)
    real_current = torch.cuda.current_device
    try:
        FakeNcclGroup.bound_device_id = None
        torch.cuda.current_device = lambda: 3
        res["device of lazy nccl group"] = group_device(FakeNcclGroup()) == torch.device("cuda", 3)
    finally:
        torch.cuda.current_device = real_current
    return res


def autocast_checks(rank: int) -> dict:
    """CPU bf16 autocast with fp32 weights: q, k fp32 (RoPE) and v bf16 are cast like SDPA's inputs."""
    import torch.distributed as dist

    import mesh_cp
    from mesh_cp.core.numerics import reference_attention

    res: dict = {}
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2), debug=True)
    q, k, v, do = _inputs(5, batch=2, seq=64, heads=4, kv_heads=2, dim=32)
    v = v.bfloat16()
    do = _shard(mesh, do.bfloat16())
    leaves = [_shard(mesh, t).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mesh_cp.mesh_attn_func(*leaves, mesh=mesh, causal=True)
    out.backward(do)
    res["out in autocast dtype"] = out.dtype == torch.bfloat16
    res["grads in input dtypes"] = [t.grad.dtype for t in leaves] == [torch.float32, torch.float32, torch.bfloat16]

    # The same call on inputs cast by hand, outside autocast: the very same numbers.
    cast = [t.detach().bfloat16().requires_grad_() for t in leaves]
    out_cast = mesh_cp.mesh_attn_func(*cast, mesh=mesh, causal=True)
    out_cast.backward(do)
    res["out equals cast inputs"] = torch.equal(out, out_cast)
    res["grads equal cast inputs"] = all(
        torch.equal(t.grad, c.grad.to(t.dtype)) for t, c in zip(leaves, cast, strict=True)
    )
    # Backward run inside autocast too: kernels are not recast.
    again = [t.detach().clone().requires_grad_() for t in leaves]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mesh_cp.mesh_attn_func(*again, mesh=mesh, causal=True).backward(do)
    res["grads with backward in autocast"] = all(
        torch.equal(t.grad, a.grad) for t, a in zip(leaves, again, strict=True)
    )

    # Against fp64 attention on the cast inputs: within 2x plain bf16 SDPA's error.
    full = [t.bfloat16() for t in (q, k, v)]
    gold, _ = reference_attention(*(t.double() for t in full), causal=True)
    plain = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in full), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    dist_err = (out.double() - _shard(mesh, gold)).abs().max().item()
    plain_err = (_shard(mesh, plain).double() - _shard(mesh, gold)).abs().max().item()
    res["error vs fp64 of cast inputs"] = dist_err <= 2 * plain_err or (dist_err, plain_err)

    expect_error(
        res,
        "mixed dtypes outside autocast",
        ValueError,
        r"share one dtype, got torch.float32, torch.float32, torch.bfloat16",
        lambda: mesh_cp.mesh_attn_func(*(t.detach() for t in leaves), mesh=mesh),
    )
    return res


def disagreement_checks(rank: int) -> dict:
    """Ranks that call with different shapes, dtypes or options raise a ValueError naming each rank's
    value, on every rank: on a plain mesh for signatures new to every rank, and on a debug mesh
    also after the same signature was checked before. The groups stay usable afterwards."""
    import torch.distributed as dist

    import mesh_cp

    res: dict = {}
    odd = rank == 1
    q, k, v, _ = _inputs(7, seq=32)
    base = {"causal": True, "layout": "zigzag"}
    # name: (q, k, v, options) of this rank, pattern every rank must see.
    cases = {
        "seq_local": (
            (q[:, :4], k[:, :4], v[:, :4]) if odd else (q[:, :8], k[:, :8], v[:, :8]),
            {},
            r"q shape \(rank 0: \(1, 8, 4, 16\), rank 1: \(1, 4, 4, 16\), rank 2: \(1, 8, 4, 16\)",
        ),
        "heads": (
            (q[:, :8, :2], k[:, :8], v[:, :8]) if odd else (q[:, :8], k[:, :8], v[:, :8]),
            {},
            r"q shape \(rank 0: \(1, 8, 4, 16\), rank 1: \(1, 8, 2, 16\)",
        ),
        "head_dim": (
            tuple(t[:, :8, :, :8] for t in (q, k, v)) if odd else tuple(t[:, :8] for t in (q, k, v)),
            {},
            r"q shape \(rank 0: \(1, 8, 4, 16\), rank 1: \(1, 8, 4, 8\).*k shape .*v shape",
        ),
        "dtype of the same size": (
            tuple(t[:, :8].to(torch.bfloat16 if odd else torch.float16) for t in (q, k, v)),
            {},
            r"dtypes \(rank 0: 'torch.float16, torch.float16, torch.float16', "
            r"rank 1: 'torch.bfloat16, torch.bfloat16, torch.bfloat16'",
        ),
        "causal": (None, {"causal": not odd}, r"causal \(rank 0: True, rank 1: False, rank 2: True, rank 3: True\)"),
        "return_lse": (
            None,
            {"return_lse": odd},
            r"return_lse \(rank 0: False, rank 1: True",
        ),
        "layout": (
            None,
            {"layout": "contiguous" if odd else "zigzag"},
            r"layout \(rank 0: 'zigzag', rank 1: 'contiguous'",
        ),
        "softmax_scale": (None, {"softmax_scale": 0.5 if odd else None}, r"softmax_scale \(rank 0: 0.25, rank 1: 0.5"),
        "schedule": (
            None,
            {"schedule": "collective" if odd else "overlap"},
            r"schedule \(rank 0: 'overlap', rank 1: 'collective'",
        ),
        "backward": (
            None,
            {"backward": "reuse" if odd else "regather"},
            r"backward \(rank 0: 'regather', rank 1: 'reuse'",
        ),
        "kernel": (
            None,
            {"kernel": "reference" if odd else "cpu_flash"},
            r"kernel \(rank 0: 'cpu_flash', rank 1: 'reference'",
        ),
        "requires grad": (
            tuple(t[:, :8].clone().requires_grad_(odd) for t in (q, k, v)),
            {},
            r"requires grad \(rank 0: False, rank 1: True",
        ),
    }
    plain = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    debug = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2), debug=True)
    same = tuple(t[:, :8] for t in (q, k, v))
    # On the debug mesh, every rank first makes the call most cases keep on the ranks that agree.
    debug_ok = mesh_cp.mesh_attn_func(*same, mesh=debug, kernel="cpu_flash", **base)
    res["debug mesh first call"] = debug_ok.shape == same[0].shape
    for mesh_name, mesh in (("plain", plain), ("debug", debug)):
        for name, (tensors, options, pattern) in cases.items():
            kwargs = {**base, "kernel": "cpu_flash", **options}
            expect_error(
                res,
                f"{mesh_name}: {name}",
                ValueError,
                r"ranks of the CP group called mesh_attn_func with different arguments: .*" + pattern,
                lambda: mesh_cp.mesh_attn_func(*(tensors or same), mesh=mesh, **kwargs),
            )
        err = _exact(mesh, seed=11)
        res[f"{mesh_name}: exact after the errors"] = err < 1e-12 or err

    # The check runs once per new signature (this scale is new) on a plain mesh (on its check group), on
    # every call in debug.
    x = tuple(t.double() for t in same)
    sent = {}
    for mesh_name, mesh in (("plain", plain), ("debug", debug)):
        for call in range(2):
            with mesh_cp.CommCounter() as counter:
                mesh_cp.mesh_attn_func(*x, mesh=mesh, causal=True, softmax_scale=0.3)
            sent[mesh_name, call] = counter.bytes_by_role(mesh).get("check", 0)
    # A packed batch's documents change every step: the check keys on the mask's form (rows, window), so a new
    # packing is not a new signature; debug compares the documents too.
    seq = x[0].shape[1] * dist.get_world_size()
    for mesh_name, mesh in (("plain", plain), ("debug", debug)):
        for call in range(2):
            cut = 3 + 2 * call  # another packing on the second call
            mask = mesh_cp.AttentionMask.from_lengths([[cut, seq - cut]] * x[0].shape[0])
            with mesh_cp.CommCounter() as counter:
                mesh_cp.mesh_attn_func(*x, mesh=mesh, causal=True, softmax_scale=0.3, mask=mask)
            sent[f"{mesh_name} masked", call] = counter.bytes_by_role(mesh).get("check", 0)
    checked = {key: value > 0 for key, value in sent.items()}
    res["checks once, every call in debug"] = (
        checked
        == {
            ("plain", 0): True,
            ("plain", 1): False,
            ("debug", 0): True,
            ("debug", 1): True,
            ("plain masked", 0): True,
            ("plain masked", 1): False,
            ("debug masked", 0): True,
            ("debug masked", 1): True,
        }
        or sent
    )
    lengths = [[3 + dist.get_rank(), seq - 3 - dist.get_rank()]] * x[0].shape[0]  # each rank another packing
    expect_error(
        res,
        "debug: documents differ across ranks",
        ValueError,
        r"with different arguments: mask contents \(rank 0: ",
        lambda: mesh_cp.mesh_attn_func(*x, mesh=debug, causal=True, mask=mesh_cp.AttentionMask.from_lengths(lengths)),
    )

    # A kernel that resolves on some ranks and cannot run on one (a flash-attn that fails to import on one
    # node): every rank raises the named mismatch instead of three ranks waiting for the fourth.
    from unittest import mock

    from mesh_cp.runtime import attention

    def broken(*args, **kwargs):
        raise RuntimeError("flash-attn cannot be imported here")

    with mock.patch.object(attention, "resolve_kernel", broken) if odd else contextlib.nullcontext():
        expect_error(
            res,
            "a kernel that cannot run on one rank",
            ValueError,
            r"block kernel \(rank 0: 'cpu_flash', rank 1: 'cannot run', rank 2: 'cpu_flash'",
            lambda: mesh_cp.mesh_attn_func(*same, mesh=plain, kernel="auto", **base),
        )
    return res


def p2p_checks(rank: int) -> dict:
    """The overlapped schedule's ring steps run on torch 2.4's P2POp (a global peer rank, no group_peer=)."""
    import torch.distributed as dist

    import mesh_cp

    res: dict = {}
    real = dist.P2POp

    def p2p_op_2_4(op, tensor, peer, group=None, tag=0):
        return real(op, tensor, peer, group, tag)

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    try:
        dist.P2POp = p2p_op_2_4
        err: object = _exact(mesh, seed=13, schedule="overlap")
    except TypeError as e:
        err = f"TypeError: {e}"
    finally:
        dist.P2POp = real
    res["overlap on torch 2.4 P2POp"] = (isinstance(err, float) and err < 1e-12) or err
    return res


def robustness_worker(rank: int, world: int) -> dict:
    res: dict = {}
    for part, checks in (
        ("subgroups", subgroups_checks),
        ("mesh", mesh_checks),
        ("autocast", autocast_checks),
        ("disagree", disagreement_checks),
        ("p2p", p2p_checks),
    ):
        res.update({f"{part}/{name}": outcome for name, outcome in checks(rank).items()})
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """One spawned group of 4 ranks for every multi-rank case of this module but the stalled rank."""
    return spawn_gloo(robustness_worker, 4)


@pytest.mark.parametrize("part", ["subgroups", "mesh", "autocast", "disagree", "p2p"])
def test_runtime_robustness(results: list[dict], part: str) -> None:
    for rank, res in enumerate(results):
        mine = {name: outcome for name, outcome in res.items() if name.startswith(part + "/")}
        assert mine, f"rank {rank} ran no {part} case"
        failures = {name: outcome for name, outcome in mine.items() if outcome is not True}
        assert not failures, f"rank {rank}: {failures}"


STALL_TIMEOUT = datetime.timedelta(seconds=3)


def stalled_rank_worker(rank: int, world: int, marker: str) -> dict:
    """Rank 1 stalls before its second attention call; rank 0 must raise within the group's timeout."""
    import os
    import time

    import torch.distributed as dist

    import mesh_cp

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, 2))  # the KV-group is a subgroup of both ranks
    local = [_shard(mesh, t) for t in _inputs(17)[:3]]
    mesh_cp.mesh_attn_func(*local, mesh=mesh)  # in step; the signature is checked once
    if rank == 1:  # stall (boundedly) until rank 0 has given up
        give_up = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < give_up:
            time.sleep(0.05)
        return {}
    start = time.monotonic()
    try:
        mesh_cp.mesh_attn_func(*local, mesh=mesh)
        outcome = "did not raise"
    except RuntimeError as err:
        outcome = f"RuntimeError: {err}"
    elapsed = time.monotonic() - start
    with open(marker, "w"):
        pass
    return {"elapsed": elapsed, "outcome": outcome}


def test_stalled_rank_makes_the_others_raise_within_the_timeout(tmp_path) -> None:
    from mesh_cp.testing import spawn_gloo

    results = spawn_gloo(
        stalled_rank_worker,
        2,
        str(tmp_path / "rank0_gave_up"),
        timeout=STALL_TIMEOUT,
        final_barrier=False,  # the ranks leave out of step
        deadline=120,
    )
    elapsed, outcome = results[0]["elapsed"], results[0]["outcome"]
    assert outcome.startswith("RuntimeError"), outcome
    limit = STALL_TIMEOUT.total_seconds()
    assert 0.5 * limit <= elapsed <= limit + 5, f"rank 0 raised after {elapsed:.1f} s (timeout {limit} s): {outcome}"
