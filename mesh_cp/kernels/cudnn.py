"""CUDA kernel through PyTorch's cuDNN attention (fp16/bf16, sm80+; the fastest of ATen's kernels on sm90/sm100).

Note [cuDNN attention ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``aten._scaled_dot_product_cudnn_attention`` and its ``_backward`` (schemas of torch 2.11 and 2.13, the same)::

    (query, key, value, attn_bias, compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False,
     *, scale=None)
        -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
    (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
     max_q, max_k, dropout_p, is_causal, *, scale=None) -> (grad_query, grad_key, grad_value)

read from PyTorch's ``attention.cu`` / ``attention_backward.cu`` (``_cudnn_attention_backward``), ``cudnn/MHA.cpp``
and ``sdp_utils.cpp`` (``check_cudnn_tensor_shapes``, ``check_cudnn_layout``, ``check_prefer_cudnn_attention``),
and run on an H200 with torch 2.11.0+cu130 (cuDNN 9.19). What this kernel relies on:

- Tensors are ``(B, H, S, D)`` views of contiguous ``(B, S, H, D)`` tensors (the layout ``check_cudnn_layout``
  accepts), and ``out``, ``grad_out`` of the backward have that layout too: the backward's graph is cached by the
  shapes and strides of ``q, k, v`` only, so every call of one key must bring the same layouts of the rest. K and
  V keep their own heads (Note [cuDNN native GQA]).
- The head dim is padded with zeros to a multiple of 8 and is at most 128 (cuDNN's limit on every GPU; 256 needs
  sm90/sm100, cuDNN > 9.22 and a new enough cuDNN frontend, which Python cannot see). With a gradient on the lse
  at head dim 128 the delta column does not fit: backward by parts (Note [Gradient of the lse] in
  :mod:`mesh_cp.kernels.base`).
- ``logsumexp`` comes back fp32, ``(B, H, Sq, 1)`` (torch 2.11 on the GPU and the meta function of torch 2.13);
  earlier ops returned ``(B, H, Sq)`` and their backward unsqueezed it. The backward is given the rank the forward
  returns in this PyTorch, read from the op's meta function, and a forward that returns another rank raises.
- ``is_causal`` is cuDNN's causal mask, top-left aligned; mesh_cp asks for it on square blocks only, where every
  alignment agrees. The backward forms ``rowsum(dO * out)`` itself (cuDNN's dO-O dot product), so ``out`` comes
  from :func:`~mesh_cp.kernels.base.fused_backward_inputs`. Dropout is off, so the philox tensors are never read.
- cuDNN takes no key sequence of length 1 (``check_cudnn_tensor_shapes``); a block with fewer than 2 keys or no
  query runs on the reference kernel (a few rows of work, exact).
- cuDNN before 9.15.1 fails on sequence lengths not divisible by 128 (pytorch/pytorch#169849, why PyTorch
  prefers cuDNN only from 9.15.1): this kernel needs cuDNN >= 9.15.1, as block lengths are arbitrary here.
- The backward takes no determinism flag: under ``torch.use_deterministic_algorithms(True)`` PyTorch's op only
  warns (with ``warn_only``) that cuDNN's backward is not deterministic; ``flash_attn`` follows the flag.

Note [cuDNN native GQA]
~~~~~~~~~~~~~~~~~~~~~~~
The op pair takes K and V with fewer heads than Q (``Hq % Hkv == 0``) and the backward returns ``dk, dv`` with
``Hkv`` heads, the sum over each group; read from PyTorch's ``aten/src/ATen/native/cudnn/MHA.cpp`` (``build_graph``
and ``build_graph_backward`` declare the cuDNN graph's K, V, dK and dV with the tensors' own ``sizes()`` and
strides, and the graph cache key holds K's and V's dims apart from Q's), ``transformers/cuda/
attention_backward.cu`` (``_cudnn_attention_backward``: ``dk = at::empty_like(key)``, ``dv =
at::empty_like(value)``), ``transformers/cuda/sdp_utils.cpp`` (``can_use_cudnn_attention``'s dense constraints:
``check_batch_size_and_num_heads_dense<supports_gqa=true, requires_same_num_heads=false>``, pytorch/pytorch#150337:
"cuDNN attention doesn't require key and value tensors to have the same number of heads"), at main commits of
2025 (``MHA.cpp`` 02a4a0f, ``attention_backward.cu`` 00afd8f, ``sdp_utils.cpp`` 001f694); from torch 2.13's meta
functions (``torch/_meta_registrations.py``: the backward's ``grad_k = torch.empty_like(key)``); and from
pytorch/pytorch#139586 (2024-11, a maintainer of the op: "we do not reject nheads being different as long as they
are valid factors"). No 2.11 or 2.12 source was at hand, so the native call is gated on the PyTorch this kernel was
run with on a GPU and later ones (:data:`NATIVE_GQA_TORCH`, 2.11, whose schemas are 2.13's); an older PyTorch gets
the heads expanded here and the gradients summed back, as before. Not yet run on a GPU with GQA unexpanded.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from mesh_cp.core.numerics import expand_kv, fold_kv_grad
from mesh_cp.kernels.base import (
    Capabilities,
    CudaOnlyKernel,
    backward_by_parts,
    fused_backward_inputs,
    pad_head_dim,
    round_up,
)
from mesh_cp.kernels.reference import ReferenceKernel

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128
MIN_CUDNN = 91501
"""cuDNN 9.15.1, as ``torch.backends.cudnn.version()`` reports it (``major * 10000 + minor * 100 + patch``)."""
OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")
NATIVE_GQA_TORCH = "2.11.0.dev0"
"""The oldest PyTorch whose cuDNN op pair this kernel calls with K and V of their own heads (Note [cuDNN native
GQA])."""
_REFERENCE = ReferenceKernel()


def _version_text(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


@functools.cache
def stats_rank() -> int:
    """The rank of the ``logsumexp`` the forward op returns in this PyTorch (3 or 4), from its meta function; the
    backward op takes the forward's. ``RuntimeError`` when the meta function cannot tell."""
    q = torch.empty(1, 1, 16, 8, device="meta", dtype=torch.float16)
    try:
        lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False)[1]
    except (NotImplementedError, RuntimeError) as err:
        raise RuntimeError(f"torch {torch.__version__}: the cuDNN attention op has no usable meta function") from err
    if lse.shape not in ((1, 1, 16), (1, 1, 16, 1)):
        raise RuntimeError(f"torch {torch.__version__}: the cuDNN attention op's logsumexp is {tuple(lse.shape)}")
    return lse.dim()


