"""Tree-Attention decoding: replicated queries against a K/V cache sharded along the sequence (Note [Tree decoding]
in :mod:`mesh_cp.core.decode`).

::

    out = mesh_cp.decode_attn_func(q, k_shard, v_shard, mesh=mesh, q_positions=qp, k_positions=kp)

``q (B, k, Hq, D)`` is the same on every rank of the mesh; ``k_shard, v_shard (B, L, Hkv, D)`` are this rank's
part of the cache (any ``L``, 0 included, different on every rank); ``q_positions (B, k)`` and ``k_positions
(B, L)`` are the sequence positions of the queries and of the cache entries, ``-1`` for an entry that holds
nothing (padding, a slot not filled yet). A query attends the entries at positions ``0 <= p <= its own``: causal
over the cache and among the ``k`` new tokens, each row with its own length. Every rank returns the whole ``(B, k,
Hq, D)`` result in ``q``'s dtype (combined in fp32). A static cache passes its shard in the lengths form instead:
``k_lengths (B,)`` int32, the first ``k_lengths[b]`` entries of row ``b`` are its cache, all before the one new
query of the row (Note [Flash decode]); values outside ``0 .. L`` are held to that range (checking them would read
them back from the device every step).

Note [Decode local step]
~~~~~~~~~~~~~~~~~~~~~~~~
Each rank's part reads its shard once, in the shard's own dtype, as a flash-decode kernel does: the ``G = Hq /
Hkv`` query heads sharing a K/V head become ``k G`` query rows of it, ``scores = rows @ K^T`` (fp32 results:
cuBLAS's fp32 output for fp16/bf16 on CUDA, else the input dtype's product cast) is the only fp32 tensor of the
step, ``(B, Hq, k, L)``, ``D / (k G)`` times smaller than ``K``; masked, its ``lse`` and probabilities ``exp(s - lse)``
are taken in place, and ``probabilities.to(V's dtype) @ V`` is the output (fp32 results again). No copy of ``K`` or
``V`` is made when the shard is a ``.transpose(1, 2)`` view of a ``(B, Hkv, L, D)`` tensor (the layout of
transformers' caches and of :class:`~mesh_cp.integrations.hf.shard_cache.ShardedKVCache`) or ``B = 1``; a
contiguous ``(B, L, Hkv, D)`` shard of ``B > 1`` is copied once in its dtype (the batched product needs one
stride per batch). Rows that see no entry give ``out = 0, lse = -inf``.

The step is a score product, a few passes over the fp32 scores and a product with ``V``: about twenty kernel
launches, which a CUDA graph of the decoding step replays at once (the shapes are static, nothing is read back).
It is also the default on CUDA: the fused block kernels parallelise over blocks of query rows, and a decode call
has ``k G`` rows per K/V head, one block, so ``cuda_sdpa`` (memory-efficient attention with a bias) ran 1.7 to 14
times slower than this step on an H200 at 8K to 128K cached tokens, where cuBLAS spreads the products over the
shard.

Note [Flash decode]
~~~~~~~~~~~~~~~~~~~
FlashAttention 2's varlen forward with a paged cache is a flash-decode kernel: with a ``block_table`` it always
takes the split-KV path (``mha_varlen_fwd``: ``if (paged_KV || seqlenq_ngroups_swapped)`` sets the splits by
the SMs' occupancy), so one query per row spreads over the whole GPU in one launch, and ``seqused_k`` says how
many of a page's rows are filled. PyTorch's ``aten._flash_attention_forward`` takes both (``seqused_k``,
``block_table``). A static shard cache in the lengths form is exactly that: each row's page is its ``(C, Hkv, D)``
slice of the ``(B, Hkv, C, D)`` storage read through its strides (page ``b`` of ``k.transpose(1, 2)``, stride
``Hkv C D`` between pages, ``D`` between rows, ``C D`` between heads; ``C`` a multiple of 256), its filled entries
first. :func:`decode_attn_func` in the lengths form runs :func:`mesh_cp.kernels.cuda_flash.decode_forward` on
CUDA when it can (fp16/bf16, a head dim that is a multiple of 8 up to 256, sm80+, a PyTorch whose op takes both
keywords, ``C`` a multiple of 256; ``kernel="auto"`` logs the reasons once where it cannot) and the step of
Note [Decode local step] otherwise: no copy of the shard either way, one kernel launch instead of about twenty,
and the shapes stay static. A row of length 0 gets ``out = 0`` and ``lse = -inf``, as the merge takes them.

Two faults of PyTorch 2.13's copy, read in its ``flash_api.cpp`` and FlashAttention's kernels (not worked around
by PyTorch at the time of writing; pytorch/pytorch#194167) are kept away from: with ``num_splits`` left to the
kernel (2.13 is the first to pass it to FlashAttention 2), a paged call without the GQA swap (MHA, or any call
with ``Hq = Hkv``) of more than one row can pick several splits, whose combine writes every row's output at the
first row's place; and a sequence of ``seqused_k = 0`` writes its ``+inf`` lse at a padded index, another row's
entry in the unpadded ``(H, total_q)`` statistics. So such calls pass ``num_splits=1`` (one split per row and head:
no split-KV for MHA batches, the GQA swap and single rows keep it), and an empty row reads one entry, its result
replaced by ``0`` and ``-inf``. 2.12 takes ``block_table`` but refuses ``num_splits`` for FlashAttention 2 and
does not split a paged call on its own.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from mesh_cp.core.decode import DecodeReduction
from mesh_cp.core.numerics import acc_dtype
from mesh_cp.kernels import KernelName, cuda_flash, resolve_kernel, takes
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.runtime.comm import all_gather
from mesh_cp.runtime.mesh import CPMesh

logger = logging.getLogger("mesh_cp")


def reduction_groups(mesh: CPMesh | ProcessGroup) -> tuple[tuple[ProcessGroup, ...], DecodeReduction]:
    """The levels of tree decoding over ``mesh``: its head group (hybrid), Q-group, then KV-group (Note [Tree
    decoding]); over a plain process group, one level. Levels of one member are left out."""
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
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    k_lengths: Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    kernel: KernelName | Literal["auto"] | BlockKernel | None = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of the replicated queries ``q`` over the cache whose shards the ranks of ``mesh`` hold (module
    docstring), in the positions form (``q_positions``, ``k_positions``) or the lengths form (``k_lengths`` alone,
    one new token per row: Note [Flash decode]); ``return_lse`` also gives the ``(B, Hq, k)`` fp32 log-sum-exp over
    the whole cache. Inference only (run it under ``torch.no_grad()``). ``kernel`` computes the local part
    (:func:`decode_kernel`; in the lengths form ``"auto"`` is the flash decode kernel where it runs, and
    ``"cuda_flash"`` names it). One all-gather per level of ``mesh`` combines the parts: one per call over a process
    group or a ``1 x P`` mesh."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if k_lengths is not None:
        if q_positions is not None or k_positions is not None:
            raise ValueError("pass the cache in one form: k_lengths alone, or q_positions and k_positions")
        _check_lengths(q, k, v, k_lengths)
        out, lse = lengths_attention(kernel, q, k, v, k_lengths, scale)
    else:
        if q_positions is None or k_positions is None:
            raise ValueError("decode_attn_func needs q_positions and k_positions, or k_lengths (Note [Flash decode])")
        _check_inputs(q, k, v, q_positions, k_positions)
        block = decode_kernel(kernel, q.device, q.dtype, q.shape[-1])
        out, lse = local_attention(block, q, k, v, q_positions, k_positions, scale)
    out, lse = combine(out, lse, mesh)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def decode_kernel(
    kernel: KernelName | Literal["auto"] | BlockKernel | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> BlockKernel | None:
    """The block kernel of the local step: ``None`` (Note [Decode local step]) for ``"auto"`` or ``None``; for a
    name or a kernel, that kernel, which must take masks (``"reference"``, ``"cuda_sdpa"``: slower, for checks)."""
    if kernel is None or kernel == "auto":
        return None
    block = resolve_kernel(kernel, device, dtype, head_dim)
    if not takes(block, "mask"):
        raise ValueError(f"kernel {block.name!r} takes no mask; decoding needs one: use kernel='auto' or None")
    return block


def lengths_attention(
    kernel: KernelName | Literal["auto"] | BlockKernel | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """:func:`local_attention` of the lengths form (Note [Flash decode]): ``q (B, 1, Hq, D)`` over the first
    ``lengths[b]`` entries of each row of ``k, v (B, C, Hkv, D)``; ``(out (B, 1, Hq, D), lse (B, Hq, 1))`` in fp32
    (fp64 for fp64 inputs). The flash decode kernel for ``"auto"`` where it runs (:func:`flash_decode_reasons`) or
    ``"cuda_flash"`` (which raises with the reasons where it cannot), else the positions form's step."""
    reasons = flash_decode_reasons(q, k)
    if kernel == "cuda_flash" and reasons:
        raise NotImplementedError(f"the flash decode kernel cannot run this step: {'; '.join(reasons)}")
    if kernel in ("auto", None, "cuda_flash") and not reasons:
        out, lse = cuda_flash.decode_forward(q[:, 0], k, v, lengths, scale=scale)
        acc = acc_dtype(q.dtype)
        return out[:, None].to(acc), lse[..., None].to(acc)
    if kernel in ("auto", None):
        _log_no_flash_decode(reasons)
    slots = torch.arange(k.shape[1], device=k.device)
    k_positions = torch.where(slots < lengths[:, None], 0, -1)  # every entry of the prefix is seen by the query
    q_positions = torch.zeros(q.shape[0], 1, dtype=torch.long, device=q.device)
    return local_attention(
        decode_kernel(kernel, q.device, q.dtype, q.shape[-1]), q, k, v, q_positions, k_positions, scale
    )


