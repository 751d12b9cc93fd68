"""Head-parallel x mesh attention: all-to-alls over heads inside a group of ``u`` ranks, Mesh-Attention across
the ``P / u`` ranks that then hold the same heads.

Note [Head-parallel x mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``P = u x m`` CP ranks; CP rank ``r = g * u + i``. The *head group* of ``r`` is the ``u`` consecutive ranks
``g * u .. g * u + u - 1`` (inside a node when ``u`` divides the ranks per node); its *mesh group* is the ``m``
ranks ``i, u + i, 2u + i, ...``, where it is mesh rank ``g``, tiled ``a x b`` as any mesh. Every rank holds the
same tokens as with a plain mesh of ``P`` ranks (the ``layout`` over ``P``), so switching ``head_parallel`` changes neither
the sharding nor the positions. A head group's tokens are then exactly the chunk of mesh rank ``g`` in the same
layout over ``m`` ranks: contiguous, its ranks hold chunks ``g * u .. g * u + u - 1`` of ``P``, which is chunk
``g`` of ``m``; zig-zag, their first halves are half-chunks ``g * u .. g * u + u - 1`` of ``2P`` (half-chunk ``g``
of ``2m``) and their second halves ``2P - u - g * u .. 2P - 1 - g * u`` (half-chunk ``2m - 1 - g``), in reverse
rank order::

    P = 8, u = 2, m = 4 (tile 2 x 2), zig-zag: 16 half-chunks of S / 16 tokens over P, 8 over m

    CP ranks        0       1       2       3     ...     head groups {0,1} {2,3} {4,5} {6,7}
    half-chunks   0, 15   1, 14   2, 13   3, 12   ...     mesh group 0: ranks 0, 2, 4, 6; 1: ranks 1, 3, 5, 7
    mesh chunk 0 of 4 = halves (0, 1) and (14, 15) of 16 = half-chunks 0 and 7 of 8

The plan of the call holds both parts (:class:`~mesh_cp.core.plan.AttentionPlan` with ``head_parallel = u``);
:class:`~mesh_cp.runtime.attention.MeshAttnFunc` runs the exchange below around the executor of the blocks, in
one autograd function.

Forward: an all-to-all in the head group sends head slice ``j`` of this rank's tokens to rank ``j`` of the group,
so every rank gets the group's tokens (in group-rank order) with ``H / u`` heads; a local reordering (zig-zag:
every rank's first half in rank order, then the second halves in reverse) makes them mesh rank ``g``'s chunk in
local order; Mesh-Attention over the mesh group computes them exactly; the inverse reordering and an all-to-all
send every token's output (and lse) back to the rank that holds it. Backward is the adjoint: each all-to-all's
gradient is the reverse all-to-all, each reordering's the inverse one; the executor's backward runs on the saved
head-layout tensors. K and V travel with ``Hkv / u`` heads when
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

from mesh_cp.core.plan import AttentionPlan
from mesh_cp.runtime.comm import all_to_all
from mesh_cp.runtime.mesh import CPMesh


def _exchange(x: Tensor, mesh: CPMesh, split: int, concat: int) -> Tensor:
    """Cut ``x`` into ``u`` pieces along ``split``, send piece ``j`` to rank ``j`` of the head group and concatenate
    the received pieces along ``concat`` in rank order. Its adjoint is the same exchange with the dims swapped."""
    u = mesh.head_parallel
    pieces = torch.stack(x.chunk(u, dim=split))  # (u, ...): piece j goes to rank j
    received = all_to_all(pieces, mesh.head_group)
    return torch.cat(received.unbind(0), dim=concat)


def _exchange_packed(pieces: list[Tensor], mesh: CPMesh) -> list[Tensor]:
    """One all-to-all in the head group for several tensors of one dtype, each given as its ``u`` pieces ``(u, ...)``
    (piece ``j`` to rank ``j``, any strides): they are copied once into one ``(u, n)`` buffer, and the received
    pieces come back as views of the received buffer (Note [One exchange per direction])."""
    if len({t.dtype for t in pieces}) > 1:  # one buffer holds one dtype
        return [_exchange_packed([t], mesh)[0] for t in pieces]
    u = mesh.head_parallel
    sizes = [t[0].numel() for t in pieces]
    buf = torch.empty((u, sum(sizes)), dtype=pieces[0].dtype, device=pieces[0].device)
    at = 0
    for t, n in zip(pieces, sizes, strict=True):
        buf[:, at : at + n].view(t.shape).copy_(t)
        at += n
    received, out, at = all_to_all(buf, mesh.head_group), [], 0
    for t, n in zip(pieces, sizes, strict=True):
        out.append(received[:, at : at + n].view(t.shape))
        at += n
    return out


def inputs_to_heads(q: Tensor, k: Tensor, v: Tensor, mesh: CPMesh, plan: AttentionPlan) -> tuple[Tensor, ...]:
    """This rank's tokens ``(B, S/P, H, D)`` (K/V ``Hkv`` heads) -> its mesh rank's chunk ``(B, S/m, H/u, D)`` in
    local order (K/V ``max(Hkv/u, 1)`` heads, each repeated ``u / Hkv`` times first when ``u > Hkv``).

    Note [One exchange per direction]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Q, K and V go to the head group's ranks in one all-to-all: each tensor's head slices are copied once into one
    buffer (a view of heads ``j`` for rank ``j``, no stack), and what arrives is read by one gather per tensor that
    puts the group's tokens in the mesh rank's local order (the zig-zag reordering included), so each tensor takes
    two passes and the three share one collective. The backward's ``dq, dk, dv`` travel the same way: one gather
    per tensor into the buffer (the inverse reordering included), one all-to-all, one copy that lays the received
    head slices side by side.
    """
    u = mesh.head_parallel
    if k.shape[2] < u:  # one K/V head per rank: repeat each u / Hkv times (backward sums the copies)
        k, v = (t.repeat_interleave(u // t.shape[2], dim=2) for t in (k, v))
    received = _exchange_packed([t.unflatten(2, (u, -1)).movedim(2, 0) for t in (q, k, v)], mesh)
    rank, row = _token_sources(u, q.shape[1], plan.layout, q.device)
    batch = torch.arange(q.shape[0], device=q.device)[:, None]
    return tuple(t[rank[None, :], batch, row[None, :]] for t in received)  # (B, u L, heads, D)


def outputs_from_heads(
    out: Tensor, lse: Tensor | None, mesh: CPMesh, plan: AttentionPlan
) -> tuple[Tensor, Tensor | None]:
    """The inverse of :func:`inputs_to_heads` for ``out (B, S/m, H/u, D)`` and ``lse (B, H/u, S/m)`` (``None``:
    not returned, not sent)."""
    _, back = _mesh_order(mesh.head_parallel, out.shape[1] // mesh.head_parallel, plan.layout, out.device)
    if back is not None:
        out, lse = out.index_select(1, back), None if lse is None else lse.index_select(2, back)
    return _exchange(out, mesh, 1, 2), None if lse is None else _exchange(lse, mesh, 2, 1)


def grads_to_heads(
    dout: Tensor, dlse: Tensor | None, mesh: CPMesh, plan: AttentionPlan
) -> tuple[Tensor, Tensor | None]:
    """The adjoint of :func:`outputs_from_heads`: the gradients of this rank's ``out`` and ``lse`` in the head
    layout (``dlse`` ``None``: no loss reads the lse, and nothing is sent for it: the plan's ``lse_grad=False``)."""
    dout = _exchange(dout, mesh, 2, 1)
    dlse = None if dlse is None else _exchange(dlse, mesh, 1, 2)
    order, _ = _mesh_order(mesh.head_parallel, dout.shape[1] // mesh.head_parallel, plan.layout, dout.device)
    if order is not None:
        dout, dlse = dout.index_select(1, order), None if dlse is None else dlse.index_select(2, order)
    return dout, dlse


def grads_from_heads(
    dq: Tensor, dk: Tensor, dv: Tensor, kv_heads: int, mesh: CPMesh, plan: AttentionPlan
) -> tuple[Tensor, Tensor, Tensor]:
    """The adjoint of :func:`inputs_to_heads`: ``dq, dk, dv`` of this rank's tokens, the copies of a repeated K/V
    head summed (``kv_heads``: the inputs' K/V heads; Note [One exchange per direction])."""
    u = mesh.head_parallel
    local = dq.shape[1] // u
    _, back = _mesh_order(u, local, plan.layout, dq.device)
    rows = (torch.arange(u * local, device=dq.device) if back is None else back).view(u, local)  # rank j's tokens
    received = _exchange_packed([t[:, rows].movedim(1, 0) for t in (dq, dk, dv)], mesh)  # (u, B, L, heads, D)
    dq, dk, dv = (t.permute(1, 2, 0, 3, 4).flatten(2, 3) for t in received)  # head slices side by side
    if kv_heads < u:
        dk, dv = (t.unflatten(2, (kv_heads, u // kv_heads)).sum(3) for t in (dk, dv))
    return dq, dk, dv


@functools.lru_cache(maxsize=64)
def _token_sources(heads: int, local: int, layout: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """For every token of a mesh rank's chunk in local order: the head-group rank it arrives from and its row there
    (the order of :func:`_mesh_order`)."""
    order, _ = _mesh_order(heads, local, layout, torch.device("cpu"))
    flat = torch.arange(heads * local) if order is None else order
    return (flat // local).to(device), (flat % local).to(device)


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
