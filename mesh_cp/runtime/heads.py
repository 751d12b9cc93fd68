"""Head-parallel x mesh attention: all-to-alls over heads inside a group of ``u`` ranks, Mesh-Attention across
the ``P / u`` ranks that then hold the same heads.

Note [Head-parallel x mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``P = u x m`` CP ranks; CP rank ``r = g * u + i``. The *head group* of ``r`` is the ``u`` consecutive ranks
``g * u .. g * u + u - 1`` (inside a node when ``u`` divides the ranks per node); its *mesh group* is the ``m``
ranks ``i, u + i, 2u + i, ...``, where it is mesh rank ``g``, tiled ``a x b`` as any mesh. The sequence is laid
out over the ``m`` mesh ranks (zig-zag for causal) and each mesh chunk is cut into ``u`` consecutive pieces of
``S / P`` tokens: rank ``g * u + i`` holds piece ``i`` of chunk ``g`` (:func:`mesh_cp.core.layout.rank_ranges`)::

    P = 8, u = 2, m = 4 (tile 2 x 2), zig-zag over 4 mesh chunks of S / 4 tokens

    mesh chunk g       0            1            2            3
    CP ranks        0     1      2     3      4     5      6     7       head groups {0,1} {2,3} {4,5} {6,7}
    mesh group 0    0            2            4            6               mesh group 1: ranks 1, 3, 5, 7

Forward: an all-to-all in the head group sends head slice ``j`` of this rank's piece to rank ``j`` of the
group, so every rank gets its chunk (the ``u`` pieces, in order) with ``H / u`` heads; Mesh-Attention over the
mesh group computes them exactly; an all-to-all sends every piece's output (and lse) back to the rank that holds
the piece. Backward is the adjoint: each all-to-all's gradient is the reverse all-to-all. K and V travel with
``Hkv / u`` heads when ``u`` divides ``Hkv``; when ``u > Hkv`` (``Hkv`` must divide ``u``) each K/V head is
first repeated ``u / Hkv`` times, so each rank receives the one K/V head its query heads use: the K/V
all-to-all then moves ``u / Hkv`` times the K/V bytes, and the mesh moves one K/V head per rank (their
gradients are summed back). ``u = 1`` is plain Mesh-Attention, tile ``1 x m`` is USP (Ulysses x ring), ``m = 1``
is Ulysses.
"""

from __future__ import annotations

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
    result = attend(q_h, k_h, v_h, mesh=mesh.inner, **options)
    out_h, lse_h = result if options["return_lse"] else (result, None)
    out = _AllToAll.apply(out_h, group, 1, 2)
    lse = None if lse_h is None else _AllToAll.apply(lse_h, group, 2, 1)
    return out, lse
