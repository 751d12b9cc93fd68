"""CUDA kernel through PyTorch's memory-efficient SDPA (fp16/bf16/fp32), which exposes the lse."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from mesh_cp.core.numerics import expand_kv, fold_kv_grad
from mesh_cp.kernels.base import CudaOnlyKernel, fused_backward_inputs, pad_head_dim, round_up

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The head dim is padded with zeros to a multiple of this (exact: zero columns change no score), so
# the kernel's aligned variants always apply.
HEAD_DIM_MULTIPLE = 8


def _lse_len(rows: int) -> int:
    # The CUDA memory-efficient kernel pads its lse to a multiple of 32 rows (ROCm does not).
    return rows if torch.version.hip else math.ceil(rows / 32) * 32


class CudaSdpaKernel(CudaOnlyKernel):
    """``aten._scaled_dot_product_efficient_attention`` and its backward, on CUDA tensors.

    Any head dim (padded to a multiple of 8); GQA heads are expanded before the call.
    """

    name = "cuda_sdpa"

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        """Why this kernel cannot run such inputs (``None``: it can)."""
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        if dtype not in DTYPES:
            return f"the memory-efficient kernel supports {[str(d) for d in DTYPES]}, not {dtype}"
        if not torch.version.hip:
            capability = torch.cuda.get_device_capability(device)
            if capability < (5, 0):
                return f"compute capability {capability[0]}.{capability[1]} < 5.0"
            if dtype == torch.bfloat16 and capability < (8, 0):
                return f"bfloat16 needs compute capability >= 8.0, got {capability[0]}.{capability[1]}"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        heads, dim = q.shape[2], q.shape[-1]
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded) for t in (q, expand_kv(k, heads), expand_kv(v, heads)))
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            True,
            0.0,
            causal,
            scale=scale,
        )
        return out.transpose(1, 2)[..., :dim], lse[..., : q.shape[1]].float()

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
        heads, kv_heads, rows, dim = q.shape[2], k.shape[2], q.shape[1], q.shape[-1]
        k, v = expand_kv(k, heads), expand_kv(v, heads)
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        lse = F.pad(lse.float(), (0, _lse_len(rows) - rows)).contiguous()
        empty = torch.empty((), device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
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
            dq.transpose(1, 2)[..., :dim],
            fold_kv_grad(dk.transpose(1, 2)[..., :dim], kv_heads),
            fold_kv_grad(dv.transpose(1, 2)[..., :dim], kv_heads),
        )
