"""The head-parallel x mesh hybrid on Megatron's own zig-zag layout, and Megatron's ``cp_comm_type`` mapped to it.

Note [Hybrid on Megatron's layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron fixes where tokens are: ``get_batch_on_this_cp_rank`` gives CP rank ``r`` of ``P`` the half-chunks ``r``
and ``2P-1-r`` of ``2P``, and its RoPE (``get_pos_emb_on_this_cp_rank``) rotates them there. mesh_cp's hybrid
layout (Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`) differs, but it need not be asked for: with
``P = u x m``, the ``u`` CP ranks ``g*u .. g*u+u-1`` of head group ``g`` hold, in Megatron's layout, the half-chunks
``g*u .. g*u+u-1`` (their first halves: half-chunk ``g`` of ``2m``) and ``2P-u-g*u .. 2P-1-g*u`` (their second
halves, in reverse rank order: half-chunk ``2m-1-g`` of ``2m``), which is exactly the zig-zag chunk of mesh rank
``g`` of ``m``. So after the head all-to-all (each rank's ``S/P`` tokens, in head-group rank order) a local
reordering gives mesh rank ``g`` its chunk in the inner mesh's zig-zag order::

    gathered  [r0: first, second | r1: first, second | ... | r(u-1): first, second]
    ordered   [r0 first, r1 first, ..., r(u-1) first, r(u-1) second, ..., r0 second]

and the inverse reordering puts the output back before the all-to-all returns it. No extra communication, and
Megatron's sharding, RoPE and causal mask stay as they are. This is what TransformerEngine's ``a2a+p2p`` does
with ``hierarchical_context_parallel_sizes = [u, m]`` (level 0: ``u`` consecutive CP ranks, all-to-all; level
1: the ``m`` ranks ``i, u + i, ...``, ring) and what Megatron's ``"a2a"`` (Ulysses) is with ``u = P``: both are
taken as the hybrid with that ``u``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

import mesh_cp
from mesh_cp.runtime.heads import hybrid_attention
from mesh_cp.runtime.mesh import CPMesh

CP_COMM_TYPES: dict[object, str] = {
    None: "the mesh as the spec builds it (heads= of the spec / MeshLayout)",
    "p2p": "Megatron-LM's default: the mesh as the spec builds it (heads= of the spec / MeshLayout)",
    "a2a": "Ulysses: the hybrid with heads = CP size (tile 1x1)",
    "a2a+p2p": "the hybrid with heads = hierarchical_context_parallel_sizes[0] and the tile over the rest",
}
"""``cp_comm_type`` values :class:`MeshCoreAttention` takes, and what each runs (Note [Hybrid on Megatron's layout])."""


def comm_type_heads(cp_comm_type: str | None, config) -> tuple[int | None, str]:
    """The head-parallel degree Megatron's ``cp_comm_type`` (with ``hierarchical_context_parallel_sizes``) asks
    for (``None`` when it leaves it to the spec), and the setting named. Refuses, by name and with the fix, what
    has no exact mapping."""
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    cp = config.context_parallel_size
    named = f"cp_comm_type {cp_comm_type!r}" + (f" with hierarchical_context_parallel_sizes {sizes}" if sizes else "")
    if cp_comm_type not in CP_COMM_TYPES:
        raise NotImplementedError(
            f"cp_comm_type {cp_comm_type!r} selects TransformerEngine's CP communication, which mesh_cp does not "
            f"run; it takes {sorted(map(str, CP_COMM_TYPES))}: leave cp_comm_type at 'p2p' and choose the mesh "
            f"tile (and heads=) of the spec"
        )
    if cp_comm_type == "a2a+p2p":
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != cp:
            raise NotImplementedError(
                f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a, p2p] with a2a * p2p = CP "
                f"size {cp}, got {sizes}; mesh_cp runs it as heads = a2a over a tile of the p2p ranks"
            )
        return sizes[0], named
    if sizes:
        raise NotImplementedError(
            f"hierarchical_context_parallel_sizes {sizes} is read by cp_comm_type 'a2a+p2p' only (got "
            f"{cp_comm_type!r}); leave it unset, or set cp_comm_type='a2a+p2p' for the head-parallel x mesh hybrid"
        )
    return (cp if cp_comm_type == "a2a" and cp > 1 else None), named


def megatron_hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: CPMesh, **options) -> Tensor:
    """:func:`mesh_cp.mesh_attn_func` over a head-parallel mesh (``mesh.heads > 1``) of ``q (B, S/P, H, D)``,
    ``k, v (B, S/P, Hkv, D)`` in Megatron's zig-zag layout (Note [Hybrid on Megatron's layout]); ``options``:
    ``causal``, ``softmax_scale``, ``mask`` (over global positions). Exact, forward and backward."""
    if q.shape[1] % 2:
        raise ValueError(f"a zig-zag shard has two equal halves; got {q.shape[1]} tokens")
    mesh.check_same_call({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "dtype": str(q.dtype)})
    options = {**options, "layout": "zigzag", "return_lse": False}
    attend = functools.partial(_attend_in_mesh_order, heads=mesh.heads)
    out, _ = hybrid_attention(q, k, v, mesh, options, attend)
    return out


def _attend_in_mesh_order(q: Tensor, k: Tensor, v: Tensor, *, heads: int, mesh: CPMesh, **options) -> Tensor:
    """Mesh attention of the head group's gathered tokens: reordered into the inner mesh's zig-zag chunk, attended,
    and the output put back in the gathered order."""
    order, back = _mesh_order(heads, q.shape[1] // heads, q.device)
    q, k, v = (t.index_select(1, order) for t in (q, k, v))
    out = mesh_cp.mesh_attn_func(q, k, v, mesh=mesh, **options)
    return out.index_select(1, back)


@functools.lru_cache(maxsize=64)
def _mesh_order(heads: int, local: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Indices of the gathered tokens (``heads`` pieces of ``local`` tokens, each two zig-zag halves) in the
    order of the mesh rank's zig-zag chunk (every piece's first half, then the second halves in reverse), and
    the inverse permutation."""
    half = local // 2
    firsts = [i * local + j for i in range(heads) for j in range(half)]
    seconds = [i * local + half + j for i in reversed(range(heads)) for j in range(half)]
    order = torch.tensor(firsts + seconds, dtype=torch.int64)
    return order.to(device), torch.argsort(order).to(device)
