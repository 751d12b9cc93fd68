"""Head-parallel x mesh attention: all-to-alls over heads inside a group of ``u`` ranks, Mesh-Attention across
the ``P / u`` ranks that then hold the same heads.

Note [Head-parallel x mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``P = u x m`` CP ranks; CP rank ``r = g * u + i``. The *head group* of ``r`` is the ``u`` consecutive ranks
``g * u .. g * u + u - 1`` (inside a node when ``u`` divides the ranks per node); its *mesh group* is the ``m``
ranks ``i, u + i, 2u + i, ...``, where it is mesh rank ``g``, tiled ``a x b`` as any mesh. Every rank holds the
same tokens as with a plain mesh of ``P`` ranks (the ``layout`` over ``P``), so switching ``heads`` changes neither
the sharding nor the positions. A head group's tokens are then exactly the chunk of mesh rank ``g`` in the same
layout over ``m`` ranks: contiguous, its ranks hold chunks ``g * u .. g * u + u - 1`` of ``P``, which is chunk
``g`` of ``m``; zig-zag, their first halves are half-chunks ``g * u .. g * u + u - 1`` of ``2P`` (half-chunk ``g``
of ``2m``) and their second halves ``2P - u - g * u .. 2P - 1 - g * u`` (half-chunk ``2m - 1 - g``), in reverse
rank order::

    P = 8, u = 2, m = 4 (tile 2 x 2), zig-zag: 16 half-chunks of S / 16 tokens over P, 8 over m

    CP ranks        0       1       2       3     ...     head groups {0,1} {2,3} {4,5} {6,7}
    half-chunks   0, 15   1, 14   2, 13   3, 12   ...     mesh group 0: ranks 0, 2, 4, 6; 1: ranks 1, 3, 5, 7
    mesh chunk 0 of 4 = halves (0, 1) and (14, 15) of 16 = half-chunks 0 and 7 of 8

Forward: an all-to-all in the head group sends head slice ``j`` of this rank's tokens to rank ``j`` of the group,
so every rank gets the group's tokens (in group-rank order) with ``H / u`` heads; a local reordering (zig-zag:
every rank's first half in rank order, then the second halves in reverse) makes them mesh rank ``g``'s chunk in
local order; Mesh-Attention over the mesh group computes them exactly; the inverse reordering and an all-to-all
send every token's output (and lse) back to the rank that holds it. Backward is the adjoint: each all-to-all's
gradient is the reverse all-to-all, each reordering's the inverse one. K and V travel with ``Hkv / u`` heads when
``u`` divides ``Hkv``; when ``u > Hkv`` (``Hkv`` must divide ``u``) each K/V head is first repeated ``u / Hkv``
times, so each rank receives the one K/V head its query heads use: the K/V all-to-all then moves ``u / Hkv`` times
the K/V bytes, and the mesh moves one K/V head per rank (their gradients are summed back). ``u = 1`` is plain
Mesh-Attention, tile ``1 x m`` is USP (Ulysses x ring), ``m = 1`` is Ulysses. This is also how TransformerEngine's
``cp_comm_type="a2a+p2p"`` places its levels (``hierarchical_context_parallel_sizes = [u, m]``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mesh_cp.runtime.comm import all_to_all
from mesh_cp.runtime.mesh import CPMesh


class _AllToAll(torch.autograd.Function):
    """Cut ``x`` into ``u`` pieces along ``split``, send piece ``j`` to rank ``j`` of ``group`` and concatenate the
    received pieces along ``concat`` in rank order; backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, split: int, concat: int) -> Tensor:
        ctx.group, ctx.split, ctx.concat = group, split, concat
        return _exchange(x, group, split, concat)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group, ctx.concat, ctx.split), None, None, None


def _exchange(x: Tensor, group: ProcessGroup, split: int, concat: int) -> Tensor:
    u = torch.distributed.get_world_size(group)
    pieces = torch.stack(x.chunk(u, dim=split))  # (u, ...): piece j goes to rank j
    received = all_to_all(pieces, group)
    return torch.cat(received.unbind(0), dim=concat)


def check_heads(mesh: CPMesh, heads: int, kv_heads: int) -> None:
    """Raise ``ValueError`` unless ``u = mesh.heads`` splits the query heads and splits or replicates the K/V
    heads."""
    u = mesh.heads
    if heads % u:
        raise ValueError(f"{heads} query heads cannot be split over heads={u} head-parallel ranks; choose u | {heads}")
    if kv_heads % u and u % kv_heads:
        raise ValueError(
            f"{kv_heads} K/V heads and heads={u} head-parallel ranks must divide one another (K/V heads are split "
            f"when u | kv_heads and repeated when kv_heads | u); choose another u"
        )


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, mesh: CPMesh, options: dict, attend) -> tuple[Tensor, Tensor]:
    """Head-parallel x mesh attention (Note [Head-parallel x mesh]) of this rank's piece ``q (B, S/P, H, D)``,
    ``k, v (B, S/P, Hkv, D)``: ``(out, lse)`` of the piece, ``lse (B, H, S/P)`` (``None`` unless
    ``options["return_lse"]``). ``attend(q, k, v, mesh=..., **options)`` is the mesh attention of the inner mesh."""
    check_heads(mesh, q.shape[2], k.shape[2])
    u, group = mesh.heads, mesh.head_group
    if k.shape[2] < u:  # one K/V head per rank: repeat each u / Hkv times (autograd sums the copies back)
        k, v = (t.repeat_interleave(u // t.shape[2], dim=2) for t in (k, v))
    q_h, k_h, v_h = (_AllToAll.apply(t, group, 2, 1) for t in (q, k, v))
    order, back = _mesh_order(u, q.shape[1], options["layout"], q.device)
    if order is not None:
        q_h, k_h, v_h = (t.index_select(1, order) for t in (q_h, k_h, v_h))
    result = attend(q_h, k_h, v_h, mesh=mesh.inner, **options)
    out_h, lse_h = result if options["return_lse"] else (result, None)
    if back is not None:
        out_h, lse_h = out_h.index_select(1, back), None if lse_h is None else lse_h.index_select(2, back)
    out = _AllToAll.apply(out_h, group, 1, 2)
    lse = None if lse_h is None else _AllToAll.apply(lse_h, group, 2, 1)
    return out, lse


@functools.lru_cache(maxsize=64)
def _mesh_order(heads: int, local: int, layout: str, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """Indices that put a head group's gathered tokens (``heads`` shards of ``local`` tokens, in group-rank order)
    in the order of the mesh rank's chunk, and the inverse (Note [Head-parallel x mesh]); ``(None, None)`` for the
    contiguous layout, where the two orders agree."""
    if layout != "zigzag":
        return None, None
    half = local // 2
    firsts = [i * local + j for i in range(heads) for j in range(half)]
    seconds = [i * local + half + j for i in reversed(range(heads)) for j in range(half)]
    order = torch.tensor(firsts + seconds, dtype=torch.int64)
    return order.to(device), torch.argsort(order).to(device)
