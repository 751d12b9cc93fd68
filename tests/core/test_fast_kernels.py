"""The Hopper-first CUDA kernels on CPU: ``cuda_cudnn`` (PyTorch's cuDNN attention) and ``flash_attn3``
(flash-attn 3's ``flash_attn_interface``).

- ``cuda_cudnn``: on ``meta`` tensors through the ops' real meta functions, and numerically under a dispatch mode
  that implements the op pair on CPU, reading every argument by its schema name and asserting what the kernel
  relies on (Note [cuDNN attention ops]: the ``(B, S, H, D)``-contiguous layout of q, k, v, out and grad_out, K and
  V heads that divide the query heads and gradients of K's and V's own heads (Note [cuDNN native GQA]), head dims
  that are multiples of 8 up to 128, the ``(B, H, S, 1)`` fp32 logsumexp, at least 2 keys).
- ``flash_attn3``: fakes of ``flash_attn_interface`` with the exact signatures of flash-attention's
  ``hopper/flash_attn_interface.py`` at commits 7a80279 (2025-01), 909eb7c (2025-04) and the custom ops merged
  2025-11-17 (Note [flash-attn 3 API]), asserting what the C++ asserts and forming ``rowsum(dO * out)`` as the
  real backward does; the 2024 form and unknown parameters are refused.
- ``kernel="auto"`` and the refusal reasons on emulated GPUs and installs.
"""

import logging
import re
import sys
import types

import pytest
import torch

import mesh_cp.kernels as kernels
from mesh_cp.kernels import cudnn
from mesh_cp.kernels.base import round_up
from mesh_cp.kernels.cudnn import CudnnKernel
from mesh_cp.kernels.flash_attn3 import FlashAttn3Kernel
from mesh_cp.kernels.reference import ReferenceKernel
from tests.core.test_kernel_emulation import (
    CUDA0,
    EmulatedCudaAttention,
    assert_meta_shapes,
    emulate_cuda,
    install_flash_attn,
)
from tests.core.test_kernels import check_block_kernel, lse_grad_case

REF = ReferenceKernel()
LOW = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_choices():
    kernels.forget_choices()
    yield
    kernels.forget_choices()


# --- cuDNN: the ATen op pair on CPU ----------------------------------------------------------------


def _check_layout(*tensors) -> None:
    """``check_cudnn_layout``: ``(B, H, S, D)`` views of contiguous ``(B, S, H, D)`` tensors."""
    for t in tensors:
        b, h, s, d = t.shape
        assert t.stride() == (s * h * d, d, h * d, 1), (t.shape, t.stride())


def _check_heads(query, key, value) -> None:
    """``check_grouped_query_attention`` without ``requires_same_num_heads`` (sdp_utils): K's and V's heads each
    divide the query heads."""
    hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
    assert hq % hk == 0 and hq % hv == 0, f"query heads {hq} are not a multiple of key heads {hk} / value heads {hv}"


def _cudnn_fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, scale):
    assert query.dtype in LOW and query.dtype == key.dtype == value.dtype
    _check_heads(query, key, value)
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 128, "head_dim a multiple of 8, at most 128"
    assert key.shape[2] >= 2, "cudnn SDPA does not support key/value sequence length 1"
    assert not is_causal or query.shape[2] == key.shape[2], "causal only on square blocks"
    assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0 and return_debug_mask is False
    _check_layout(query, key, value)
    out, lse = REF.forward(*(t.transpose(1, 2) for t in (query, key, value)), causal=is_causal, scale=scale)
    seed = torch.empty((), dtype=torch.int64)
    lse = lse.float().unsqueeze(-1).contiguous()  # (B, H, S, 1), as the op returns it
    return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], seed, seed.clone(), None


