"""Communication of the schedules: flat collectives (gloo- and NCCL-friendly) and ring steps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# torch >= 2.10 names the flat all-gather all_gather_single; all_gather_into_tensor is its old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    """Stack ``x`` of every member: ``(*shape) -> (n, *shape)``, indexed by group rank."""
    n = dist.get_world_size(group)
    if n == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x, group=group)
    return out.view(n, *x.shape)


def all_gather_parts(xs: tuple[Tensor, ...], group: ProcessGroup) -> tuple[Tensor, ...]:
    """:func:`all_gather` of each of ``xs`` (tensors of one shape and dtype): ``(n, *shape)`` each, gathered into the
    parts of one buffer, so that no part is copied next to the others first; with one member, ``xs`` as they are."""
    if dist.get_world_size(group) == 1:
        return tuple(x.unsqueeze(0) for x in xs)
    return tuple(_gathered_parts(xs, group))


def all_gather_stacked(xs: tuple[Tensor, ...], group: ProcessGroup) -> Tensor:
    """``all_gather(torch.stack(xs))`` ``(n, len(xs), *shape)`` without the stack: a view of the buffer each of ``xs``
    is gathered into a part of (:func:`all_gather_parts`). With one member the stack is the one copy."""
    if dist.get_world_size(group) == 1 or len({x.dtype for x in xs}) > 1:
        return all_gather(torch.stack(xs), group)
    return _gathered_parts(xs, group).transpose(0, 1)


def _gathered_parts(xs: tuple[Tensor, ...], group: ProcessGroup) -> Tensor:
    """``(len(xs), n, *shape)``: part ``i`` the flat all-gather of ``xs[i]``, one collective each."""
    n, shape = dist.get_world_size(group), xs[0].shape
    if any(x.shape != shape or x.dtype != xs[0].dtype for x in xs):
        raise AssertionError(f"gathered parts differ: {[(tuple(x.shape), x.dtype) for x in xs]}")
    out = torch.empty((len(xs), n * shape[0], *shape[1:]), dtype=xs[0].dtype, device=xs[0].device)
    for part, x in zip(out, xs, strict=True):
        _all_gather_flat(part, x.contiguous(), group=group)
    return out.view(len(xs), n, *shape)


def all_to_all(x: Tensor, group: ProcessGroup) -> Tensor:
    """Send ``x[i]`` to group rank ``i``; return ``y`` with ``y[j]`` received from group rank ``j``."""
    n = dist.get_world_size(group)
    if x.shape[0] != n:
        raise AssertionError(f"all_to_all input has {x.shape[0]} pieces for a group of {n}")
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_parts(xs: list[Tensor], group: ProcessGroup) -> Tensor:
    """:func:`all_to_all` of ``n`` tensors of one shape and dtype, sent as they are (no buffer packed first): ``y (n,
    ...)`` with ``y[j]`` received from group rank ``j``."""
    n = dist.get_world_size(group)
    if len(xs) != n:
        raise AssertionError(f"all_to_all has {len(xs)} pieces for a group of {n}")
    if n == 1:
        return xs[0].unsqueeze(0)
    out = torch.empty((n, *xs[0].shape), dtype=xs[0].dtype, device=xs[0].device)
    dist.all_to_all(list(out), [x.contiguous() for x in xs], group=group)
    return out


def ring_step(sends: list[Tensor], recvs: list[Tensor], group: ProcessGroup, *, tag: int) -> list:
    """Post one ring step: send ``sends`` to the next group rank, receive ``recvs`` from the previous.

    Returns the works to wait on (``recvs`` hold the data once every work has been waited on).
    Tensors ``i`` use tag ``tag + i``; every member posts the same step, so sends and receives pair
    up. ``batch_isend_irecv`` lets NCCL post both sides together. gloo cannot send or receive
    device memory (its all-gather and all-to-all can), so on a gloo group device tensors travel
    through host copies: the receive's work copies its host buffer into ``recvs[i]`` when waited on.
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    # P2POp takes the peer's global rank (``group_peer=`` needs torch >= 2.6).
    nxt, prev = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    staged = dist.get_backend(group) == "gloo" and any(t.device.type != "cpu" for t in (*sends, *recvs))
    if not staged:
        ops = [dist.P2POp(dist.isend, t, peer=nxt, group=group, tag=tag + i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, peer=prev, group=group, tag=tag + i) for i, t in enumerate(recvs)]
        return dist.batch_isend_irecv(ops)
    host_sends = [t.cpu() for t in sends]
    host_recvs = [torch.empty(t.shape, dtype=t.dtype) for t in recvs]
    ops = [dist.P2POp(dist.isend, t, peer=nxt, group=group, tag=tag + i) for i, t in enumerate(host_sends)]
    ops += [dist.P2POp(dist.irecv, t, peer=prev, group=group, tag=tag + i) for i, t in enumerate(host_recvs)]
    works = dist.batch_isend_irecv(ops)
    n_send = len(sends)
    return [_HostStaged(w, host_sends[i], None) for i, w in enumerate(works[:n_send])] + [
        _HostStaged(w, host_recvs[i], recvs[i]) for i, w in enumerate(works[n_send:])
    ]


class _HostStaged:
    """The work of a gloo send or receive of a host copy; a receive's ``wait`` fills its device tensor."""

    def __init__(self, work: dist.Work, host: Tensor, target: Tensor | None) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self) -> bool:
        self.work.wait()
        if self.target is not None:
            self.target.copy_(self.host)
        return True
