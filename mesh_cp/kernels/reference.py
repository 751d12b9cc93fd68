"""A readable pure-torch block kernel: the specification the fused kernels are tested against, and the
kernel of blocks with an explicit mask or softcapped logits."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype, expand_kv, fold_kv_grad, mask_causal
from mesh_cp.kernels.base import Capabilities
from mesh_cp.kernels.varlen import Segments, segments_mask


def _scores(
    q: Tensor, k: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """``(B, Hq, Sq, Sk)`` scores in the accumulator dtype with masked entries ``-inf``, and the scores before
    masking (softcapped: ``softcap * tanh(s / softcap)``, whose derivative backward needs)."""
    acc = acc_dtype(q.dtype)
    qh = q.to(acc).transpose(1, 2)
    kh = expand_kv(k, q.shape[2]).to(acc).transpose(1, 2)
    raw = (qh @ kh.transpose(-1, -2)) * scale
    if softcap is not None:
        raw = softcap * torch.tanh(raw / softcap)
    scores = mask_causal(raw) if causal else raw
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores, raw


def _with_segments(mask: Tensor | None, segments: Segments | None, q: Tensor, k: Tensor) -> Tensor | None:
    """``mask`` and the dense equivalent of ``segments`` (:func:`~mesh_cp.kernels.varlen.segments_mask`)."""
    if segments is None:
        return mask
    seen = segments_mask(segments, q.shape[1], k.shape[1], device=q.device)
    return seen if mask is None else mask & seen


def _probabilities(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(s - lse)``, with ``0`` in rows that attend nothing (``lse = -inf``) instead of ``nan``."""
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite.unsqueeze(-1))


class ReferenceKernel:
    """``softmax(q k^T * scale) v`` written out, with its textbook backward.

    Beyond :class:`~mesh_cp.kernels.BlockKernel` it takes ``mask`` (boolean, broadcastable to
    ``(B, Hq, Sq, Sk)``, ``True`` where a query attends a key), ``segments`` (a masked tile as flash-attn varlen
    sequences, :mod:`mesh_cp.kernels.varlen`, applied as their dense mask, with ``mask`` if both are given) and
    ``softcap`` (logits ``c * tanh(s / c)``, Gemma 2). A row that attends nothing gets ``out = 0`` and
    ``lse = -inf`` (what the LSE merge expects).
    """

    name = "reference"
    capabilities = Capabilities(keywords={"mask", "segments", "softcap"})

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (none: it runs anything, in O(Sq * Sk) memory)."""
        return cls.capabilities.not_supported_reasons(device, dtype, head_dim)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Tensor | None = None,
        softcap: float | None = None,
        segments: Segments | None = None,
    ) -> tuple[Tensor, Tensor]:
        mask = _with_segments(mask, segments, q, k)
        scores, _ = _scores(q, k, causal=causal, scale=scale, mask=mask, softcap=softcap)
        lse = torch.logsumexp(scores, dim=-1)
        vh = expand_kv(v, q.shape[2]).to(scores.dtype).transpose(1, 2)
        out = _probabilities(scores, lse) @ vh
        return out.transpose(1, 2).to(q.dtype), lse

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        lse_grad: bool = False,
        mask: Tensor | None = None,
        softcap: float | None = None,
        segments: Segments | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Reads delta directly, so any delta is exact (lse_grad changes nothing; Note [Gradient of the lse]).
        # p = exp(s - lse);  dv = p^T dO;  dp = dO v^T;  ds = p * (dp - delta);  dq = ds k;  dk = ds^T q
        # With softcap, s = c tanh(r / c) of the raw scores r, and dr = ds * (1 - (s / c)^2).
        heads, kv_heads = q.shape[2], k.shape[2]
        mask = _with_segments(mask, segments, q, k)
        scores, capped = _scores(q, k, causal=causal, scale=scale, mask=mask, softcap=softcap)
        acc = scores.dtype
        p = _probabilities(scores, lse.to(acc))
        doh = do.to(acc).transpose(1, 2)
        vh = expand_kv(v, heads).to(acc).transpose(1, 2)
        kh = expand_kv(k, heads).to(acc).transpose(1, 2)
        qh = q.to(acc).transpose(1, 2)
        dv = p.transpose(-1, -2) @ doh
        ds = p * (doh @ vh.transpose(-1, -2) - delta.to(acc).unsqueeze(-1))
        if softcap is not None:
            ds = ds * (1 - (capped / softcap) ** 2)
        dq = (ds @ kh) * scale
        dk = (ds.transpose(-1, -2) @ qh) * scale
        return (
            dq.transpose(1, 2),
            fold_kv_grad(dk.transpose(1, 2), kv_heads),
            fold_kv_grad(dv.transpose(1, 2), kv_heads),
        )