def _cudnn_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    scale,
):
    assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (query.shape[2], key.shape[2]) and key.shape[2] >= 2
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 128
    _check_heads(query, key, value)
    assert grad_out.shape == out.shape == (*query.shape[:3], value.shape[-1])
    _check_layout(grad_out, query, key, value, out)
    b, h, s, _ = query.shape
    assert logsumexp.shape == (b, h, s, 1) and logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)  # cuDNN forms rowsum(dO * O) itself
    bshd = [t.transpose(1, 2) for t in (grad_out, query, key, value)]
    grads = REF.backward(*bshd, logsumexp[..., 0], delta, causal=is_causal, scale=scale)
    grads = tuple(g.to(query.dtype).transpose(1, 2) for g in grads)  # empty_like(query / key / value): their layout
    assert [g.shape for g in grads] == [query.shape, key.shape, value.shape]  # dk, dv of K's and V's own heads
    return grads


class EmulatedCudnn(EmulatedCudaAttention):
    """The CUDA attention ops of :class:`EmulatedCudaAttention` and cuDNN's pair, on CPU."""

    IMPLS = {
        **EmulatedCudaAttention.IMPLS,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default: _cudnn_fwd,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_bwd,
    }

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[tuple[int, int, int]] = []
        """``(query, key, value)`` heads of every cuDNN op call."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__ in CUDNN_OPS:
            bound = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | (kwargs or {})
            self.heads.append(tuple(bound[name].shape[1] for name in ("query", "key", "value")))
        return super().__torch_dispatch__(func, types, args, kwargs)


CUDNN_OPS = {"_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_cudnn_attention_backward.default"}


@pytest.mark.parametrize("head_dim", [64, 72, 100, 128])
def test_cudnn_on_meta_tensors(head_dim: int) -> None:
    """Shapes and dtypes through the ops' real meta functions (which also check the schemas)."""
    assert cudnn.stats_rank() == 4  # torch 2.13's meta function: logsumexp (B, H, S, 1)
    assert_meta_shapes(CudnnKernel.without_device_check(), LOW, head_dim)


@pytest.mark.parametrize("head_dim", [64, 72, 100, 128])
def test_cudnn_is_exact_on_emulated_ops(head_dim: int) -> None:
    """Forward, backward and the lse-gradient backward (a delta column, or by parts at 128), MHA and GQA."""
    kernel = CudnnKernel.without_device_check()
    with EmulatedCudnn() as mode:
        for dtype, causal in ((torch.bfloat16, False), (torch.float16, True)):
            for lse_only in (False, True):
                case = lse_grad_case(8, 2, head_dim, seed=head_dim + lse_only, lse_only=lse_only)
                check_block_kernel(kernel, dtype, causal, case, lse_grad=True)
            check_block_kernel(
                kernel, dtype, causal, lse_grad_case(4, 4, head_dim, seed=1, lse_only=False), lse_grad=False
            )
    assert CUDNN_OPS <= set(mode.ran)
    widths = {shape[-1] for shape in mode.backward_widths}
    # The delta column at round_up(D + 1, 8); at 128 it does not fit and the backward goes by parts, at 128.
    assert widths == ({128} if head_dim == 128 else {round_up(head_dim + 1, 8), round_up(head_dim, 8)}), widths


@pytest.mark.parametrize("native", [True, False])
def test_cudnn_calls_the_op_with_kv_heads_of_their_own(monkeypatch, native: bool) -> None:
    """GQA (8 query heads, 2 K/V heads) goes to the op unexpanded and its dk, dv come back with 2 heads (Note [cuDNN
    native GQA]); a PyTorch before :data:`~mesh_cp.kernels.cudnn.NATIVE_GQA_TORCH` gets the heads expanded."""
    assert cudnn.native_gqa()  # torch 2.13 here
    monkeypatch.setattr(cudnn, "native_gqa", lambda: native)
    kernel = CudnnKernel.without_device_check()
    with EmulatedCudnn() as mode:
        check_block_kernel(kernel, torch.bfloat16, True, lse_grad_case(8, 2, 64, seed=5, lse_only=False))
        check_block_kernel(kernel, torch.float16, False, lse_grad_case(8, 2, 128, seed=6, lse_only=False))
    assert CUDNN_OPS <= set(mode.ran)
    assert set(mode.heads) == ({(8, 2, 2)} if native else {(8, 8, 8)}), mode.heads


