"""The runtime under adverse conditions: subgroups of a parent group (lazy or device-bound default
group), timeouts, ranks that disagree, autocast, copies of a mesh."""

from __future__ import annotations

import datetime
import re

import torch

from tests.distributed.harness import expect_error, run_distributed


def subgroups_worker(rank: int, world: int) -> dict:
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

    def fake_split(*, parent_pg, split_ranks, timeout):
        calls.append((parent_pg, split_ranks, timeout))
        mine = next(g for g in split_ranks if dist.get_group_rank(parent_pg, rank) in g)
        members = [dist.get_global_rank(parent_pg, r) for r in mine]
        return dist.new_group(members, timeout=timeout, use_local_synchronization=True)

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
        if real_split is not None:
            dist.split_group = real_split
    return res


def test_new_subgroups_on_gloo_and_on_a_device_bound_world() -> None:
    for rank, res in enumerate(run_distributed(subgroups_worker, 4)):
        failures = {name: outcome for name, outcome in res.items() if outcome is not True}
        assert not failures, f"rank {rank}: {failures}"
        assert len(res) == 17, sorted(res)
