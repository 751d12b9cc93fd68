"""Data parallel x context parallel: the DP x CP groups, and the gradient reduction over them (in buckets), after
backward or overlapped with it."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mesh_cp.core.options import refuse_keywords
from mesh_cp.runtime.grad_overlap import OverlappedReduction, Unused
from mesh_cp.runtime.gradients import BUCKET_BYTES, all_reduce_gradients
from mesh_cp.runtime.groups import new_subgroups
from mesh_cp.runtime.mesh import CPMesh


def reduce_gradients(model: torch.nn.Module, mesh: CPMesh, *, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Sum every parameter gradient over the CP group (each rank holds the gradient of its loss share), one
    all-reduce per bucket of ``bucket_bytes`` (Note [Gradient buckets] in :mod:`mesh_cp.runtime.gradients`);
    returns the number of all-reduces."""
    return all_reduce_gradients(model.parameters(), mesh.group, bucket_bytes=bucket_bytes)


def overlap_gradients(
    model: torch.nn.Module, mesh: CPMesh, *, bucket_bytes: int = BUCKET_BYTES, unused: Unused = "zeros"
) -> OverlappedReduction:
    """:func:`reduce_gradients` overlapped with backward: made once, before training, it hooks every parameter so
    that each bucket's all-reduce over the CP group starts as soon as backward has produced its gradients; call
    ``.finish()`` after each step's backward (Note [Overlapped gradient reduction] in
    :mod:`mesh_cp.runtime.grad_overlap`)."""
    return OverlappedReduction(model, mesh.group, bucket_bytes=bucket_bytes, unused=unused)


@dataclass(frozen=True, eq=False)
class DataContextParallel:
    """Data parallel x context parallel over a process group: CP inner, DP outer.

    Rank ``r`` of ``group`` is CP rank ``r % cp_size`` of data-parallel replica ``r // cp_size``; each
    replica's CP group is tiled as a :class:`CPMesh`. Gradients are summed over the CP group (the loss
    is split across it) and averaged over the replicas, in bucketed all-reduces over ``group``.
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

    def reduce_gradients(self, model: torch.nn.Module, *, bucket_bytes: int = BUCKET_BYTES) -> int:
        """Sum gradients over CP and average them over DP: one all-reduce over all DP x CP ranks per bucket of
        ``bucket_bytes`` (Note [Gradient buckets] in :mod:`mesh_cp.runtime.gradients`); returns their number."""
        return all_reduce_gradients(model.parameters(), self.group, divide_by=self.dp_size, bucket_bytes=bucket_bytes)

    def overlap_gradients(
        self, model: torch.nn.Module, *, bucket_bytes: int = BUCKET_BYTES, unused: Unused = "zeros"
    ) -> OverlappedReduction:
        """:meth:`reduce_gradients` overlapped with backward, the way DDP and Megatron's ``overlap_grad_reduce``
        do it: made once, before training; each bucket's all-reduce over all DP x CP ranks starts from the gradient
        hooks as soon as its gradients are in. Per step: ``loss.backward()`` (micro-batches but the last under
        ``.no_sync()``), ``.finish()``, ``optimizer.step()`` (Note [Overlapped gradient reduction] in
        :mod:`mesh_cp.runtime.grad_overlap`)."""
        return OverlappedReduction(model, self.group, divide_by=self.dp_size, bucket_bytes=bucket_bytes, unused=unused)

    def __str__(self) -> str:
        return f"DP({self.dp_size}) x {self.mesh}, replica {self.dp_rank}"
