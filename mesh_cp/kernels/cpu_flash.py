"""The fused CPU flash-attention kernel of ATen, which returns the lse the merge needs."""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.core.numerics import expand_kv, fold_kv_grad
from mesh_cp.kernels.base import out_for_delta


class CpuFlashKernel:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp16/bf16/fp32/fp64)."""

    name = "cpu_flash"

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
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads = q.shape[2], k.shape[2]
        out = out_for_delta(do, delta)
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
            dq.transpose(1, 2),
            fold_kv_grad(dk.transpose(1, 2), kv_heads),
            fold_kv_grad(dv.transpose(1, 2), kv_heads),
        )