def test_cudnn_blocks_of_one_key_run_on_the_reference_kernel() -> None:
    kernel = CudnnKernel.without_device_check()
    q, k, v, do, dlse = lse_grad_case(4, 2, 64, seed=7, lse_only=False)
    case = (q, k[:, :1], v[:, :1], do, dlse)
    with EmulatedCudnn() as mode:
        check_block_kernel(kernel, torch.bfloat16, False, case, lse_grad=True)
    assert not CUDNN_OPS & set(mode.ran)


def test_cudnn_refuses_a_logsumexp_of_another_rank_than_its_meta_function(monkeypatch) -> None:
    """An op whose forward and meta function disagree on the lse: the forward raises, the backward is never fed a
    guessed layout."""
    monkeypatch.setattr(cudnn, "stats_rank", lambda: 3)
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with EmulatedCudnn(), pytest.raises(RuntimeError, match=r"logsumexp of shape \(1, 2, 16, 1\) .*\(rank 3\)"):
        CudnnKernel.without_device_check().forward(q, q, q, causal=True, scale=0.1)


def emulate_cudnn(monkeypatch, version: int | None = 91900) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: version is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)


def test_cudnn_reasons(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (9, 0))
    emulate_cudnn(monkeypatch)
    why = CudnnKernel.not_supported_reasons
    assert why(CUDA0, torch.bfloat16, 128) == ()
    assert why(CUDA0, torch.float32, 136) == (
        "dtype torch.float32 is not one of ['torch.float16', 'torch.bfloat16']",
        "head_dim 136 > 128",
    )
    assert why(CUDA0, torch.float16, 121) == ()  # padded to 128
    assert why(CUDA0, torch.float16, 129) == ("head_dim 129 (padded to 136) > 128",)
    emulate_cudnn(monkeypatch, 91002)
    assert why(CUDA0, torch.float16, 64) == (
        "cuDNN attention needs cuDNN >= 9.15.1 (older ones fail on sequence lengths not divisible by 128, "
        "pytorch/pytorch#169849); this PyTorch has 9.10.2",
    )
    emulate_cudnn(monkeypatch, None)
    assert why(CUDA0, torch.float16, 64) == ("this PyTorch build has no cuDNN",)
    emulate_cudnn(monkeypatch)
    emulate_cuda(monkeypatch, (7, 5))
    assert why(CUDA0, torch.float16, 64) == ("cuDNN attention needs compute capability >= 8.0 (Ampere), got 7.5",)
    monkeypatch.setattr(cudnn, "OPS", (*cudnn.OPS, "_no_such_cudnn_op"))
    assert why(CUDA0, torch.float16, 64)[-1] == (
        f"torch {torch.__version__} has no aten._no_such_cudnn_op; use kernel='cuda_flash'"
    )
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert why(CUDA0, torch.float16, 64)[-1] == "cuDNN attention is not offered on ROCm"
    assert why(torch.device("cpu"), torch.float16, 64)[0] == "needs CUDA tensors, got cpu"


# --- flash-attn 3: fakes of flash_attn_interface ------------------------------------------------------------


def _fa3_check_qkv(q, k, v) -> None:
    """What mha_fwd / mha_bwd check (hopper/flash_api.cpp)."""
    assert q.dtype in LOW and k.dtype == q.dtype == v.dtype
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension"
    assert q.shape[-1] % 8 == 0, "head_size should be a multiple of 8"
    assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
    assert k.shape == v.shape and q.shape[2] % k.shape[2] == 0, "Number of heads in key/value must divide"


