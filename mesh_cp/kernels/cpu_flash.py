"""The fused CPU flash-attention kernel of ATen, which returns the lse the merge needs."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.numerics import SUPPORTED_DTYPES, expand_kv, fold_kv_grad
from mesh_cp.kernels.base import fused_backward_inputs


class CpuFlashKernel:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp16/bf16/fp32/fp64, any head dim)."""

    name = "cpu_flash"

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        """Why this kernel cannot run such inputs (``None``: it can)."""
        if device.type != "cpu":
            return f"needs CPU tensors, got {device.type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not one of {[str(d) for d in SUPPORTED_DTYPES]}"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        heads = q.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2),
            expand_kv(k, heads).transpose(1, 2),
            expand_kv(v, heads).transpose(1, 2),
            0.0,
            causal,
            scale=scale,
        )
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
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads, dim = q.shape[2], k.shape[2], q.shape[-1]
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
            scale=scale,
        )
        return (
            dq.transpose(1, 2)[..., :dim],
            fold_kv_grad(dk.transpose(1, 2)[..., :dim], kv_heads),
            fold_kv_grad(dv.transpose(1, 2)[..., :dim], kv_heads),
        )
