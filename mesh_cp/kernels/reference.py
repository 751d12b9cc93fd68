"""A readable pure-torch block kernel: the specification the fused kernels are tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype, expand_kv, fold_kv_grad, mask_causal


def _scores(q: Tensor, k: Tensor, *, causal: bool, scale: float) -> Tensor:
    """``(B, Hq, Sq, Sk)`` scores in the accumulator dtype, causal entries set to ``-inf``."""
    acc = acc_dtype(q.dtype)
    qh = q.to(acc).transpose(1, 2)
    kh = expand_kv(k, q.shape[2]).to(acc).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    return mask_causal(scores) if causal else scores


class ReferenceKernel:
    """``softmax(q k^T * scale) v`` written out, with its textbook backward."""

    name = "reference"

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        """Why this kernel cannot run such inputs (``None``: it can; it runs anything, in O(Sq * Sk) memory)."""
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        scores = _scores(q, k, causal=causal, scale=scale)
        lse = torch.logsumexp(scores, dim=-1)
        vh = expand_kv(v, q.shape[2]).to(scores.dtype).transpose(1, 2)
        out = torch.exp(scores - lse.unsqueeze(-1)) @ vh
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
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Reads delta directly, so any delta is exact (lse_grad changes nothing; Note [Gradient of the lse]).
        # p = exp(s - lse);  dv = p^T dO;  dp = dO v^T;  ds = p * (dp - delta);  dq = ds k;  dk = ds^T q
        heads, kv_heads = q.shape[2], k.shape[2]
        scores = _scores(q, k, causal=causal, scale=scale)
        acc = scores.dtype
        p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
        doh = do.to(acc).transpose(1, 2)
        vh = expand_kv(v, heads).to(acc).transpose(1, 2)
        kh = expand_kv(k, heads).to(acc).transpose(1, 2)
        qh = q.to(acc).transpose(1, 2)
        dv = p.transpose(-1, -2) @ doh
        ds = p * (doh @ vh.transpose(-1, -2) - delta.to(acc).unsqueeze(-1))
        dq = (ds @ kh) * scale
        dk = (ds.transpose(-1, -2) @ qh) * scale
        return (
            dq.transpose(1, 2),
            fold_kv_grad(dk.transpose(1, 2), kv_heads),
            fold_kv_grad(dv.transpose(1, 2), kv_heads),
        )