def _fa3_forward_math(q, k, v, softmax_scale, causal, window, softcap):
    _fa3_check_qkv(q, k, v)
    assert tuple(window) == (-1, -1) and softcap == 0.0 and isinstance(softmax_scale, float)
    assert not causal or q.shape[1] == k.shape[1], "mesh_cp asks for causal on square blocks only"
    out, lse = REF.forward(q, k, v, causal=causal, scale=softmax_scale)
    return out, lse.float()


def _fa3_backward_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window, softcap, det):
    _fa3_check_qkv(q, k, v)
    assert tuple(window) == (-1, -1) and softcap == 0.0 and isinstance(det, bool)
    assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
    assert softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and softmax_lse.dtype == torch.float32
    assert softmax_lse.is_contiguous()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == q.dtype
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # the preprocess kernel's dot(dO, O)
    grads = REF.backward(dout, q, k, v, softmax_lse, delta, causal=causal, scale=softmax_scale)
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(grad)
    return delta.contiguous()


def _absent(**inputs) -> None:
    assert all(t is None for t in inputs.values()), [n for n, t in inputs.items() if t is not None]


def fa3_2501_forward(
    q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, q_descale, k_descale, v_descale,
    softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, rotary_interleaved=True,
    num_splits=1, pack_gqa=None, sm_margin=0,
):  # fmt: skip
    """Commit 7a80279 (2025-01-07): no defaults before ``window_size``; returns ``(out, softmax_lse, *rest)``."""
    _absent(k_new=k_new, v_new=v_new, out=out, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            cu_seqlens_k_new=cu_seqlens_k_new, seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, page_table=page_table, kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k,
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale)  # fmt: skip
    assert (sink_token_length, num_splits, pack_gqa, sm_margin) == (0, 1, None, 0)
    out, lse = _fa3_forward_math(q, k, v, softmax_scale, causal, window_size, softcap)
    return out, lse, torch.empty(0), torch.empty(0)


def fa3_2501_backward(
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, max_seqlen_k,
    dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, deterministic=False,
    sm_margin=0,
):  # fmt: skip
    """Commit 7a80279: returns ``(dq, dk, dv, softmax_d)``, the buffers given."""
    _absent(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sequed_q=sequed_q, sequed_k=sequed_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # fmt: skip
    assert sink_token_length == 0 and sm_margin == 0
    args = (softmax_scale, causal, window_size, softcap, deterministic)
    softmax_d = _fa3_backward_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)
    return dq, dk, dv, softmax_d


def fa3_2504_forward(
    q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale,
    v_descale, softmax_scale, causal, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0,
):  # fmt: skip
    """Commit 909eb7c (2025-04-10): ``qv``, ``seqlens_rotary``, ``attention_chunk``, ``scheduler_metadata``."""
    _absent(k_new=k_new, v_new=v_new, qv=qv, out=out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q, page_table=page_table, rotary_cos=rotary_cos, seqlens_rotary=seqlens_rotary,
            q_descale=q_descale, scheduler_metadata=scheduler_metadata)  # fmt: skip
    assert attention_chunk == 0 and num_splits == 1
    out, lse = _fa3_forward_math(q, k, v, softmax_scale, causal, window_size, softcap)
    return out, lse, torch.empty(0), torch.empty(0)


def _fa3_custom_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, qv: torch.Tensor | None = None, out_: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    page_table: torch.Tensor | None = None, kv_batch_idx: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None, seqlens_rotary: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: torch.Tensor | None = None, num_splits: int = 1,
    pack_gqa: bool | None = None, sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Merged 2025-11-17 (up to the head of flash-attention): a custom op, split window, ``out_`` from 2025-11-21."""
    _absent(k_new=k_new, out_=out_, cu_seqlens_q=cu_seqlens_q, page_table=page_table, q_descale=q_descale)
    out, lse = _fa3_forward_math(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), softcap)
    return out, lse, torch.empty(0), torch.empty(0)


def _fa3_custom_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    sequed_q: torch.Tensor | None = None, sequed_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None, softmax_scale: float | None = None, is_causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Merged 2025-11-17: mutates ``dq, dk, dv`` and returns ``softmax_d`` only; the flag is ``is_causal``."""
    assert dq is not None and dk is not None and dv is not None, "mesh_cp passes the buffers"
    window = (window_size_left, window_size_right)
    args = (softmax_scale, is_causal, window, softcap, deterministic)
    return _fa3_backward_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)


