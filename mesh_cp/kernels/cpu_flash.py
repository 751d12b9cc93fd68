"""The fused CPU flash-attention kernel of ATen, which returns the lse the merge needs."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.numerics import SUPPORTED_DTYPES, expand_kv, fold_kv_grad
from mesh_cp.kernels.base import Capabilities, fused_backward_inputs


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The boolean ``mask`` as the op takes it: ``0`` where a query attends, ``-inf`` elsewhere, in ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class CpuFlashKernel:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp16/bf16/fp32/fp64, any head dim)."""

    name = "cpu_flash"
    capabilities = Capabilities(keywords={"mask"}, devices=("cpu",), dtypes=SUPPORTED_DTYPES, dq_in_input_dtype=True)
    """``forward`` and ``backward`` take a boolean ``mask`` (blocks a :class:`~mesh_cp.core.AttentionMask` cuts)."""

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits only."""
        return cls.capabilities.not_supported_reasons(device, dtype, head_dim)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``mask``: boolean, broadcastable to ``(B, Hq, Sq, Sk)``, ``True`` where a query attends a key; the op
        takes it as an additive mask in the input dtype. A row that attends nothing gets ``out = 0`` and (the
        op returns ``lse = 0`` there) ``lse = -inf``, as the LSE merge expects."""
        heads = q.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2),
            expand_kv(k, heads).transpose(1, 2),
            expand_kv(v, heads).transpose(1, 2),
            0.0,
            causal,
            attn_mask=None if mask is None else _additive(mask, q.dtype),
            scale=scale,
        )
        if mask is not None:
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out.transpose(1, 2), lse

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
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads, dim = q.shape[2], k.shape[2], q.shape[-1]
        if mask is not None:  # a row with no key anywhere (lse -inf) has p = exp(-inf - 0) = 0 everywhere
            lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            expand_kv(k, heads).transpose(1, 2),
            expand_kv(v, heads).transpose(1, 2),
            out.transpose(1, 2),
            lse.contiguous(),
            0.0,
            causal,
            attn_mask=None if mask is None else _additive(mask, q.dtype),
            scale=scale,
        )
        return (
            dq.transpose(1, 2)[..., :dim],
            fold_kv_grad(dk.transpose(1, 2)[..., :dim], kv_heads),
            fold_kv_grad(dv.transpose(1, 2)[..., :dim], kv_heads),
        )
