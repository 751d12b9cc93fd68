"""Tree-Attention decoding: replicated queries against a K/V cache sharded along the sequence (Note [Tree decoding]
in :mod:`mesh_cp.core.decode`).

::

    out = mesh_cp.decode_attn_func(q, k_shard, v_shard, mesh=mesh, q_positions=qp, k_positions=kp)

``q (B, k, Hq, D)`` is the same on every rank of the mesh; ``k_shard, v_shard (B, L, Hkv, D)`` are this rank's
part of the cache (any ``L``, 0 included, different on every rank); ``q_positions (B, k)`` and ``k_positions
(B, L)`` are the sequence positions of the queries and of the cache entries, ``-1`` for an entry that holds
nothing (padding, a slot not filled yet). A query attends the entries at positions ``0 <= p <= its own``: causal
over the cache and among the ``k`` new tokens, each row with its own length. Every rank returns the whole ``(B, k,
Hq, D)`` result in ``q``'s dtype (combined in fp32).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from mesh_cp.core.decode import DecodeReduction
from mesh_cp.core.numerics import acc_dtype
from mesh_cp.kernels import KernelName, resolve_kernel, takes
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.runtime.mesh import CPMesh


def reduction_groups(mesh: CPMesh | ProcessGroup) -> tuple[tuple[ProcessGroup, ...], DecodeReduction]:
    """The all-reduce levels of tree decoding over ``mesh``: its head group (hybrid), Q-group, then KV-group (Note
    [Tree decoding]); over a plain process group, one level. Levels of one member are left out."""
    if isinstance(mesh, CPMesh):
        groups = (mesh.head_group, mesh.q_group, mesh.kv_group)
    elif isinstance(mesh, ProcessGroup):
        groups = (mesh,)
    else:
        raise ValueError(
            f"mesh must be a mesh_cp.CPMesh or a torch.distributed ProcessGroup, got {type(mesh).__name__}"
        )
    levels = tuple(g for g in groups if g is not None and g.size() > 1)
    return levels, DecodeReduction(tuple(g.size() for g in levels))


def decode_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: CPMesh | ProcessGroup,
    q_positions: Tensor,
    k_positions: Tensor,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    kernel: KernelName | Literal["auto"] | BlockKernel = "reference",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of the replicated queries ``q`` over the cache whose shards the ranks of ``mesh`` hold (module
    docstring); ``return_lse`` also gives the ``(B, Hq, k)`` fp32 log-sum-exp over the whole cache. Inference only
    (run it under ``torch.no_grad()``). ``kernel`` computes the local part with a mask (``"reference"``, or a kernel
    that takes masks)."""
    _check_inputs(q, k, v, q_positions, k_positions)
    block = resolve_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if not takes(block, "mask"):
        raise ValueError(f"kernel {block.name!r} takes no mask; decoding needs one: use kernel='reference'")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = local_attention(block, q, k, v, q_positions, k_positions, scale)
    out, lse = combine(out, lse.to(acc_dtype(q.dtype)), mesh)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def local_attention(
    block: BlockKernel, q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """The attention of queries ``q (B, k, Hq, D)`` over one shard ``k, v (B, L, Hkv, D)`` with the positions'
    visibility (module docstring): ``(out (B, k, Hq, D), lse (B, Hq, k))``, before any combining (the part each rank
    computes; a ring decoder can merge these itself). ``block`` must take masks. The ``G = Hq / Hkv`` query heads that
    share a K/V head become ``G`` query rows of that head (query head ``h`` reads K/V head ``h // G``), so the
    kernel reads the shard as it is instead of a copy repeated ``G`` times."""
    batch, new, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    rows = q.reshape(batch, new, kv_heads, group, dim).transpose(2, 3).reshape(batch, new * group, kv_heads, dim)
    # Entry j of row b is seen by query i iff 0 <= p_j <= p_i: (B, 1, k * G, L), broadcast over the K/V heads.
    seen = (k_positions[:, None, :] >= 0) & (k_positions[:, None, :] <= q_positions[:, :, None])
    seen = seen.repeat_interleave(group, dim=1)[:, None]
    out, lse = block.forward(rows, k, v, causal=False, scale=scale, mask=seen)
    out = out.reshape(batch, new, group, kv_heads, dim).transpose(2, 3).reshape(batch, new, heads, dim)
    lse = lse.reshape(batch, kv_heads, new, group).transpose(2, 3).reshape(batch, heads, new)
    return out, lse


def combine(out: Tensor, lse: Tensor, mesh: CPMesh | ProcessGroup) -> tuple[Tensor, Tensor]:
    """The ranks' partial results ``out (B, k, H, D)`` and ``lse (B, H, k)`` (``-inf``: nothing seen) combined over
    ``mesh`` into the result and lse over every rank's keys, on every rank (Note [Tree decoding]), in ``lse``'s dtype
    (fp32; fp64 for fp64 inputs)."""
    levels, _ = reduction_groups(mesh)
    top = lse.clone()
    for group in levels:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # A row no rank saw (top = -inf) gets weight 0 everywhere, output 0 and lse -inf.
    finite = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(lse - finite)  # (B, H, k); 0 where this rank saw nothing
    packed = torch.cat([out.to(lse.dtype) * weight.transpose(1, 2)[..., None], weight.transpose(1, 2)[..., None]], -1)
    for group in levels:
        dist.all_reduce(packed, group=group)
    total = packed[..., -1:]
    result = torch.where(total > 0, packed[..., :-1] / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)
    return result, finite + torch.log(total[..., 0].transpose(1, 2))


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "decode_attn_func is for inference: call it under torch.no_grad() (its all-reduces have no gradient)"
        )
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"q must be (B, k, Hq, D) and k, v (B, L, Hkv, D) of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    batch, new, heads, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim or heads % k.shape[2]:
        raise ValueError(
            f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}: same batch and head dim, and Hq a multiple of Hkv"
        )
    if tuple(q_positions.shape) != (batch, new) or tuple(k_positions.shape) != (batch, k.shape[1]):
        raise ValueError(
            f"q_positions {tuple(q_positions.shape)} must be (B, k) = {(batch, new)} and k_positions "
            f"{tuple(k_positions.shape)} (B, L) = {(batch, k.shape[1])}"
        )
    for name, t in (("q_positions", q_positions), ("k_positions", k_positions)):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.device != q.device:
            raise ValueError(f"{name} must be an integer tensor on {q.device}, got {t.dtype} on {t.device}")