fa3_custom_forward = torch.library.custom_op(
    "mesh_cp_fake_fa3::_flash_attn_forward", mutates_args=(), device_types="cpu"
)(_fa3_custom_forward)
fa3_custom_backward = torch.library.custom_op(
    "mesh_cp_fake_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)(_fa3_custom_backward)


def fa3_2407_forward(q, k, v, softmax_scale, causal):
    """The first release (2024-07): refused."""
    raise AssertionError("never called")


def fa3_2407_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):
    raise AssertionError("never called")


def fa3_unknown_forward(q, k, v, softmax_scale, causal, cu_seqlens_q=None, window_size=(-1, -1), sinks=None):
    """A form with a parameter mesh_cp has not read (``sinks``): refused."""
    raise AssertionError("never called")


FA3_FAKES = {
    "2025-01": (fa3_2501_forward, fa3_2501_backward),
    "2025-04": (fa3_2504_forward, fa3_2501_backward),
    "2025-11+": (fa3_custom_forward, fa3_custom_backward),
    "2024-07": (fa3_2407_forward, fa3_2407_backward),
    "unknown": (fa3_unknown_forward, fa3_2501_backward),
}


def install_flash_attn3(monkeypatch, form: str) -> None:
    """Make ``import flash_attn_interface`` give a fake of the private API of ``form``."""
    interface = types.ModuleType("flash_attn_interface")
    interface._flash_attn_forward, interface._flash_attn_backward = FA3_FAKES[form]
    monkeypatch.setitem(sys.modules, "flash_attn_interface", interface)


@pytest.mark.parametrize("form", ["2025-01", "2025-04", "2025-11+"])
@pytest.mark.parametrize("head_dim", [64, 72, 100, 256])
def test_flash_attn3_is_exact_on_every_accepted_api(monkeypatch, form: str, head_dim: int) -> None:
    """Forward, backward, and the lse-gradient backward (extra column, or by parts at 256), MHA and GQA."""
    install_flash_attn3(monkeypatch, form)
    kernel = FlashAttn3Kernel.without_device_check()
    assert kernel._api.split_window == (form == "2025-11+")
    assert kernel._api.backward_causal == ("is_causal" if form == "2025-11+" else "causal")
    for dtype, causal in ((torch.bfloat16, False), (torch.float16, True)):
        for lse_only in (False, True):
            case = lse_grad_case(8, 2, head_dim, seed=head_dim + lse_only, lse_only=lse_only)
            check_block_kernel(kernel, dtype, causal, case, lse_grad=True)
        check_block_kernel(kernel, dtype, causal, lse_grad_case(4, 4, head_dim, seed=1, lse_only=False), lse_grad=False)


def test_flash_attn3_refuses_other_apis_and_broken_installs(monkeypatch) -> None:
    install_flash_attn3(monkeypatch, "2024-07")
    with pytest.raises(RuntimeError, match=r"_flash_attn_forward takes parameters \['cu_seqlens_q'\]|not the API"):
        FlashAttn3Kernel.without_device_check()
    install_flash_attn3(monkeypatch, "unknown")
    with pytest.raises(RuntimeError, match=r"_flash_attn_forward takes parameters \['sinks'\] that the API mesh_cp"):
        FlashAttn3Kernel.without_device_check()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(RuntimeError, match=r"flash-attn 3 cannot be imported \(ModuleNotFoundError: .*hopper/"):
        FlashAttn3Kernel.without_device_check()


