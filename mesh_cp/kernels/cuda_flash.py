"""CUDA kernel through PyTorch's own copy of FlashAttention 2 (fp16/bf16, sm80+, native GQA).

``aten._scaled_dot_product_flash_attention`` / ``_scaled_dot_product_flash_attention_backward``
(arguments unchanged from torch 2.4 to 2.13; outputs 6 and 7 were named ``philox_seed``,
``philox_offset`` before)::

    (query, key, value, dropout_p, is_causal, return_debug_mask, *, scale)
        -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
     is_causal, philox_seed, philox_offset, *, scale) -> (grad_query, grad_key, grad_value)

Tensors are ``(B, H, S, D)``; K and V may have fewer heads (GQA). The lse is ``(B, H, Sq)`` fp32,
unpadded. The op does not pad the head dim: its C++ requires ``D % 8 == 0`` and ``D <= 256``
("this is ensured by padding", which ``F.scaled_dot_product_attention`` does before calling it), so
this kernel pads with zeros and cuts the outputs back. ``cum_seq_q/k`` are undefined (``None``) for
dense batches; the philox tensors are read only with dropout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.kernels.base import CudaOnlyKernel, backward_by_parts, fused_backward_inputs, pad_head_dim, round_up

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device; ``(0, 0)`` for others (``meta`` tensors in tests)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _refused_width(padded: int, capability: tuple[int, int], what: str) -> str | None:
    """Why the kernel cannot train with a padded head dim of ``padded`` on a GPU of ``capability``."""
    if padded > MAX_HEAD_DIM:
        return f"{what} > {MAX_HEAD_DIM}"
    # PyTorch's own dispatch (sdp_utils: ..._gt192_constraints_on_sm86_89_or_120) refuses training with
    # head dims in (192, 224] on these GPUs.
    if capability in ((8, 6), (8, 9), (12, 0), (12, 1)) and 192 < padded <= 224:
        return f"{what} (padded to {padded}) in (192, 224] has no backward on compute capability {capability}"
    return None


class CudaFlashKernel(CudaOnlyKernel):
    """``aten._scaled_dot_product_flash_attention`` and its backward, on CUDA tensors."""

    name = "cuda_flash"

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        """Why this kernel cannot run such inputs (``None``: it can)."""
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        if torch.version.hip:
            return "PyTorch's flash kernel on ROCm has other limits; not offered there"
        if dtype not in DTYPES:
            return f"FlashAttention supports {[str(d) for d in DTYPES]}, not {dtype}"
        available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if not available():
            return "this PyTorch build has no flash attention kernel"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return f"FlashAttention needs compute capability >= 8.0 (Ampere), got {major}.{minor}"
        if head_dim is not None:
            return _refused_width(round_up(head_dim, HEAD_DIM_MULTIPLE), (major, minor), f"head_dim {head_dim}")
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        dim = q.shape[-1]
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded) for t in (q, k, v))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale
        )
        return out.transpose(1, 2)[..., :dim], lse

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
        dim = q.shape[-1]
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        # The delta column must fit the kernel's head dims too (at 192 on sm86/89/120 it does not).
        if lse_grad and _refused_width(round_up(dim + 1, HEAD_DIM_MULTIPLE), _capability(q.device), "delta column"):
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale)
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        no_rng = torch.empty((), device=q.device, dtype=torch.int64)  # read only with dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.float().contiguous(),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
        return dq.transpose(1, 2)[..., :dim], dk.transpose(1, 2)[..., :dim], dv.transpose(1, 2)[..., :dim]
