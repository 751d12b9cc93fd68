"""Gradient reduction over a process group in buckets: one all-reduce per bucket, not per parameter.

Note [Gradient buckets]
~~~~~~~~~~~~~~~~~~~~~~~
Each rank of a CP group holds the gradient of its share of the loss, so every parameter gradient is summed over
the CP group (and averaged over the DP replicas of a DP x CP layout). One all-reduce per parameter is hundreds of
small collectives for an LLM (each paying the collective's latency); like torch DDP, the gradients are instead
packed, in parameter order, into buckets of at most ``bucket_bytes`` (25 MiB by default, DDP's
``bucket_cap_mb``) of one dtype and device, and each bucket is one all-reduce of a flat buffer whose result is
copied back. A gradient larger than a bucket is a bucket of its own. The sums are the per-parameter sums: an
all-reduce adds elementwise, whatever the packing. Each bucket also carries one flag per parameter, so that a
parameter no rank used keeps no gradient (Note [Used flags]).

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
    bucket (Note [Gradient buckets]); returns the number of all-reduces. Every parameter that requires a gradient
    is in the buckets on every rank alike: a rank without its gradient adds zeros, and one that no rank has stays
    ``None`` (Note [Used flags])."""
    params = [p for p in parameters if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    buckets = gradient_buckets(grads, bucket_bytes)
    missing: list[tuple[torch.nn.Parameter, Tensor, Tensor]] = []
    start = 0
    for bucket in buckets:
        members, start = params[start : start + len(bucket)], start + len(bucket)
        flags = used_flags(members, bucket[0])
        flat = torch.cat([g.reshape(-1) for g in bucket] + [flags])
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        parts = flat.split([g.numel() for g in bucket] + [len(bucket)])
        for k, (p, g, part) in enumerate(zip(members, bucket, parts, strict=False)):
            if p.grad is None:
                missing.append((p, part.view_as(p), parts[-1][k]))
            else:
                g.copy_(part.view_as(g))
    if missing:
        for (p, part, _), used in zip(missing, read_flags([flag for *_, flag in missing]), strict=True):
            if used:
                p.grad = part
    return len(buckets)


# Note [Used flags]
# ~~~~~~~~~~~~~~~~~
# A parameter that no rank used in a step has no gradient in one process (``None`` after ``zero_grad()``), and an
# optimizer skips it: no momentum, no weight decay. So the buckets of every rank hold every parameter that requires
# a gradient (zeros where a rank has none), and each bucket ends with one flag per parameter, 1 where this rank has
# its gradient: the same all-reduce sums them, and a parameter whose flags sum to 0 keeps ``None``; one that some
# ranks used gets the sum of theirs. A sum of 0 / 1 flags is 0 only if every flag is, in any dtype. Only a rank that
# lacks some gradient reads its flags back (one read); where every rank has every gradient nothing is read.


def used_flags(members: Sequence[torch.nn.Parameter], like: Tensor) -> Tensor:
    """A bucket's flags (Note [Used flags]): 1 for each of ``members`` that has a gradient on this rank, else 0."""
    flags = torch.ones(len(members), dtype=like.dtype, device=like.device)
    for k, p in enumerate(members):
        if p.grad is None:
            flags[k] = 0
    return flags


def read_flags(flags: Sequence[Tensor]) -> list[bool]:
    """The summed flags of the parameters this rank had no gradient for: whether any rank had one (one read)."""
    return torch.stack(list(flags)).ne(0).tolist() if flags else []