def test_flash_attn3_reasons(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (9, 0))
    install_flash_attn3(monkeypatch, "2025-11+")
    why = FlashAttn3Kernel.not_supported_reasons
    assert why(CUDA0, torch.bfloat16, 256) == ()
    assert why(CUDA0, torch.float32, 257) == (
        "dtype torch.float32 is not one of ['torch.float16', 'torch.bfloat16']",
        "head_dim 257 (padded to 264) > 256",
    )
    emulate_cuda(monkeypatch, (8, 0))
    assert why(CUDA0, torch.bfloat16, 64) == (
        "flash-attn 3 is offered on Hopper (compute capability 9.x) only, got 8.0",
    )
    emulate_cuda(monkeypatch, (9, 0))
    install_flash_attn3(monkeypatch, "2024-07")
    assert "not the API mesh_cp calls" in why(CUDA0, torch.bfloat16, 64)[0]
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert why(CUDA0, torch.bfloat16, 64)[0] == "flash-attn 3 on ROCm is another implementation; not offered there"


# --- kernel="auto" on emulated machines ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "fa3", "cudnn_version", "head_dim", "chosen", "logged"),
    [
        (
            (9, 0),
            "2025-11+",
            91900,
            128,
            "flash_attn3",
            r"chose 'flash_attn3' for torch\.bfloat16 head_dim 128 on cuda:0$",
        ),
        ((9, 0), None, 91900, 128, "cuda_cudnn", r"\(flash_attn3: flash-attn 3 cannot be imported \(ModuleNotFound"),
        ((9, 0), None, 91900, 192, "flash_attn", r"\| cuda_cudnn: head_dim 192 > 128\)$"),
        ((9, 0), None, 91002, 64, "flash_attn", r"cuda_cudnn: cuDNN attention needs cuDNN >= 9\.15\.1 .* has 9\.10\.2"),
        (
            (10, 0),
            "2025-11+",
            91900,
            64,
            "cuda_cudnn",
            r"chose 'cuda_cudnn' for torch\.bfloat16 head_dim 64 on cuda:0$",
        ),
        ((8, 0), "2025-11+", 91900, 64, "flash_attn", r"chose 'flash_attn' for torch\.bfloat16 head_dim 64 on cuda:0$"),
        ((8, 6), None, 91900, 64, "flash_attn", r"chose 'flash_attn'"),
    ],
)
def test_auto_puts_flash_attn3_and_cudnn_first_where_they_run(
    monkeypatch, caplog, capability, fa3, cudnn_version, head_dim, chosen, logged
) -> None:
    """Hopper: flash-attn 3, cuDNN, flash-attn 2, ...; sm100: cuDNN first; Ampere and Ada: as before (cuDNN by name
    only). Every kernel passed over is logged with its reasons."""
    emulate_cuda(monkeypatch, capability)
    emulate_cudnn(monkeypatch, cudnn_version)
    install_flash_attn(monkeypatch, "2.8.3")
    if fa3 is None:
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    else:
        install_flash_attn3(monkeypatch, fa3)
    with caplog.at_level(logging.INFO, logger="mesh_cp"):
        kernel = kernels.resolve_kernel("auto", CUDA0, torch.bfloat16, head_dim)
    assert kernel.name == chosen
    assert kernels.not_supported_reasons(chosen, CUDA0, torch.bfloat16, head_dim) == ()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "mesh_cp"]
    assert message.startswith(f"mesh_cp: kernel 'auto' chose {chosen!r}"), message
    assert re.search(logged, message), message


