"""CUDA kernel through PyTorch's memory-efficient SDPA (fp16/bf16/fp32), which exposes the lse."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from mesh_cp.core.numerics import expand_kv, fold_kv_grad
from mesh_cp.kernels.base import out_for_delta


def _lse_len(rows: int) -> int:
    # The CUDA memory-efficient kernel pads its lse to a multiple of 32 rows (ROCm does not).
    return rows if torch.version.hip else math.ceil(rows / 32) * 32


class CudaSdpaKernel:
    """``aten._scaled_dot_product_efficient_attention`` and its backward, on CUDA tensors."""

    name = "cuda_sdpa"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("kernel 'cuda_sdpa' needs CUDA; on CPU use kernel='cpu_flash'")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        heads = q.shape[2]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2),
            expand_kv(k, heads).transpose(1, 2),
            expand_kv(v, heads).transpose(1, 2),
            None,
            True,
            0.0,
            causal,
            scale=scale,
        )
        return out.transpose(1, 2), lse[..., : q.shape[1]].float()

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads, rows = q.shape[2], k.shape[2], q.shape[1]
        lse = F.pad(lse.float(), (0, _lse_len(rows) - rows)).contiguous()
        out = out_for_delta(do, delta)
        empty = torch.empty((), device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            expand_kv(k, heads).transpose(1, 2),
            expand_kv(v, heads).transpose(1, 2),
            None,
            out.transpose(1, 2),
            lse,
            empty,
            empty,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return (
            dq.transpose(1, 2),
            fold_kv_grad(dk.transpose(1, 2), kv_heads),
            fold_kv_grad(dv.transpose(1, 2), kv_heads),
        )
