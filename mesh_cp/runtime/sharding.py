"""Shard a global sequence over a CP mesh in the contiguous or zig-zag layout, and back."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.layout import check_layout, layout_permutation, local_positions
from mesh_cp.core.options import Layout
from mesh_cp.runtime.comm import all_gather
from mesh_cp.runtime.mesh import CPMesh


def shard_sequence(x: Tensor, *, mesh: CPMesh, dim: int, layout: Layout) -> Tensor:
    """This rank's shard of the full tensor ``x`` along its sequence dimension ``dim``.

    ``layout="contiguous"``: chunk ``rank`` of ``P``; ``layout="zigzag"``: half-chunks ``rank`` and
    ``2P-1-rank`` of ``2P``, concatenated (the same with head-parallel ranks). Local, differentiable, and the same on every rank for the
    same ``x``. The length along ``dim`` must be a multiple of ``P`` (contiguous) or ``2P`` (zig-zag).
    """
    check_layout(layout)
    dim = dim % x.dim()
    ranges = mesh.local_ranges(x.shape[dim], layout)
    pieces = [x.narrow(dim, start, stop - start) for start, stop in ranges]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(x_local: Tensor, *, mesh: CPMesh, dim: int, layout: Layout) -> Tensor:
    """The full tensor from every rank's shard along ``dim``; collective over ``mesh.group``.

    Every rank gets the whole tensor in global sequence order. Not differentiable: it refuses an
    input that requires grad while grad mode is on (call it on ``x.detach()``).
    """
    check_layout(layout)
    if x_local.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "unshard_sequence is not differentiable; pass x_local.detach() or call it under torch.no_grad()"
        )
    dim = dim % x_local.dim()
    moved = x_local.movedim(dim, 0).contiguous()
    local_len = moved.shape[0]
    gathered = all_gather(moved, mesh.group).reshape(mesh.size * local_len, *moved.shape[1:])
    order = torch.tensor(layout_permutation(mesh.size * local_len, mesh.size, layout), device=moved.device)
    full = torch.empty_like(gathered)
    full[order] = gathered
    return full.movedim(0, dim)


def gather_sequence(x_local: Tensor, *, mesh: CPMesh, dim: int, layout: Layout, grad_scale: float = 1.0) -> Tensor:
    """:func:`unshard_sequence`, differentiable: the full tensor in global order on every rank of ``mesh.group``.

    Its backward gives each rank its own shard of the gradient (times ``grad_scale``), with no communication: every
    rank of the group computes the same function of the full tensor (the loss of whole sequences, say), so each
    rank's part of the gradient is the part of its own tokens, and the parameter gradients summed over the group
    are the gradient of that function. A framework that averages the gradients over the group instead (DDP,
    DeepSpeed, FSDP over DP x CP) needs ``grad_scale=mesh.size``."""
    return _GatherSequence.apply(x_local, mesh, dim, layout, grad_scale)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: Tensor, mesh: CPMesh, dim: int, layout: Layout, grad_scale: float) -> Tensor:
        ctx.mesh, ctx.dim, ctx.layout, ctx.grad_scale = mesh, dim, layout, grad_scale
        return unshard_sequence(x_local.detach(), mesh=mesh, dim=dim, layout=layout)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        mine = shard_sequence(grad, mesh=ctx.mesh, dim=ctx.dim, layout=ctx.layout)
        return (mine * ctx.grad_scale if ctx.grad_scale != 1 else mine), None, None, None, None


def position_ids(seq_len: int, *, mesh: CPMesh, layout: Layout, device: torch.device | str | None = None) -> Tensor:
    """Global positions (``int64``, ``(seq_local,)``) of the tokens this rank holds for a sequence of
    ``seq_len`` tokens; feed them to RoPE / position embeddings of the sharded tokens."""
    check_layout(layout)
    return torch.tensor(local_positions(seq_len, mesh.size, mesh.rank, layout), dtype=torch.int64, device=device)
