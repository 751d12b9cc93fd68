"""Process groups of the mesh: subgroups of a parent group, their device and their timeout.

Note [Subgroups of an eagerly initialised NCCL world]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``new_group(ranks, use_local_synchronization=True)`` is called by the members of ``ranks`` only,
so several data-parallel replicas can build their CP subgroups at once. That holds on gloo, and
on NCCL while the default group is lazy. When the default group is bound to a device
(``init_process_group(device_id=...)``, which DeepSpeed 0.19 does on CUDA), torch creates every
new NCCL group by ``ncclCommSplit`` of the *world* communicator, a collective over all ranks of
the world: members that split while non-members never call in wait forever. ``split_group``
splits the *parent's* communicator instead, called once by every rank of the parent with the
whole partition, so it cannot wait on ranks outside the parent.

::

    parent = CP group {4, 5, 6, 7}, partition [[4, 5], [6, 7]]
    lazy default group or gloo : new_group([4, 5]) on 4, 5;  new_group([6, 7]) on 6, 7
    default group bound to cuda: split_group(parent, [[0, 1], [2, 3]]) on 4, 5, 6, 7
                                 (split ranks are group ranks of the parent)
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def new_subgroups(
    parent: ProcessGroup, partition: Sequence[Sequence[int]], *, timeout: datetime.timedelta | None = None
) -> ProcessGroup:
    """Split ``parent`` into disjoint subgroups and return the one holding this rank.

    Collective over ``parent``: every rank of ``parent`` calls it with the same ``partition``, a list of
    disjoint, non-empty lists of *global* ranks whose union is the ranks of ``parent``. Within a
    subgroup, group ranks follow the members' group ranks in ``parent`` (and their global ranks,
    which must be in the same order). See Note [Subgroups of an eagerly initialised NCCL world] for
    how the subgroup is made: ``new_group(..., use_local_synchronization=True)`` among its members on
    gloo or when the default group is not bound to a device, ``split_group`` of ``parent`` (torch >=
    2.5) when it is.

    ``timeout`` bounds every collective of the subgroup; ``None`` means the timeout of ``parent`` (or,
    when it cannot be read, of the default group; torch's default when neither can).

    torch names such a subgroup after its members and the number of process groups this rank has
    made so far: the ranks of ``parent`` must have made the same number before (as the ranks of
    every data-parallel replica do when each replica builds the same groups), or they wait for each
    other until the timeout.
    """
    if not isinstance(parent, ProcessGroup):
        raise ValueError(f"parent must be a torch.distributed ProcessGroup, got {type(parent).__name__}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
    me = dist.get_rank()
    parent_ranks = dist.get_process_group_ranks(parent)
    if me not in parent_ranks:
        raise ValueError(
            f"global rank {me} is not a member of the parent group (members {parent_ranks}); "
            f"call new_subgroups on the ranks of the parent only"
        )
    members = _check_partition(partition, parent_ranks)
    mine = next(group for group in members if me in group)
    if timeout is None:
        timeout = group_timeout(parent)
    if _splits_parent(parent):
        split = getattr(dist, "split_group", None)
        if split is None:
            raise NotImplementedError(
                f"subgroups of a process group on a default group bound to {dist.group.WORLD.bound_device_id} "
                f"need torch.distributed.split_group (torch >= 2.5, found {torch.__version__}); upgrade torch, "
                f"or call init_process_group without device_id"
            )
        group_rank = {g: r for r, g in enumerate(parent_ranks)}
        pg = split(parent_pg=parent, split_ranks=[[group_rank[g] for g in group] for group in members], timeout=timeout)
    else:
        if mine != sorted(mine):
            raise NotImplementedError(
                f"the parent group's ranks {parent_ranks} are not in ascending global order, so its subgroup "
                f"{mine} would number its members differently; build the parent with ascending global ranks"
            )
        pg = dist.new_group(mine, timeout=timeout, backend=dist.get_backend(parent), use_local_synchronization=True)
    if not isinstance(pg, ProcessGroup):
        raise AssertionError(f"subgroup {mine} of global rank {me} was not created (got {pg!r})")
    return pg


def _check_partition(partition: Sequence[Sequence[int]], parent_ranks: list[int]) -> list[list[int]]:
    """The partition as lists of global ranks, each in the parent's group-rank order; raise unless valid."""
    if isinstance(partition, (str, bytes)) or not isinstance(partition, Sequence):
        raise ValueError(f"partition must be a list of lists of global ranks, got {partition!r}")
    order = {g: r for r, g in enumerate(parent_ranks)}
    seen: list[int] = []
    members: list[list[int]] = []
    for group in partition:
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or len(group) == 0:
            raise ValueError(f"every part of the partition must be a non-empty list of global ranks, got {group!r}")
        for g in group:
            if not isinstance(g, int) or isinstance(g, bool) or g not in order:
                raise ValueError(f"partition {partition!r} names rank {g!r}, not a member of the parent {parent_ranks}")
        seen += group
        members.append(sorted(group, key=order.__getitem__))
    if sorted(seen) != sorted(parent_ranks):
        raise ValueError(
            f"partition {partition!r} must cover every rank of the parent {parent_ranks} exactly once (disjoint parts)"
        )
    return members


def _splits_parent(parent: ProcessGroup) -> bool:
    """Whether subgroups of ``parent`` must be made by ``split_group``: a non-gloo parent while the default
    group is bound to a device (Note [Subgroups of an eagerly initialised NCCL world])."""
    if getattr(dist.group.WORLD, "bound_device_id", None) is None:
        return False
    # "gloo", "nccl", or per device: "cpu:gloo,cuda:nccl".
    names = {part.split(":")[-1].strip() for part in str(dist.get_backend(parent)).split(",")}
    return names != {"gloo"}


def group_timeout(group: ProcessGroup) -> datetime.timedelta | None:
    """The timeout of ``group``'s collectives, else of the default group; ``None`` when neither can be read.

    torch keeps it in the options of the group's backend (``Backend.options._timeout``); a torch that does
    not expose them gives ``None``, and subgroups then get torch's default unless given ``timeout=``.
    """
    for pg in (group, dist.group.WORLD):
        timeout = _backend_timeout(pg)
        if timeout is not None:
            return timeout
    return None


def _backend_timeout(group: ProcessGroup | None) -> datetime.timedelta | None:
    if not isinstance(group, ProcessGroup):
        return None
    try:
        backend = group._get_backend(group_device(group))
        backend = getattr(backend, "wrapped_pg", backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def group_device(group: ProcessGroup) -> torch.device:
    """The device on which ``group`` takes tensors for small control collectives.

    The CPU when ``group`` has a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``); otherwise the group's
    bound device, or the current device of its accelerator: NCCL users must call
    ``torch.cuda.set_device(local_rank)`` before building a mesh, or every rank talks from GPU 0.
    """
    types = list(getattr(group, "_device_types", None) or ())
    if not types:
        backend = str(dist.get_backend(group))
        types = [torch.device("cuda")] if backend == "nccl" else [torch.device("cpu")]
    if any(t.type == "cpu" for t in types):
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    kind = types[0].type
    return torch.device(kind, getattr(torch, kind).current_device())
