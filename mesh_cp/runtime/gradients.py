"""Gradient reduction of a replicated model over CP, or over DP x CP: torch's ``DistributedDataParallel`` with a
communication hook that gives mesh_cp's scaling.

Note [DDP over DP x CP]
~~~~~~~~~~~~~~~~~~~~~~~
Every rank of a CP group holds a shard of each sequence of its replica's batch, and its loss is its *share* of
the batch's loss (:func:`~mesh_cp.runtime.batch.causal_lm_loss`: its tokens' losses over the batch's token count),
so the replica's loss and its gradient are the *sums* over the CP ranks. Each DP replica trains on its own batch,
and the step's loss is the *mean* over the replicas. With ``g[d, c]`` the gradient of DP replica ``d``, CP rank
``c``, the gradient every rank needs is::

    g = (1 / dp) * sum_d sum_c g[d, c]          (sum over CP, mean over DP)

one all-reduce over all the ``dp x cp`` ranks (``DataContextParallel.group``), divided by ``dp``. Plain
``DistributedDataParallel(model, process_group=group)`` divides the sum by the group's size, ``dp x cp``: it gives
``g / cp``, and the loss would have to be multiplied by ``cp`` to get ``g``. Instead :func:`wrap_ddp` (behind
``DataContextParallel.data_parallel`` and ``mesh_cp.data_parallel``) registers a DDP communication hook
(``ddp.register_comm_hook``, DDP's extension point; the hook is ``default_hooks.allreduce_hook`` with another
divisor) that divides each bucket by ``dp`` before its all-reduce (first, as ``allreduce_hook`` does, so
low-precision sums stay in range). DDP divides nothing itself when a hook is registered. So the loss code of one
process, or of mesh_cp's batches, does not change. A CP group alone is the case ``dp = 1``: the hook sums over
``mesh.group``.

The returned module must stay referenced until backward has run: DDP's gradient hooks live and die with it (a
``data_parallel(model, ...)(batch)`` whose wrapper is dropped after forward reduces nothing). The rest is DDP's:
the buckets (``bucket_cap_mb``; every parameter of a dtype in one bucket for the first backward, rebuilt in the
order of the gradients after it) and their all-reduces launched from the gradient hooks while backward runs,
``no_sync()`` for gradient accumulation (every micro-batch's backward but the last), ``static_graph``,
``gradient_as_bucket_view``. Refused, by name: ``process_group`` / ``device_mesh`` (the layout gives the group);
``mixed_precision`` (it registers DDP's own communication hook, which averages over the group) and
``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce`` (DDP all-reduces those parameters outside any
hook, divided by the group's size). DDP takes one communication hook, so a hook of the caller's own cannot be
added (``register_comm_hook`` raises).

Unused parameters. Without ``find_unused_parameters=True`` DDP expects every parameter that requires a gradient to
get one in every backward: one that gets none keeps its bucket from being reduced (the other gradients in that
bucket stay unreduced) and the next forward raises. With it, each forward finds the parameters the output does
not depend on and marks them ready: a parameter some ranks used gets the sum of their gradients on every rank
(the others add zeros), divided as above; one that no rank used keeps ``.grad`` ``None`` on every rank, as in one
process (DDP all-reduces a map of the parameters each rank used, and writes no gradient for one nobody used), so
an optimizer skips it.

With NCCL, DDP's all-reduces on the DP x CP communicator start from the gradient hooks while the attention's
backward runs its own collectives on the CP subgroups; every rank issues them in one order as long as every rank
runs the same graph. A rank that leaves a parameter unused marks it ready when its backward starts, so it may
issue that parameter's bucket at another point of backward than a rank that uses it (DDP's own caveat for
``find_unused_parameters``).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] themselves, not with their names.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

REFUSED = {
    "process_group": "the layout gives the group (DP x CP: DataContextParallel.group; CP alone: mesh.group)",
    "device_mesh": "the layout gives the group (DP x CP: DataContextParallel.group; CP alone: mesh.group)",
    "mixed_precision": "it registers DDP's own communication hook, which averages over the group (use "
    "torch.autocast, or keep the parameters in the training dtype)",
    "delay_all_reduce_named_params": "DDP all-reduces those parameters outside the communication hook, divided by "
    "the group's size (leave them in the buckets)",
    "param_to_hook_all_reduce": "DDP all-reduces the delayed parameters outside the communication hook, divided by "
    "the group's size (leave them in the buckets)",
}
"""The DDP keyword arguments :func:`wrap_ddp` refuses, with the reason (Note [DDP over DP x CP])."""


@dataclass(frozen=True)
class SumThenDivide:
    """The state of :func:`sum_then_divide`: the group to sum over and the divisor (the DP size)."""

    group: dist.ProcessGroup
    """All ranks the gradients are summed over."""
    divide_by: int
    """Divides each bucket before the all-reduce: the DP size (1 for a CP group alone)."""


def sum_then_divide(state: SumThenDivide, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook of Note [DDP over DP x CP]: divide the bucket's flat gradients by
    ``state.divide_by``, all-reduce (sum) them over ``state.group``; returns the future of the reduced buffer."""
    buffer = bucket.buffer()
    if state.divide_by != 1:
        buffer.div_(state.divide_by)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(
    model: torch.nn.Module, group: dist.ProcessGroup, *, divide_by: int, where: str, **ddp_options
) -> DistributedDataParallel:
    """``DistributedDataParallel(model, process_group=group, **ddp_options)`` whose gradients are summed over
    ``group`` and divided by ``divide_by`` (Note [DDP over DP x CP]); ``where`` names the public caller in errors.
    Returns the DDP module: run forward and backward through it."""
    for name in ddp_options:
        if name in REFUSED:
            raise ValueError(f"{where}() does not take {name}=: {REFUSED[name]}")
    if isinstance(divide_by, bool) or not isinstance(divide_by, int) or divide_by < 1:
        raise ValueError(f"divide_by must be a positive int, got {divide_by!r}")
    if isinstance(model, DistributedDataParallel):
        raise ValueError(f"{where}() got a model already wrapped in DistributedDataParallel; pass ddp.module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameter that requires a gradient: nothing to reduce")
    ddp = DistributedDataParallel(model, process_group=group, **ddp_options)
    ddp.register_comm_hook(SumThenDivide(group=group, divide_by=divide_by), sum_then_divide)
    return ddp


REPLACED = (
    "{name} was replaced by torch's DistributedDataParallel: wrap the model once, before training, with {fix} "
    "(DDP options such as bucket_cap_mb, find_unused_parameters, static_graph go to DDP), run forward and backward "
    "through the wrapper, and use its no_sync() for gradient accumulation; the gradients are summed over CP and "
    "averaged over DP as before (Note [DDP over DP x CP] in mesh_cp.runtime.gradients)"
)
"""The message of the refusing aliases of the former gradient reductions."""