@functools.cache
def native_gqa() -> bool:
    """Whether K and V go to the op with their own heads in this PyTorch (Note [cuDNN native GQA])."""
    return TorchVersion(torch.__version__) >= NATIVE_GQA_TORCH


def _kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """``k, v`` as the op gets them: unchanged with native GQA, else expanded to ``heads``."""
    return (k, v) if native_gqa() else (expand_kv(k, heads), expand_kv(v, heads))


def _bhsd(x: Tensor) -> Tensor:
    """``x (B, S, H, D)`` as the op takes it: a ``(B, H, S, D)`` view of a contiguous ``(B, S, H, D)`` tensor."""
    return x.contiguous().transpose(1, 2)


def _tiny(q: Tensor, k: Tensor) -> bool:
    """A block cuDNN does not take: fewer than 2 keys, or no query."""
    return k.shape[1] < 2 or q.shape[1] == 0


class CudnnKernel(CudaOnlyKernel):
    """``aten._scaled_dot_product_cudnn_attention`` and its backward, on CUDA tensors (Note [cuDNN attention ops])."""

    name = "cuda_cudnn"
    capabilities = Capabilities(
        devices=("cuda",),
        dtypes=DTYPES,
        head_dim_multiple=HEAD_DIM_MULTIPLE,
        max_head_dim=MAX_HEAD_DIM,
        dq_in_input_dtype=True,
    )
    """No optional keyword: masked tiles go to the reference kernel; a softcap with this kernel named is refused."""

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, ROCm, a PyTorch
        without the ops, without cuDNN or with a cuDNN below 9.15.1, and on a CUDA device a compute capability
        below 8.0."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        if torch.version.hip:
            return (*reasons, "cuDNN attention is not offered on ROCm")
        missing = [op for op in OPS if not hasattr(torch.ops.aten, op)]
        if missing:
            return (
                *reasons,
                f"torch {torch.__version__} has no aten.{' or aten.'.join(missing)}; use kernel='cuda_flash'",
            )
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if not version:
            reasons.append("this PyTorch build has no cuDNN")
        elif version < MIN_CUDNN:
            reasons.append(
                f"cuDNN attention needs cuDNN >= {_version_text(MIN_CUDNN)} (older ones fail on sequence lengths not "
                f"divisible by 128, pytorch/pytorch#169849); this PyTorch has {_version_text(version)}"
            )
        try:
            stats_rank()
        except RuntimeError as err:
            reasons.append(str(err))
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 0):
                reasons.append(f"cuDNN attention needs compute capability >= 8.0 (Ampere), got {major}.{minor}")
        return tuple(reasons)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if _tiny(q, k):
            return _REFERENCE.forward(q, k, v, causal=causal, scale=scale)
        batch, rows, heads, dim = q.shape
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (_bhsd(pad_head_dim(t, padded)) for t in (q, *_kv(k, v, heads)))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        if lse.dim() != stats_rank() or lse.numel() != batch * heads * rows:
            raise RuntimeError(
                f"torch {torch.__version__}: cuDNN attention returned a logsumexp of shape {tuple(lse.shape)} for "
                f"{batch} x {heads} heads x {rows} rows, not what its meta function says (rank {stats_rank()}); "
                f"use kernel='cuda_flash'"
            )
        return out.transpose(1, 2)[..., :dim], lse.reshape(batch, heads, rows).float()

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
        if _tiny(q, k):
            return _REFERENCE.backward(do, q, k, v, lse, delta, causal=causal, scale=scale)
        batch, rows, heads, dim = q.shape
        if lse_grad and round_up(dim + 1, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM:
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale)
        kv_heads, keys = k.shape[2], k.shape[1]
        k, v = _kv(k, v, heads)
        # The op forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        stats = lse.float().reshape(batch, heads, rows, *((1,) if stats_rank() == 4 else ())).contiguous()
        unused = torch.empty((), device=q.device, dtype=torch.int64)  # philox seed and offset: read with dropout only
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(do),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            stats,
            unused,
            unused,
            None,
            None,
            None,
            rows,
            keys,
            0.0,
            causal,
            scale=scale,
        )
        return (
            dq.transpose(1, 2)[..., :dim],
            fold_kv_grad(dk.transpose(1, 2)[..., :dim], kv_heads),
            fold_kv_grad(dv.transpose(1, 2)[..., :dim], kv_heads),
        )