def cache_slots(entries: int) -> int:
    """The slots of a static shard cache for ``entries``: rounded up to a page of the flash decode kernel (Note [Flash
    decode])."""
    return -(-entries // cuda_flash.PAGE) * cuda_flash.PAGE


def flash_decode_reasons(q: Tensor, k: Tensor) -> tuple[str, ...]:
    """Every reason the flash decode kernel cannot run a lengths-form step over ``k`` (empty: it can)."""
    reasons = list(cuda_flash.decode_reasons(q.device, q.dtype, q.shape[-1]))
    if k.shape[1] % cuda_flash.PAGE or not k.shape[1]:
        reasons.append(f"the shard's {k.shape[1]} slots are not a positive multiple of {cuda_flash.PAGE} (a page)")
    return tuple(reasons)


@functools.cache
def _log_no_flash_decode(reasons: tuple[str, ...]) -> None:
    logger.info("mesh_cp: decoding with the local step, not the flash decode kernel: %s", "; ".join(reasons))


def visibility(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """``(B, k, L)``: entry ``j`` of row ``b`` is seen by query ``i`` iff ``0 <= p_j <= p_i``."""
    keys = k_positions[:, None, :]
    return (keys >= 0) & (keys <= q_positions[:, :, None])


def local_attention(
    block: BlockKernel | None, q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """The attention of queries ``q (B, k, Hq, D)`` over one shard ``k, v (B, L, Hkv, D)`` with the positions'
    visibility (module docstring): ``(out (B, k, Hq, D), lse (B, Hq, k))`` in fp32 (fp64 for fp64 inputs), before
    any combining (the part each rank computes; a ring decoder can merge these itself). ``block=None`` is Note
    [Decode local step]; a block kernel (one that takes masks) computes it over the query rows of each K/V head
    instead (query head ``h`` reads K/V head ``h // G``)."""
    if block is None:
        return decode_step(q, k, v, q_positions, k_positions, scale)
    batch, new, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    rows = q.reshape(batch, new, kv_heads, group, dim).transpose(2, 3).reshape(batch, new * group, kv_heads, dim)
    seen = visibility(q_positions, k_positions).repeat_interleave(group, dim=1)[:, None]
    out, lse = block.forward(rows, k, v, causal=False, scale=scale, mask=seen)
    out = out.reshape(batch, new, group, kv_heads, dim).transpose(2, 3).reshape(batch, new, heads, dim)
    lse = lse.reshape(batch, kv_heads, new, group).transpose(2, 3).reshape(batch, heads, new)
    acc = acc_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def decode_step(
    q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Note [Decode local step]: :func:`local_attention` without a block kernel, reading ``k`` and ``v`` in their
    dtype (no fp32 copy of the shard); ``(out (B, k, Hq, D), lse (B, Hq, k))`` in fp32 (fp64 for fp64 inputs)."""
    batch, new, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    acc = acc_dtype(q.dtype)
    # Query head h = j * G + g reads K/V head j: row i * G + g of head j.
    rows = q.reshape(batch, new, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(batch * kv_heads, -1, dim)
    keys = k.transpose(1, 2).reshape(batch * kv_heads, length, dim)  # a view for (B, Hkv, L, D) storage
    values = v.transpose(1, 2).reshape(batch * kv_heads, length, dim)
    scores = _bmm_acc(rows.to(k.dtype), keys.transpose(1, 2), acc).mul_(scale)  # (B Hkv, k G, L)
    keys_at = k_positions[:, None, None, None, :]
    hidden = (keys_at < 0) | (keys_at > q_positions[:, None, :, None, None])  # (B, 1, k, 1, L)
    scores.view(batch, kv_heads, new, group, length).masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B Hkv, k G); -inf where a row sees nothing
    # exp(-inf - finite) = 0 for a row that sees nothing (its lse stays -inf).
    probs = scores.sub_(lse.clamp_min(torch.finfo(lse.dtype).min)[..., None]).exp_()  # in place: 0 where hidden
    out = _bmm_acc(probs.to(v.dtype), values, acc)  # (B Hkv, k G, D)
    out = out.view(batch, kv_heads, new, group, dim).permute(0, 2, 1, 3, 4).reshape(batch, new, heads, dim)
    lse = lse.view(batch, kv_heads, new, group).transpose(2, 3).reshape(batch, heads, new)
    return out, lse


_CUDA_OUT_DTYPE = [True]
"""Whether ``torch.bmm(..., out_dtype=)`` is tried for fp16/bf16 on CUDA (set off the first time torch refuses)."""


def _bmm_acc(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """``a @ b`` of 3-D tensors as ``acc``: the products accumulate in fp32 in every backend; for fp16/bf16 on CUDA
    cuBLAS writes them as fp32 (no rounding to the input dtype), elsewhere the result is cast."""
    if a.dtype != acc and a.is_cuda and _CUDA_OUT_DTYPE[0]:
        try:
            return torch.bmm(a, b, out_dtype=acc)
        except TypeError:  # a torch without out_dtype; any other error is the caller's
            _CUDA_OUT_DTYPE[0] = False
    return torch.bmm(a, b).to(acc)


def combine(out: Tensor, lse: Tensor, mesh: CPMesh | ProcessGroup) -> tuple[Tensor, Tensor]:
    """The ranks' partial results ``out (B, k, H, D)`` and ``lse (B, H, k)`` (``-inf``: nothing seen) combined over
    ``mesh`` into the result and lse over every rank's keys, on every rank (Note [Tree decoding]): per level, one
    all-gather of every member's ``[out, lse]`` packed as one ``(B, k, H, D + 1)`` tensor, then a local merge, in
    fp32 (fp64 for fp64 inputs)."""
    levels, _ = reduction_groups(mesh)
    acc = acc_dtype(out.dtype)
    out, lse = out.to(acc), lse.to(acc)
    for group in levels:
        piece = torch.cat([out, lse.transpose(1, 2)[..., None]], dim=-1)
        pieces = all_gather(piece, group)  # (n, B, k, H, D + 1)
        out, rows_lse = merge_pieces(pieces[..., :-1], pieces[..., -1])
        lse = rows_lse.transpose(1, 2)
    return out, lse


def merge_pieces(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """The LSE merge of ``n`` partial results ``outs (n, ..., D)``, ``lses (n, ...)`` over disjoint key sets (Note
    [LSE merge]): ``(out (..., D), lse (...))``; a row whose ``lse`` is ``-inf`` in every piece gets ``out = 0`` and
    ``lse = -inf``."""
    low = torch.finfo(lses.dtype)
    top = lses.amax(dim=0).clamp_min(low.min)  # finite: a row no piece saw gets weight exp(-inf) = 0 everywhere
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    # An empty piece's out is 0 (the local step's and the block kernels'), so a row no piece saw gets 0 / tiny = 0.
    out = (weights[..., None] * outs).sum(dim=0) / total.clamp_min(low.tiny)[..., None]
    return out, top + torch.log(total)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "decode_attn_func is for inference: call it under torch.no_grad() (its all-gathers have no gradient)"
        )
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"q must be (B, k, Hq, D) and k, v (B, L, Hkv, D) of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    batch, _, heads, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim or heads % k.shape[2]:
        raise ValueError(
            f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}: same batch and head dim, and Hq a multiple of Hkv"
        )


def _check_lengths(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> None:
    _check_shapes(q, k, v)
    if q.shape[1] != 1:
        raise ValueError(
            f"the lengths form takes one new token per row, got q {tuple(q.shape)} ({q.shape[1]} new tokens); pass "
            "q_positions and k_positions for several (causal among them)"
        )
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (q.shape[0],) or lengths.device != q.device:
        raise ValueError(
            f"k_lengths must be a (B,) = ({q.shape[0]},) int32 tensor on {q.device}, got {tuple(lengths.shape)} "
            f"{lengths.dtype} on {lengths.device}"
        )


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor) -> None:
    _check_shapes(q, k, v)
    batch, new = q.shape[:2]
    if tuple(q_positions.shape) != (batch, new) or tuple(k_positions.shape) != (batch, k.shape[1]):
        raise ValueError(
            f"q_positions {tuple(q_positions.shape)} must be (B, k) = {(batch, new)} and k_positions "
            f"{tuple(k_positions.shape)} (B, L) = {(batch, k.shape[1])}"
        )
    for name, t in (("q_positions", q_positions), ("k_positions", k_positions)):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.device != q.device:
            raise ValueError(f"{name} must be an integer tensor on {q.device}, got {t.dtype} on {t.device}")
