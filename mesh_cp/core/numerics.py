"""Numerics shared by every schedule: the one LSE merge, accumulator dtypes, GQA head folding.

Torch tensors only; nothing here touches torch.distributed.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from mesh_cp.core.masks import AttentionMask

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for outputs, lse and gradients: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` (``"cuda"``, ``"cpu"``, ...) when it is enabled
    there in this thread, ``None`` when it is not (or autocast does not know the device type)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type without autocast, such as "meta"
        pass
    return None


def autocast_inputs(tensors: tuple[Tensor, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Cast as autocast casts the inputs of an op on its lower-precision list (such as
    ``scaled_dot_product_attention``): floating tensors other than fp64 to ``dtype``; others unchanged.
    Differentiable: gradients flow back to the inputs in their own dtype."""
    return tuple(
        t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def merge_(o_acc: Tensor, lse_acc: Tensor, o_new: Tensor, lse_new: Tensor) -> None:
    """Merge a partial attention result into accumulators, in place.

    Note [LSE merge]
    ~~~~~~~~~~~~~~~~
    A partial result over a key set ``K1`` is ``o1 = sum_j exp(s_j - lse1) v_j`` with
    ``lse1 = log sum_j exp(s_j)``. For disjoint key sets ``K1`` and ``K2``::

        lse = log(exp(lse1) + exp(lse2)) = logaddexp(lse1, lse2)
        o   = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2

    which is exactly the result over ``K1 u K2``. An empty key set has ``lse = -inf`` and ``o = 0``;
    when both sides are empty the merged ``lse`` is ``-inf`` and both weights are taken as 0 (the
    plain formula would give ``nan``). The merge runs in the accumulators' dtype (fp32 or fp64),
    whatever the dtype of ``o_new``.

    Shapes: ``o_acc (batch, rows, heads, head_dim)``, ``lse_acc (batch, heads, rows)``;
    ``o_new``/``lse_new`` the same, any floating dtype.
    """
    lse_new = lse_new.to(lse_acc.dtype)
    lse = torch.logaddexp(lse_acc, lse_new)
    finite = torch.nan_to_num(lse, nan=math.nan, posinf=0.0, neginf=0.0)  # infinities as 0
    w_old, w_new = torch.exp(torch.stack((lse_acc, lse_new)) - finite).transpose(2, 3).unsqueeze(-1)
    o_acc.mul_(w_old).add_(widened(o_new, o_acc.dtype, lse_acc.dtype) * w_new)
    lse_acc.copy_(lse)


def merged(
    o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The LSE merge (Note [LSE merge]) of two partials into new tensors ``(o, lse)``, computed in the dtype of
    ``lse1``: what :func:`merge_` leaves in ``o1, lse1``, without writing them (nor a copy of them first). ``o`` is
    written in ``dtype`` (default: the one it is computed in), rounded once: a final output straight in the input
    dtype."""
    lse2 = lse2.to(lse1.dtype)
    lse = torch.logaddexp(lse1, lse2)
    finite = torch.nan_to_num(lse, nan=math.nan, posinf=0.0, neginf=0.0)  # infinities as 0
    w1, w2 = torch.exp(torch.stack((lse1, lse2)) - finite).transpose(2, 3).unsqueeze(-1)
    o = widened(o1, lse1.dtype, lse1.dtype) * w1 + widened(o2, lse1.dtype, lse1.dtype) * w2
    return (o if dtype is None or dtype == o.dtype else o.to(dtype)), lse


def added(x: Tensor, y: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``x + y`` computed in the accumulator dtype of the two (fp32 for bf16 and fp16: a sum of partial gradients), and
    written in ``dtype`` (default: the one it is computed in)."""
    acc = acc_dtype(torch.promote_types(x.dtype, y.dtype))
    out = widened(x, acc, y.dtype) + widened(y, acc, x.dtype)
    return out if dtype is None or dtype == out.dtype else out.to(dtype)


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat KV heads for GQA/MQA: ``(B, S, Hkv, D) -> (B, S, heads, D)``; q head ``h`` reads kv head
    ``h // (heads // Hkv)`` (the convention of Hugging Face's ``repeat_kv`` and flash-attn)."""
    kv_heads = x.shape[2]
    if kv_heads == heads:
        return x
    return x.repeat_interleave(heads // kv_heads, dim=2)


def fold_kv_grad(dx: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradient of expanded KV heads back: ``(B, S, heads, D) -> (B, S, kv_heads, D)``, in the accumulator
    dtype (one rounding fewer than a sum rounded back to a low ``dx`` dtype; the callers accumulate in it)."""
    b, s, heads, d = dx.shape
    if heads == kv_heads:
        return dx
    return dx.reshape(b, s, kv_heads, heads // kv_heads, d).sum(3, dtype=acc_dtype(dx.dtype))


def attention_delta(do: Tensor, out: Tensor, dlse: Tensor | None = None) -> Tensor:
    """``delta = rowsum(dO * O) - dlse`` in the accumulator dtype, shaped ``(batch, heads, seq)``.

    A gradient ``dlse`` on the lse (``None``: none) enters every block as ``delta - dlse``
    (``d lse_i / d s_ij = p_ij``; Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`).
    """
    acc = acc_dtype(do.dtype)
    do_acc = widened(do, acc, out.dtype)
    delta = (do_acc * widened(out, acc, do_acc.dtype)).sum(-1).transpose(1, 2).contiguous()
    return delta if dlse is None else delta - dlse.to(acc)


def widened(x: Tensor, dtype: torch.dtype, other: torch.dtype) -> Tensor:
    """``x`` as an operand, beside one of dtype ``other``, of an elementwise op that must compute in ``dtype``: ``x``
    itself when type promotion gives ``dtype`` (the op converts ``x`` as it reads it, to the values ``x.to(dtype)``
    holds, without that copy), else ``x.to(dtype)``."""
    promoted = torch.promote_types(x.dtype, other) if torch.compiler.is_compiling() else _promoted(x.dtype, other)
    return x if promoted == dtype else x.to(dtype)


@functools.lru_cache(maxsize=64)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``, looked up (the op goes through the dispatcher; a compiled caller calls it, as
    Dynamo traces through the cache)."""
    return torch.promote_types(a, b)


def mask_causal(scores: Tensor) -> Tensor:
    """``scores (..., Sq, Sk)`` with entries above the top-left diagonal (key ``j > i``) set to ``-inf``."""
    sq, sk = scores.shape[-2:]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(mask, float("-inf"))


def document_ids(mask: AttentionMask, batch: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
    """``(batch, seq_len)`` int64 on ``device``: the document index of every global position, ``-1`` for padding.
    Built once per mask and device (every layer of a model calls with the same mask: one host-to-device copy per
    step, not per layer); do not write to it."""
    return _document_ids(mask, batch, seq_len, None if device is None else torch.device(device))


@functools.lru_cache(maxsize=8)
def _document_ids(mask: AttentionMask, batch: int, seq_len: int, device: torch.device | None) -> Tensor:
    ids = torch.full((batch, seq_len), -1, dtype=torch.int64)
    for row in range(batch):
        at = row if mask.rows is not None else 0
        for doc, (start, stop) in zip(mask.span_documents(at, seq_len), mask.row_documents(at, seq_len), strict=True):
            ids[row, start:stop] = doc
    return ids if device is None else ids.to(device)


def visibility(doc_ids: Tensor, q_pos: Tensor, k_pos: Tensor, *, causal: bool, window: int | None) -> Tensor:
    """``(B, 1, Sq, Sk)`` boolean: query at global position ``q_pos[i]`` attends key at ``k_pos[j]`` (same
    document, not padding, ``k <= q`` when causal, ``q - k < window`` when given)."""
    dq, dk = doc_ids[:, q_pos], doc_ids[:, k_pos]
    seen = (dq[:, :, None] == dk[:, None, :]) & (dq[:, :, None] >= 0)
    distance = q_pos[:, None] - k_pos[None, :]
    if causal:
        seen = seen & (distance >= 0)
    if window is not None:
        seen = seen & (distance < window)
    return seen.unsqueeze(1)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    mask: AttentionMask | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain single-process attention in the input dtype, differentiable, for checks.

    ``q (B, S, Hq, D)``, ``k, v (B, S, Hkv, D)`` -> ``out (B, S, Hq, D)``, ``lse (B, Hq, S)``.
    Causal is top-left aligned (query ``i`` sees keys ``j <= i``). ``mask`` (documents, padding, window over
    positions ``0..S-1``) and ``softcap`` (logits ``c * tanh(s / c)``) as in :func:`mesh_cp.mesh_attn_func`;
    a query that attends nothing gets ``out = 0`` and ``lse = -inf``.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    heads = q.shape[2]
    qh = q.transpose(1, 2)
    kh = expand_kv(k, heads).transpose(1, 2)
    vh = expand_kv(v, heads).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        scores = mask_causal(scores)
    if mask is not None:
        seq = q.shape[1]
        pos = torch.arange(seq, device=q.device)
        ids = document_ids(mask, q.shape[0], seq, q.device)
        scores = scores.masked_fill(~visibility(ids, pos, pos, causal=causal, window=mask.window), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(scores - finite.unsqueeze(-1)) @ vh
    return out.transpose(1, 2), lse
