"""Gradient reduction over a process group in buckets: one all-reduce per bucket, not per parameter.

Note [Gradient buckets]
~~~~~~~~~~~~~~~~~~~~~~~
Each rank of a CP group holds the gradient of its share of the loss, so every parameter gradient is summed over
the CP group (and averaged over the DP replicas of a DP x CP layout). One all-reduce per parameter is hundreds of
small collectives for an LLM (each paying the collective's latency); like torch DDP, the gradients are instead
packed, in parameter order, into buckets of at most ``bucket_bytes`` (25 MiB by default, DDP's
``bucket_cap_mb``) of one dtype and device, and each bucket is one all-reduce of a flat buffer whose result is
copied back. A gradient larger than a bucket is a bucket of its own (reduced in place, no copy). The sums are the
per-parameter sums: an all-reduce adds elementwise, whatever the packing.

That is the blocking form (:func:`all_reduce_gradients`, after backward). The overlapped form
(:class:`~mesh_cp.runtime.grad_overlap.OverlappedReduction`, Note [Overlapped gradient reduction]) cuts the same
buckets from the parameters in *reverse* order, the order backward produces their gradients, keeps one flat buffer
per bucket, and launches each bucket's all-reduce from the gradient hooks while backward still runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.core.options import positive_int

BUCKET_BYTES = 25 * 2**20
"""Default bucket size, as torch DDP's ``bucket_cap_mb=25``."""


def gradient_buckets(grads: Sequence[Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[Tensor]]:
    """``grads`` in order, cut into buckets of one dtype and device of at most ``bucket_bytes`` each (a larger
    gradient alone); see Note [Gradient buckets]."""
    positive_int("bucket_bytes", bucket_bytes)
    buckets: list[list[Tensor]] = []
    size = 0
    for g in grads:
        if g.is_sparse:
            raise NotImplementedError("sparse gradients are not reduced in buckets; use dense embedding gradients")
        nbytes = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        fits = (
            last is not None
            and (last[0].dtype, last[0].device) == (g.dtype, g.device)
            and size + nbytes <= bucket_bytes
        )
        if fits:
            last.append(g)
            size += nbytes
        else:
            buckets.append([g])
            size = nbytes
    return buckets


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    *,
    divide_by: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Sum the gradients of ``parameters`` over ``group`` (then divide them by ``divide_by``), one all-reduce per
    bucket (Note [Gradient buckets]); returns the number of all-reduces. Parameters without a gradient are
    skipped, on every rank alike (a parameter that has a gradient on some ranks only is a caller's error that the
    bucket shapes would not catch)."""
    buckets = gradient_buckets([p.grad for p in parameters if p.grad is not None], bucket_bytes)
    for bucket in buckets:
        flat = bucket[0] if len(bucket) == 1 else torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        if len(bucket) > 1:
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(part.view_as(g))
    return len(buckets)
