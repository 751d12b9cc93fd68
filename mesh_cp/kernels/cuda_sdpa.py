"""CUDA kernel through PyTorch's memory-efficient SDPA (fp16/bf16/fp32), which exposes the lse.

Note [Masked tiles in the memory-efficient kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A masked tile goes in as ``attn_bias``: ``0`` where a query sees a key, ``-inf`` elsewhere, in the input dtype,
materialised as ``(B, H, Sq, Sk)`` and sliced from a last dim padded to a multiple of 16, as PyTorch's own
``scaled_dot_product_attention`` prepares it (``preprocess_mask``: expand, then ``pad_bias<mem_eff_alignment>``),
so every stride but the last is a multiple of 16 elements. A query that sees no key of the tile would make a row
of ``-inf`` scores, whose result mesh_cp does not rely on: such a row gets a bias of ``0`` (it attends every key),
and its output is then set to ``0`` and its lse to ``-inf``, what the LSE merge takes. In backward the same row
gets ``lse = 1e30`` and ``delta = 0``: its probabilities ``exp(s - lse)`` are ``0``, so it adds nothing to dq, dk,
dv whatever its ``dO``, and ``delta = 0`` keeps the ``out`` of Note [Gradient of the lse] finite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from mesh_cp.core.numerics import expand_kv, fold_kv_grad
from mesh_cp.kernels.base import Capabilities, CudaOnlyKernel, fused_backward_inputs, pad_head_dim, round_up

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The head dim is padded with zeros to a multiple of this (exact: zero columns change no score), so
# the kernel's aligned variants always apply.
HEAD_DIM_MULTIPLE = 8


# Multiple of the bias's last dim that PyTorch pads to for this kernel (mem_eff_alignment in attention.cu).
BIAS_ALIGNMENT = 16
# The lse backward gives rows that see no key of a masked tile: exp(s - 1e30) is 0 for every finite score.
_NO_KEYS_LSE = 1e30


def _bias(mask: Tensor, batch: int, heads: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The kernel's ``(B, H, Sq, Sk)`` additive bias of the boolean ``mask (B or 1, 1, Sq, Sk)``, and which rows see
    no key ``(B, 1, Sq)`` (Note [Masked tiles in the memory-efficient kernel])."""
    mask = mask.expand(batch, 1, *mask.shape[2:])
    empty = ~mask.any(-1)
    rows, keys = mask.shape[2:]
    padded = torch.full(
        (batch, heads, rows, round_up(keys, BIAS_ALIGNMENT)), float("-inf"), dtype=dtype, device=mask.device
    )
    bias = padded[..., :keys]  # the padded tensor's strides: every one but the last a multiple of 16
    bias.masked_fill_(mask | empty.unsqueeze(-1), 0)
    return bias, empty


def _lse_len(rows: int) -> int:
    # The CUDA memory-efficient kernel pads its lse to a multiple of 32 rows (ROCm does not).
    return rows if torch.version.hip else math.ceil(rows / 32) * 32


class CudaSdpaKernel(CudaOnlyKernel):
    """``aten._scaled_dot_product_efficient_attention`` and its backward, on CUDA tensors.

    Any head dim (padded to a multiple of 8); GQA heads are expanded before the call.
    """

    name = "cuda_sdpa"
    capabilities = Capabilities(
        keywords={"mask"}, devices=("cuda",), dtypes=DTYPES, head_dim_multiple=HEAD_DIM_MULTIPLE, dq_in_input_dtype=True
    )
    """``forward`` and ``backward`` take a boolean ``mask`` (Note [Masked tiles in the memory-efficient kernel])."""

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, and on a CUDA
        device (not ROCm) the compute capability: at least 5.0, and 8.0 for bfloat16."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        if device.type == "cuda" and not torch.version.hip:
            capability = torch.cuda.get_device_capability(device)
            if capability < (5, 0):
                reasons.append(f"compute capability {capability[0]}.{capability[1]} < 5.0")
            if dtype == torch.bfloat16 and capability < (8, 0):
                reasons.append(f"bfloat16 needs compute capability >= 8.0, got {capability[0]}.{capability[1]}")
        return tuple(reasons)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        heads, dim = q.shape[2], q.shape[-1]
        bias, empty = (None, None) if mask is None else _bias(mask, q.shape[0], heads, q.dtype)
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded) for t in (q, expand_kv(k, heads), expand_kv(v, heads)))
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            bias,
            True,
            0.0,
            causal,
            scale=scale,
        )
        out, lse = out.transpose(1, 2)[..., :dim], lse[..., : q.shape[1]].float()
        if empty is not None:
            out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse

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
        heads, kv_heads, rows, dim = q.shape[2], k.shape[2], q.shape[1], q.shape[-1]
        bias = None
        if mask is not None:  # Note [Masked tiles in the memory-efficient kernel]
            bias, empty = _bias(mask, q.shape[0], heads, q.dtype)
            lse, delta = lse.masked_fill(empty, _NO_KEYS_LSE), delta.masked_fill(empty, 0)
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
            bias,
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
