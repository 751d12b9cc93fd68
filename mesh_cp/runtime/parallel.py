"""Data parallel x context parallel: the DP x CP groups, and torch's DDP over them with mesh_cp's scaling (sum over
CP, mean over DP; Note [DDP over DP x CP] in :mod:`mesh_cp.runtime.gradients`)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mesh_cp.core.options import refuse_keywords
from mesh_cp.runtime.gradients import REPLACED, wrap_ddp
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh


def data_parallel(model: torch.nn.Module, *, mesh: CPMesh, **ddp_options) -> DistributedDataParallel:
    """``model`` in torch's ``DistributedDataParallel`` over the CP group ``mesh.group``, its gradients *summed* over
    it (each rank's loss is its share of the batch's): DDP's buckets, overlap with backward and ``no_sync()``, with a
    communication hook for the sum (Note [DDP over DP x CP] in :mod:`mesh_cp.runtime.gradients`). ``ddp_options``
    go to DDP (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...); ``process_group``,
    ``device_mesh``, ``mixed_precision`` and the delayed all-reduce are refused by name. Returns the DDP module: run
    forward and backward through it. Over DP x CP: :meth:`DataContextParallel.data_parallel`."""
    return wrap_ddp(model, mesh.group, divide_by=1, where="mesh_cp.data_parallel", **ddp_options)


def reduce_gradients(*args, **kwargs) -> NoReturn:
    """Refuses: replaced by :func:`data_parallel` (the message says how)."""
    raise NotImplementedError(
        REPLACED.format(name="reduce_gradients", fix="ddp = mesh_cp.data_parallel(model, mesh=mesh)")
    )


def overlap_gradients(*args, **kwargs) -> NoReturn:
    """Refuses: replaced by :func:`data_parallel` (the message says how)."""
    raise NotImplementedError(
        REPLACED.format(name="overlap_gradients", fix="ddp = mesh_cp.data_parallel(model, mesh=mesh)")
    )


@dataclass(frozen=True, eq=False)
class DataContextParallel:
    """Data parallel x context parallel over a process group: CP inner, DP outer.

    Rank ``r`` of ``group`` is CP rank ``r % cp_size`` of data-parallel replica ``r // cp_size``; each
    replica's CP group is tiled as a :class:`CPMesh`. Gradients are summed over the CP group (the loss
    is split across it) and averaged over the replicas, by torch's DDP over ``group`` (:meth:`data_parallel`).
    """

    mesh: CPMesh
    """This replica's CP mesh."""
    group: dist.ProcessGroup
    """All DP x CP ranks."""
    dp_group: dist.ProcessGroup
    """The ranks holding the same CP rank in every replica."""
    dp_size: int
    dp_rank: int

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup,
        *,
        cp_size: int,
        tile: tuple[int, int] | str | None = None,
        head_parallel: int = 1,
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
        mesh: Callable[[dist.ProcessGroup], CPMesh] | None = None,
        **refused,
    ) -> DataContextParallel:
        """Split ``group`` into ``size / cp_size`` replicas of ``cp_size`` consecutive ranks and build each
        replica's mesh: ``CPMesh.create(cp_group, tile=tile, head_parallel=head_parallel, timeout=timeout,
        debug=debug)``, or ``mesh(cp_group)`` when given (for example ``lambda g: mesh_cp.auto_mesh(g,
        topology="h100", shape=shape)``, the layout the cost model chooses)."""
        refuse_keywords(refused, where="DataContextParallel.create")
        if group is None:
            if not dist.is_initialized():  # dist.group.WORLD is None until then
                raise ValueError(
                    "no default process group: call torch.distributed.init_process_group(...) first (or launch with "
                    "torchrun / accelerate launch), then pass dist.group.WORLD"
                )
            raise ValueError("group=None is not accepted: pass the process group to split (e.g. dist.group.WORLD)")
        if (tile is None) == (mesh is None):
            raise ValueError("give either tile= (and head_parallel=) or mesh= (a function of the CP group)")
        world = dist.get_world_size(group)
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"cp_size {cp_size!r} must divide the {world} ranks of the group; choose one of {divisors}, or launch a "
                f"multiple of {cp_size!r} processes"
            )
        ranks = dist.get_process_group_ranks(group)
        dp_rank = dist.get_rank(group) // cp_size
        # Every rank creates its CP group, then its DP group (Note [Subgroups of an eagerly initialised
        # NCCL world] in mesh_cp.runtime.groups); both inherit the timeout of ``group``.
        dp_size = world // cp_size
        cp_group = new_subgroups(group, [ranks[d * cp_size : (d + 1) * cp_size] for d in range(dp_size)])
        dp_group = new_subgroups(group, [ranks[c::cp_size] for c in range(cp_size)])
        if mesh is None:
            built = CPMesh.create(cp_group, tile=tile, head_parallel=head_parallel, timeout=timeout, debug=debug)
        else:
            built = mesh(cp_group)
        return cls(mesh=built, group=group, dp_group=dp_group, dp_size=dp_size, dp_rank=dp_rank)

    def data_parallel(self, model: torch.nn.Module, **ddp_options) -> DistributedDataParallel:
        """``model`` in torch's ``DistributedDataParallel`` over all DP x CP ranks (``self.group``), its gradients
        summed over CP and averaged over DP: a communication hook divides by ``dp_size`` where plain DDP divides by
        the group's size (Note [DDP over DP x CP] in :mod:`mesh_cp.runtime.gradients`), so each rank's loss stays
        its share of its replica's batch loss. ``ddp_options`` go to DDP (``bucket_cap_mb``,
        ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``, ...); ``process_group``,
        ``device_mesh``, ``mixed_precision`` and the delayed all-reduce are refused by name. Returns the DDP module:
        forward and backward through it, ``with ddp.no_sync():`` around the backward of every micro-batch but the
        last."""
        where = "DataContextParallel.data_parallel"
        return wrap_ddp(model, self.group, divide_by=self.dp_size, where=where, **ddp_options)

    def reduce_gradients(self, *args, **kwargs) -> NoReturn:
        """Refuses: replaced by :meth:`data_parallel` (the message says how)."""
        fix = "ddp = layout.data_parallel(model)"
        raise NotImplementedError(REPLACED.format(name="DataContextParallel.reduce_gradients", fix=fix))

    def overlap_gradients(self, *args, **kwargs) -> NoReturn:
        """Refuses: replaced by :meth:`data_parallel` (the message says how)."""
        fix = "ddp = layout.data_parallel(model)"
        raise NotImplementedError(REPLACED.format(name="DataContextParallel.overlap_gradients", fix=fix))

    def __str__(self) -> str:
        return f"DP({self.dp_size}) x {self.mesh}, replica {self.dp_rank}"
