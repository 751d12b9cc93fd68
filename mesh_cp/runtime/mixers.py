"""The token <-> channel exchange around the sequence-mixing core of a layer other than attention (Mamba, linear
attention, short convolutions): every rank then scans the whole sequence for a share of the layer's heads.

Note [Head-parallel mixers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A recurrent or convolutional mixer is per token outside its core (the input and output projections, gates, norms
per head) and per head inside it (the short convolution is per channel, the scan per head). So a CP rank keeps its
tokens for the projections, and around the core one all-to-all over the CP group turns "this rank's tokens, every
channel" into "every token of the sequence, this rank's channels" (those of ``heads / P`` heads, and what they read:
the key heads of their group, Mamba 2's B and C of their group). The core runs over the whole sequence in global
order, with documents and padding as the batch has them; a second all-to-all returns every token's core output to
the rank holding it. Each rank sends ``(P - 1) / P`` of its ``S / P`` tokens' core inputs and receives as much of
its core outputs: ``(P - 1) / P * S / P * (c_in + c_out)`` elements, O(S / P) like the attention's Ulysses
exchange, against the ``2 (P - 1) / P * S / P * d_kv * P`` of a ring's K and V. Backward is the adjoint: each
all-to-all's gradient is the reverse all-to-all and each reordering's the inverse one. Nothing is computed twice
except what the heads of one group share when a group spans ranks (Mamba 2's B and C with ``n_groups < P``, the
key heads of Gated DeltaNet with fewer key heads than ranks): each rank holding some of the group's heads convolves
them (a ``2 N`` or ``2 d_k`` channel share), and Mamba 1's ``x_proj``, summed over the ranks
(:func:`sum_over_ranks`), whose norms every rank runs. Exact for ``P`` up to the layer's head count; above it (or heads that
do not split over ``P``) the layer is refused by name.

    P = 2, zig-zag, 4 half-chunks; the core of 4 heads h0..h3

    rank 0: tokens of half-chunks 0, 3, heads h0..h3 --all-to-all--> rank 0: half-chunks 0..3, heads h0 h1
    rank 1: tokens of half-chunks 1, 2, heads h0..h3                 rank 1: half-chunks 0..3, heads h2 h3
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.core.layout import chunk_ranges
from mesh_cp.core.options import Layout
from mesh_cp.runtime.comm import all_to_all
from mesh_cp.runtime.mesh import CPMesh


class _AllToAll(torch.autograd.Function):
    """:func:`~mesh_cp.runtime.comm.all_to_all` of ``(P, ...)`` pieces; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, pieces: Tensor, group) -> Tensor:
        ctx.group = group
        return all_to_all(pieces, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return all_to_all(grad, ctx.group), None


@functools.lru_cache(maxsize=64)
def _token_order(seq_len: int, world: int, layout: Layout, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(order, inverse)``: the global positions of every rank's tokens, rank after rank, each in local order
    (length ``seq_len``), and the permutation that puts them back in global order. Made once per shape and device,
    not at every layer's exchange."""
    positions = [
        torch.arange(start, stop) for rank in range(world) for start, stop in chunk_ranges(seq_len, world, rank, layout)
    ]
    order = torch.cat(positions)
    return order.to(device), torch.argsort(order).to(device)


def tokens_to_channels(x: Tensor, channels: Sequence[Tensor], *, mesh: CPMesh, layout: Layout) -> Tensor:
    """``x (batch, seq_local, C)``, this rank's tokens with every channel, -> ``(batch, seq, c)``: the whole
    sequence in global order, channels ``channels[mesh.rank]`` (indices into ``C``). ``channels[j]`` are the
    channels rank ``j`` mixes, as many for every rank (they may overlap: a channel several ranks read gets the sum
    of their gradients)."""
    world = mesh.size
    if len(channels) != world or len({len(c) for c in channels}) != 1:
        raise AssertionError(
            f"tokens_to_channels needs {world} equal channel sets, got sizes {[len(c) for c in channels]}"
        )
    batch, seq_local, _ = x.shape
    pieces = torch.stack([x.index_select(-1, c) for c in channels])  # (P, B, T, c): piece j goes to rank j
    received = _AllToAll.apply(pieces, mesh.group)  # received[j]: rank j's tokens, this rank's channels
    flat = received.transpose(0, 1).reshape(batch, world * seq_local, -1)  # tokens rank after rank
    _, inverse = _token_order(world * seq_local, world, layout, x.device)
    return flat.index_select(1, inverse)


def channels_to_tokens(y: Tensor, channels: Sequence[Tensor], width: int, *, mesh: CPMesh, layout: Layout) -> Tensor:
    """The inverse exchange: ``y (batch, seq, c)``, this rank's channels ``channels[mesh.rank]`` of the whole
    sequence, -> ``(batch, seq_local, width)``: this rank's tokens with every channel, where ``channels`` (one set
    per rank, disjoint) cover ``range(width)`` (checked where they are made, on the host)."""
    world = mesh.size
    batch, seq, c = y.shape
    order, _ = _token_order(seq, world, layout, y.device)
    pieces = y.index_select(1, order).reshape(batch, world, seq // world, c).transpose(0, 1)  # piece j: rank j's tokens
    received = _AllToAll.apply(pieces, mesh.group)  # received[j]: this rank's tokens, rank j's channels
    joined = torch.cat(received.unbind(0), dim=-1)  # channels in the order of cat(channels)
    placed = torch.cat(list(channels)).to(y.device)
    if placed.numel() != width:
        raise AssertionError(f"the ranks' output channels number {placed.numel()}, not {width}")
    return joined.index_select(-1, torch.argsort(placed))


class _SumOverGroup(torch.autograd.Function):
    """Sum ``x`` over the group, every rank getting the sum; its adjoint is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(x: Tensor, *, mesh: CPMesh) -> Tensor:
    """The sum of every CP rank's ``x`` (same shape on all), on every rank: a projection that reads all of a
    token's channels (Mamba 1's ``x_proj``) from the partial products of each rank's channel share."""
    return _SumOverGroup.apply(x.contiguous(), mesh.group)