def test_auto_never_chooses_a_kernel_with_reasons(monkeypatch) -> None:
    for capability in ((7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        for fa3 in (None, "2025-01", "2024-07"):
            for version in (None, 90100, 91900):
                with monkeypatch.context() as mp:
                    emulate_cuda(mp, capability)
                    emulate_cudnn(mp, version)
                    mp.setitem(sys.modules, "flash_attn", None)
                    if fa3 is None:
                        mp.setitem(sys.modules, "flash_attn_interface", None)
                    else:
                        install_flash_attn3(mp, fa3)
                    kernels.forget_choices()
                    for dtype in (torch.float16, torch.bfloat16, torch.float32):
                        for head_dim in (64, 128, 200, 256, 320):
                            name, _ = kernels.choose(CUDA0, dtype, head_dim)
                            assert kernels.not_supported_reasons(name, CUDA0, dtype, head_dim) == (), name


def test_named_fast_kernels_that_cannot_run_say_why(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (8, 0))
    emulate_cudnn(monkeypatch, 91900)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(NotImplementedError, match=r"'flash_attn3' cannot run .*: flash-attn 3 is offered on Hopper"):
        kernels.resolve_kernel("flash_attn3", CUDA0, torch.bfloat16, 64)
    with pytest.raises(NotImplementedError, match=r"'cuda_cudnn' cannot run torch\.bfloat16 head_dim 256 .*: head_dim"):
        kernels.resolve_kernel("cuda_cudnn", CUDA0, torch.bfloat16, 256)
    assert kernels.resolve_kernel("cuda_cudnn", CUDA0, torch.bfloat16, 128).name == "cuda_cudnn"
    assert "cuda_cudnn" not in kernels.candidates(CUDA0, torch.bfloat16)  # by name only on sm80


# --- on a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("name", ["cuda_cudnn", "flash_attn3"])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_kernels_on_this_gpu(name: str, causal: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    why = kernels.not_supported_reasons(name, device, torch.bfloat16, 72)
    if why:
        pytest.skip("; ".join(why))
    for lse_only in (True, False):
        case = [t.cuda() for t in lse_grad_case(8, 2, 72, seed=5, lse_only=lse_only)]
        check_block_kernel(kernels.get_kernel(name), torch.bfloat16, causal, case)
    case = [t.cuda() for t in lse_grad_case(4, 4, 128, seed=6, lse_only=False)]
    check_block_kernel(kernels.get_kernel(name), torch.float16, causal, case)


@pytest.mark.parametrize("flash_attn", [None, "2.8.3"])
def test_auto_for_a_masked_or_softcapped_call_takes_a_kernel_that_takes_it(monkeypatch, caplog, flash_attn) -> None:
    """On Hopper with cuDNN and flash-attn 3 installed, a masked call gets the first kernel that takes masks or
    segments (flash-attn 2, else PyTorch's flash kernel), not one whose masked tiles would go to the reference kernel;
    the kernels passed over are logged with what they lack. A softcap that no fast kernel takes (no flash-attn) gets the
    reference kernel, which is where a kernel that does not softcap would run every block."""
    emulate_cuda(monkeypatch, (9, 0))
    emulate_cudnn(monkeypatch, 91900)
    install_flash_attn3(monkeypatch, "2025-11+")
    if flash_attn is None:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    else:
        install_flash_attn(monkeypatch, flash_attn)
    kernels.forget_choices()
    assert kernels.resolve_kernel("auto", CUDA0, torch.bfloat16, 128).name == "flash_attn3"
    with caplog.at_level(logging.INFO, logger="mesh_cp"):
        masked = kernels.resolve_kernel("auto", CUDA0, torch.bfloat16, 128, needs=("mask|segments",))
    assert masked.name == ("cuda_flash" if flash_attn is None else "flash_attn")
    assert kernels.takes(masked, "segments")
    message = caplog.records[-1].getMessage()
    assert "taking mask|segments" in message and "flash_attn3: takes no mask or segments" in message, message
    softcap = kernels.resolve_kernel("auto", CUDA0, torch.bfloat16, 128, needs=("softcap",))
    if flash_attn is None:  # no fast kernel softcaps: every block would run on the reference kernel anyway
        assert softcap.name == "reference"
    else:
        assert kernels.takes(softcap, "softcap") and softcap.name == "flash_attn"
