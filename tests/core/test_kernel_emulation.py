"""The CUDA kernels on CPU: emulated flash-attn releases, emulated ATen CUDA ops, meta tensors, and the
``"auto"`` choice on emulated machines.

- flash-attn 2.6.3, 2.7.x and 2.8.x: fakes of ``flash_attn_interface._flash_attn_forward`` /
  ``_flash_attn_backward`` and ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` with the
  releases' exact signatures and return tuples (2.8's as ``torch.library.custom_op`` s, as shipped),
  asserting what their C++ asserts (fp16/bf16, contiguous last dim, ``head_dim % 8 == 0`` and ``<= 256``
  where the release requires it, int32 ``cu_seqlens``, the ``(H, total_q)`` fp32 varlen lse), computing
  with the reference math (softcap as ``softcap * tanh(s * scale / softcap)``, varlen windows as the C++
  makes them: :func:`flash_window`) and forming ``delta = rowsum(dO * out)`` themselves as the real
  kernels do. They are installed as ``sys.modules["flash_attn"]`` and drive :class:`FlashAttnKernel`.
- ``cuda_flash`` and ``cuda_sdpa``: on ``meta`` tensors through the ops' real meta functions
  (shapes, dtypes, schema), and numerically under a dispatch mode that implements the CUDA op pairs
  (``cuda_flash``'s dense and varlen ones, ``cuda_sdpa``'s) on CPU, reading every argument by its schema
  name (so a swapped argument changes the result).
- ``kernel="auto"`` with monkeypatched CUDA availability, compute capability and flash-attn installs.
"""

import importlib.abc
import importlib.machinery
import logging
import math
import re
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mesh_cp.kernels as kernels
from mesh_cp.kernels.cuda_flash import CudaFlashKernel
from mesh_cp.kernels.cuda_sdpa import CudaSdpaKernel
from mesh_cp.kernels.flash_attn import FlashAttnKernel
from mesh_cp.kernels.reference import ReferenceKernel
from tests.core.test_kernels import check_block_kernel, lse_grad_case

REF = ReferenceKernel()
LOW = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_choices():
    kernels.forget_choices()
    yield
    kernels.forget_choices()


# --- flash-attn fakes ---------------------------------------------------------------------------


def _check_qkv(q, k, v, *, multiple_of_8: bool) -> None:
    assert q.dtype in LOW, "FlashAttention only support fp16 and bf16 data type"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype"
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension"
    assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
    if multiple_of_8:
        assert q.shape[-1] % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8"
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[2] % k.shape[2] == 0


def _check_plain(dropout_p, softcap, alibi_slopes) -> None:
    assert dropout_p == 0.0 and alibi_slopes is None
    assert isinstance(softcap, float) and softcap >= 0.0, softcap  # 0.0: off


def _cap(softcap: float) -> float | None:
    """The reference kernel's softcap for flash-attn's (``0.0``: off)."""
    return softcap if softcap > 0 else None


def _forward_math(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap):
    assert (window_size_left, window_size_right) == (-1, -1)
    out, lse = REF.forward(q, k, v, causal=causal, scale=softmax_scale, softcap=_cap(softcap))
    return out, lse.float()


def _backward_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window, deterministic, softcap):
    """flash-attn's mha_bwd: padded head dims, delta formed from dout and out, grads into dq, dk, dv."""
    _check_qkv(q, k, v, multiple_of_8=True)  # "head_size should be a multiple of 8"
    assert window == (-1, -1) and isinstance(deterministic, bool)
    batch, rows, heads, _ = q.shape
    assert out.shape == q.shape and dout.shape == q.shape and out.dtype == q.dtype == dout.dtype
    assert softmax_lse.shape == (batch, heads, rows) and softmax_lse.dtype == torch.float32
    assert softmax_lse.is_contiguous()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == q.dtype
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    grads = REF.backward(dout, q, k, v, softmax_lse, delta, causal=causal, scale=softmax_scale, softcap=_cap(softcap))
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(grad)
    return delta.contiguous()


# --- varlen: flash-attn's and ATen's, one math -------------------------------------------------------------


def flash_window(sq: int, sk: int, max_seqlen_k: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """``(sq, sk)`` boolean: the keys each query of one varlen sequence sees, as the C++ makes them of ``causal``
    and ``window_size`` (``mha_varlen_fwd/bwd`` clamp against ``max_seqlen_k``, ``set_params_fprop`` turns a
    negative side beside a non-negative one into ``seqlen_k``, ``mask.h`` bounds ``j`` by
    ``i + sk - sq - left .. i + sk - sq + right``); the same in 2.6.3 to 2.8.3 and PyTorch's copy."""
    if causal:
        right = 0
    left, right = (-1 if side >= max_seqlen_k else side for side in (left, right))
    if left < 0 and right < 0:
        return torch.ones(sq, sk, dtype=torch.bool)
    left, right = (max_seqlen_k if side < 0 else side for side in (left, right))
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    return (j >= i + sk - sq - left) & (j <= i + sk - sq + right)


def _check_varlen_qkv(q, k, v, *, multiple_of_8: bool) -> None:
    assert q.dim() == k.dim() == v.dim() == 3, "varlen tensors are (total, heads, head_dim)"
    assert q.dtype in LOW, "FlashAttention only support fp16 and bf16 data type"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype"
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension"
    assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
    if multiple_of_8:
        assert q.shape[-1] % 8 == 0, "head_size must be a multiple of 8"
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1]
    assert q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query"


def _sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k) -> list:
    """``[(q0, q1, k0, k1)]`` of the sequences, asserting the C++ checks and that the grids cover them."""
    bounds = []
    for cu, total, most in ((cu_seqlens_q, total_q, max_seqlen_q), (cu_seqlens_k, total_k, max_seqlen_k)):
        assert cu.dtype == torch.int32, "cu_seqlens must have dtype int32"
        assert cu.dim() == 1 and cu.is_contiguous() and cu.numel() >= 2, "batch size must be positive"
        values = cu.tolist()
        assert values[0] == 0 and values[-1] == total, (values, total)
        lengths = [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
        assert min(lengths) >= 0 and max(lengths) <= most, (lengths, most)  # max_seqlen sizes the grids
        bounds.append(values)
    assert len(bounds[0]) == len(bounds[1]), "CHECK_SHAPE(cu_seqlens_k, batch_size + 1)"
    (cq, ck) = bounds
    return [(cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]


def varlen_forward_math(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
    """``out (total_q, H, D)`` and ``lse (H, total_q)`` fp32 of the varlen forward, sequence by sequence; a query
    that sees no key gets ``out = 0`` and ``lse = +inf`` (``softmax.h``)."""
    out, lse = torch.zeros_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for a, b, c, d in _sequences(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
        mask = flash_window(b - a, d - c, max_k, causal, *window)
        rows = (q[None, a:b], k[None, c:d], v[None, c:d])
        o, l_ = REF.forward(*rows, causal=False, scale=scale, mask=mask, softcap=_cap(softcap))
        out[a:b], lse[:, a:b] = o[0], l_[0].float().masked_fill(torch.isneginf(l_[0]), float("inf"))
    return out, lse


def varlen_backward_math(dout, q, k, v, out, lse, grads, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
    """mha_varlen_bwd: grads into ``grads = (dq, dk, dv)``, delta formed from dout and out; returns
    ``softmax_d (H, total_q + 128 * batch)``."""
    _check_varlen_qkv(q, k, v, multiple_of_8=True)  # "head_size should be a multiple of 8"
    assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == q.dtype for g in grads)
    delta = (dout.float() * out.float()).sum(-1).T
    sequences = _sequences(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    softmax_d = torch.zeros(q.shape[1], q.shape[0] + 128 * len(sequences))
    for n, (a, b, c, d) in enumerate(sequences):
        mask = flash_window(b - a, d - c, max_k, causal, *window)
        tensors = (dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], lse[None, :, a:b], delta[None, :, a:b])
        seq_grads = REF.backward(*tensors, causal=False, scale=scale, mask=mask, softcap=_cap(softcap))
        for buf, grad, (lo, hi) in zip(grads, seq_grads, ((a, b), (c, d), (c, d)), strict=True):
            buf[lo:hi] = grad[0]
        softmax_d[:, a + 128 * n : b + 128 * n] = delta[:, a:b]
    return softmax_d


def _round8(x: int) -> int:
    return -(-x // 8) * 8


def fa263_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    _check_qkv(q, k, v, multiple_of_8=False)  # 2.6.3 pads in C++
    _check_plain(dropout_p, softcap, alibi_slopes)
    assert return_softmax is False
    dim = q.shape[-1]
    q_p, k_p, v_p = (torch.nn.functional.pad(t, (0, _round8(dim) - dim)) for t in (q, k, v))
    out_padded, lse = _forward_math(q_p, k_p, v_p, softmax_scale, causal, *window_size, softcap)
    rng_state = torch.empty(2, dtype=torch.int64)
    return out_padded[..., :dim], q_p, k_p, v_p, out_padded, lse, torch.empty(0, dtype=q.dtype), rng_state


def fa263_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _check_plain(dropout_p, softcap, alibi_slopes)
    assert q.shape[-1] == _round8(dout.shape[-1]), "head_size must be head_size_og rounded to a multiple of 8"
    dout = torch.nn.functional.pad(dout, (0, q.shape[-1] - dout.shape[-1]))  # 2.6.3 pads dout in C++
    softmax_d = _backward_math(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, tuple(window_size), deterministic, softcap
    )
    return dq, dk, dv, softmax_d


def fa27_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_qkv(q, k, v, multiple_of_8=True)
    _check_plain(dropout_p, softcap, alibi_slopes)
    assert return_softmax is False
    out, lse = _forward_math(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)


def fa27_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_plain(dropout_p, softcap, alibi_slopes)
    window = (window_size_left, window_size_right)
    return _backward_math(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window, deterministic, softcap
    )


def _check_varlen_plain(return_softmax, block_table, leftpad_k, seqused_k) -> None:
    assert return_softmax is False and block_table is None and leftpad_k is None and seqused_k is None


def fa263_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
):
    _check_varlen_qkv(q, k, v, multiple_of_8=False)  # 2.6.3 pads in C++
    _check_plain(dropout_p, softcap, alibi_slopes)
    _check_varlen_plain(return_softmax, block_table, leftpad_k, seqused_k)
    dim = q.shape[-1]
    q_p, k_p, v_p = (torch.nn.functional.pad(t, (0, _round8(dim) - dim)) for t in (q, k, v))
    out_padded, lse = varlen_forward_math(
        q_p,
        k_p,
        v_p,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
    )
    rng_state = torch.empty(2, dtype=torch.int64)
    return out_padded[..., :dim], q_p, k_p, v_p, out_padded, lse, torch.empty(0, dtype=q.dtype), rng_state


def fa263_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _check_plain(dropout_p, softcap, alibi_slopes)
    assert isinstance(deterministic, bool)
    assert q.shape[-1] == _round8(dout.shape[-1]), "head_size must be head_size_og rounded to a multiple of 8"
    dout = torch.nn.functional.pad(dout, (0, q.shape[-1] - dout.shape[-1]))  # 2.6.3 pads dout in C++
    sequences = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = tuple(window_size)
    softmax_d = varlen_backward_math(
        dout, q, k, v, out, softmax_lse, (dq, dk, dv), *sequences, softmax_scale, causal, window, softcap
    )
    return dq, dk, dv, softmax_d


def fa27_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_varlen_qkv(q, k, v, multiple_of_8=True)
    _check_plain(dropout_p, softcap, alibi_slopes)
    _check_varlen_plain(return_softmax, block_table, leftpad_k, seqused_k)
    assert zero_tensors is False
    window = (window_size_left, window_size_right)
    out, lse = varlen_forward_math(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap
    )
    return out, lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)


def fa27_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _check_plain(dropout_p, softcap, alibi_slopes)
    assert isinstance(deterministic, bool) and zero_tensors is False
    sequences = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = (window_size_left, window_size_right)
    return varlen_backward_math(
        dout, q, k, v, out, softmax_lse, (dq, dk, dv), *sequences, softmax_scale, causal, window, softcap
    )


# flash-attn >= 2.7 ships all four as torch.library.custom_op (CUDA only; CPU here, own namespace).
fa28_forward = torch.library.custom_op("mesh_cp_fake_fa28::_flash_attn_forward", mutates_args=(), device_types="cpu")(
    fa27_forward
)
fa28_backward = torch.library.custom_op(
    "mesh_cp_fake_fa28::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)(fa27_backward)
fa28_varlen_forward = torch.library.custom_op(
    "mesh_cp_fake_fa28::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu"
)(fa27_varlen_forward)
fa28_varlen_backward = torch.library.custom_op(
    "mesh_cp_fake_fa28::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)(fa27_varlen_backward)

FAKES = {
    "2.6.3": (fa263_forward, fa263_backward, fa263_varlen_forward, fa263_varlen_backward),
    "2.7.4.post1": (fa27_forward, fa27_backward, fa27_varlen_forward, fa27_varlen_backward),
    "2.8.3": (fa28_forward, fa28_backward, fa28_varlen_forward, fa28_varlen_backward),
}
PRIVATE_NAMES = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)


def install_flash_attn(monkeypatch, version: str, api: str | None = None) -> None:
    """Make ``import flash_attn`` give a fake of ``version`` (with the private API of ``api``)."""
    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.__path__ = []
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for name, fn in zip(PRIVATE_NAMES, FAKES[api or version], strict=True):
        setattr(interface, name, fn)
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


class _BrokenBinary(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import flash_attn`` fails like a build for another torch/CUDA: OSError from the loader."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] == "flash_attn" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationE")


def break_flash_attn(monkeypatch) -> None:
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenBinary(), *sys.meta_path])


@pytest.mark.parametrize("version", sorted(FAKES))
@pytest.mark.parametrize("head_dim", [64, 72, 100, 256])
def test_flash_attn_kernel_is_exact_on_every_private_api(monkeypatch, version: str, head_dim: int) -> None:
    """Forward, backward, and the lse-gradient backward (extra column, or by parts at 256)."""
    install_flash_attn(monkeypatch, version)
    kernel = FlashAttnKernel.without_device_check()
    assert kernel.version == version
    for dtype, causal in ((torch.bfloat16, False), (torch.float16, True)):
        for lse_only in (False, True):
            case = lse_grad_case(8, 2, head_dim, seed=head_dim + lse_only, lse_only=lse_only)
            check_block_kernel(kernel, dtype, causal, case, lse_grad=True)
        case = lse_grad_case(4, 4, head_dim, seed=1, lse_only=False)
        check_block_kernel(kernel, dtype, causal, case, lse_grad=False)


def test_flash_attn_refuses_old_versions_and_unknown_private_apis(monkeypatch) -> None:
    install_flash_attn(monkeypatch, "2.5.9", api="2.6.3")
    with pytest.raises(RuntimeError, match=r"flash-attn 2\.5\.9 is too old; mesh_cp needs >= 2\.6\.3"):
        FlashAttnKernel.without_device_check()
    # A 2.7 version string with 2.6-style functions: refused, not called with the wrong arguments.
    install_flash_attn(monkeypatch, "2.7.0", api="2.6.3")
    with pytest.raises(RuntimeError, match=r"_flash_attn_forward takes .*not the parameters \['window_size_left'"):
        FlashAttnKernel.without_device_check()
    break_flash_attn(monkeypatch)
    with pytest.raises(RuntimeError, match=r"flash-attn cannot be imported \(OSError: .*undefined symbol"):
        FlashAttnKernel.without_device_check()


# --- ATen CUDA ops: meta tensors and a CPU emulation --------------------------------------------

CUDA_KERNELS = {"cuda_flash": CudaFlashKernel, "cuda_sdpa": CudaSdpaKernel}


@pytest.mark.parametrize("name", sorted(CUDA_KERNELS))
@pytest.mark.parametrize("head_dim", [64, 72, 100, 256])
def test_cuda_kernels_on_meta_tensors(name: str, head_dim: int) -> None:
    """Shapes and dtypes through the ops' real meta functions (which also check the schemas)."""
    kernel = CUDA_KERNELS[name].without_device_check()
    assert_meta_shapes(
        kernel, (torch.bfloat16, torch.float16) + ((torch.float32,) if name == "cuda_sdpa" else ()), head_dim
    )


def assert_meta_shapes(kernel, dtypes, head_dim: int) -> None:
    """``kernel`` forward and backward (with and without an lse gradient) on ``meta`` tensors of GQA 8:2: the shapes,
    dtypes and devices the ops' meta functions give."""
    for dtype in dtypes:
        q, do = (torch.empty(2, 12, 8, head_dim, device="meta", dtype=dtype) for _ in range(2))
        k, v = (torch.empty(2, 12, 2, head_dim, device="meta", dtype=dtype) for _ in range(2))
        out, lse = kernel.forward(q, k, v, causal=True, scale=0.1)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "meta")
        assert (lse.shape, lse.dtype) == ((2, 8, 12), torch.float32)
        delta = torch.empty(2, 8, 12, device="meta")
        for lse_grad in (False, True):
            dq, dk, dv = kernel.backward(do, q, k, v, lse, delta, causal=True, scale=0.1, lse_grad=lse_grad)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape), (lse_grad, dq.shape, dk.shape)
            assert {t.device.type for t in (dq, dk, dv)} == {"meta"}


def _sdpa_layout(*tensors):
    """(B, H, S, D) arguments of the ops -> (B, S, H, D) for the reference kernel."""
    return [t.transpose(1, 2) for t in tensors]


def _flash_fwd(query, key, value, dropout_p, is_causal, return_debug_mask, scale):
    assert query.dtype in LOW and query.dtype == key.dtype == value.dtype
    assert query.shape[-1] % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!"
    assert query.shape[-1] <= 256 and query.shape[1] % key.shape[1] == 0
    assert all(t.stride(-1) == 1 for t in (query, key, value))
    assert dropout_p == 0.0 and return_debug_mask is False
    out, lse = REF.forward(*_sdpa_layout(query, key, value), causal=is_causal, scale=scale)
    rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out.transpose(1, 2), lse.float(), None, None, query.shape[2], key.shape[2], *rng, torch.empty(0)


def _flash_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    scale,
):
    assert cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (query.shape[2], key.shape[2])
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256, "head_size should be a multiple of 8"
    assert grad_out.shape == out.shape == query.shape and out.dtype == query.dtype
    batch, heads, rows, _ = query.shape
    assert logsumexp.shape == (batch, heads, rows) and logsumexp.dtype == torch.float32
    delta = (grad_out.float() * out.float()).sum(-1)
    grads = REF.backward(*_sdpa_layout(grad_out, query, key, value), logsumexp, delta, causal=is_causal, scale=scale)
    return tuple(g.to(query.dtype).transpose(1, 2) for g in grads)


def _check_bias(attn_bias, query, key) -> None:
    """What the memory-efficient kernel requires of ``attn_bias``: the query's dtype, ``(B, H, Sq, Sk)``, a unit
    last stride and the others aligned to 128 bits (PyTorch pads the last dim to 16 elements to get there)."""
    b, h, sq, _ = query.shape
    assert attn_bias.dtype == query.dtype and attn_bias.shape == (b, h, sq, key.shape[2])
    alignment = 128 // torch.finfo(attn_bias.dtype).bits
    assert attn_bias.stride(-1) == 1 and all(attn_bias.stride(d) % alignment == 0 for d in range(3)), attn_bias.stride()


def _biased_scores(query, key, attn_bias, is_causal, scale):
    """``(B, H, Sq, Sk)`` fp32 scores plus the additive bias (and the causal mask), as the kernel forms them."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(acc) @ key.to(acc).transpose(-1, -2)) * scale + attn_bias.to(acc)
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _efficient_fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale):
    assert compute_log_sumexp is True and dropout_p == 0.0
    assert query.dtype in (*LOW, torch.float32) and query.dtype == key.dtype == value.dtype
    assert query.shape[1] == key.shape[1] == value.shape[1], "GQA heads are expanded before this op"
    assert query.shape[-1] % 8 == 0, "mesh_cp pads the head dim to a multiple of 8"
    rows = query.shape[2]
    if attn_bias is None:
        out, lse = REF.forward(*_sdpa_layout(query, key, value), causal=is_causal, scale=scale)
        out = out.transpose(1, 2)
    else:
        _check_bias(attn_bias, query, key)
        scores = _biased_scores(query, key, attn_bias, is_causal, scale)
        assert torch.isfinite(scores).any(-1).all(), "a row of -inf scores: mesh_cp must not rely on its result"
        lse = torch.logsumexp(scores, -1)
        out = (torch.softmax(scores, -1) @ value.to(scores.dtype)).to(query.dtype)
    padded = torch.full((*lse.shape[:2], math.ceil(rows / 32) * 32), math.nan)  # the kernel pads its lse
    padded[..., :rows] = lse
    return out, padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def _efficient_bwd(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal,
    scale,
):
    assert dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
    assert query.shape[-1] % 8 == 0 and grad_out_.shape == out.shape == query.shape
    rows = query.shape[2]
    assert logsumexp.shape == (*query.shape[:2], math.ceil(rows / 32) * 32) and logsumexp.dtype == torch.float32
    lse = logsumexp[..., :rows]
    delta = (grad_out_.float() * out.float()).sum(-1)
    if attn_bias is None:
        grads = REF.backward(*_sdpa_layout(grad_out_, query, key, value), lse, delta, causal=is_causal, scale=scale)
        return (*(g.to(query.dtype).transpose(1, 2) for g in grads), None)
    _check_bias(attn_bias, query, key)
    scores = _biased_scores(query, key, attn_bias, is_causal, scale)
    p = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    do = grad_out_.to(scores.dtype)
    ds = p * (do @ value.to(scores.dtype).transpose(-1, -2) - delta.to(scores.dtype).unsqueeze(-1))
    grads = (
        ds @ key.to(scores.dtype) * scale,
        ds.transpose(-1, -2) @ query.to(scores.dtype) * scale,
        p.transpose(-1, -2) @ do,
    )
    return (*(g.to(query.dtype) for g in grads), None)


def _flash_varlen_fwd(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    scale,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    **later,  # block_table, num_splits (newer PyTorch)
):
    """``aten._flash_attention_forward`` in its varlen form (mha_varlen_fwd); mesh_cp's dense calls go through
    ``_scaled_dot_product_flash_attention``."""
    assert cum_seq_q is not None and cum_seq_k is not None
    _check_varlen_qkv(query, key, value, multiple_of_8=True)  # "this is ensured by padding!"
    assert dropout_p == 0.0 and return_debug_mask is False and seqused_k is None and alibi_slopes is None
    assert all(v is None for v in later.values()), later
    window = tuple(-1 if w is None else w for w in (window_size_left, window_size_right))  # value_or(-1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale  # sdp::calculate_scale: the padded head dim
    out, lse = varlen_forward_math(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, window, 0.0)
    rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse, *rng, torch.empty(0, dtype=query.dtype)


def _flash_varlen_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    scale,
    window_size_left=None,
    window_size_right=None,
    **rng,  # rng_state, unused (philox_seed, philox_offset before): read only with dropout
):
    assert dropout_p == 0.0 and len(rng) == 2
    window = tuple(-1 if w is None else w for w in (window_size_left, window_size_right))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    sequences = (cum_seq_q, cum_seq_k, max_q, max_k)
    # the op makes grad_out and out contiguous itself
    varlen_backward_math(
        grad_out.contiguous(), query, key, value, out.contiguous(), logsumexp, grads, *sequences, scale, is_causal,
        window, 0.0,
    )  # fmt: skip
    return grads


class EmulatedCudaAttention(TorchDispatchMode):
    """Runs the CUDA-only attention ops on CPU with the reference math, binding every argument by
    its name in the op's real schema; records which ops ran."""

    IMPLS = {
        torch.ops.aten._scaled_dot_product_flash_attention.default: _flash_fwd,
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default: _flash_bwd,
        torch.ops.aten._scaled_dot_product_efficient_attention.default: _efficient_fwd,
        torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: _efficient_bwd,
        torch.ops.aten._flash_attention_forward.default: _flash_varlen_fwd,
        torch.ops.aten._flash_attention_backward.default: _flash_varlen_bwd,
    }

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []
        self.backward_widths: list[torch.Size] = []
        """Shapes of the ``query`` of every backward op that ran (its head dim, padding included)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self.IMPLS.get(func)
        if impl is None:
            return func(*args, **(kwargs or {}))
        schema = func._schema.arguments
        bound = {a.name: a.default_value for a in schema if a.has_default_value()}
        bound.update(zip((a.name for a in schema), args, strict=False))  # trailing defaults omitted
        bound.update(kwargs or {})
        self.ran.append(func.__name__)
        if func.__name__.endswith("_backward.default"):
            self.backward_widths.append(bound["query"].shape)
        return impl(**bound)


@pytest.mark.parametrize("name", sorted(CUDA_KERNELS))
@pytest.mark.parametrize("head_dim", [64, 72, 100, 256])
def test_cuda_kernels_are_exact_on_emulated_ops(name: str, head_dim: int) -> None:
    kernel = CUDA_KERNELS[name].without_device_check()
    second = torch.float32 if name == "cuda_sdpa" else torch.float16
    with EmulatedCudaAttention() as mode:
        for dtype, causal in ((torch.bfloat16, False), (second, True)):
            for lse_only in (False, True):
                case = lse_grad_case(8, 2, head_dim, seed=head_dim + lse_only, lse_only=lse_only)
                check_block_kernel(kernel, dtype, causal, case, lse_grad=True)
            case = lse_grad_case(8, 2, head_dim, seed=2, lse_only=False)
            check_block_kernel(kernel, dtype, causal, case, lse_grad=False)
    op = "_scaled_dot_product_flash_attention" if name == "cuda_flash" else "_scaled_dot_product_efficient_attention"
    assert {f"{op}.default", f"{op}_backward.default"} <= set(mode.ran)


def test_cuda_flash_lse_gradient_at_head_dim_192_goes_by_parts_where_200_has_no_backward(monkeypatch) -> None:
    """At head_dim 192 the delta column would make 200, which sm86/89/120 cannot train: backward by parts."""
    from mesh_cp.kernels import cuda_flash

    kernel = CudaFlashKernel.without_device_check()
    for capability, by_parts in (((8, 6), True), ((9, 0), False)):
        monkeypatch.setattr(cuda_flash, "_capability", lambda device, c=capability: c)
        with EmulatedCudaAttention() as mode:
            check_block_kernel(
                kernel, torch.bfloat16, True, lse_grad_case(4, 2, 192, seed=3, lse_only=False), lse_grad=True
            )
        widths = {shape[-1] for shape in mode.backward_widths}
        assert widths == ({192} if by_parts else {200}), (capability, widths)


# --- kernel="auto" on emulated machines ---------------------------------------------------------

CUDA0 = torch.device("cuda", 0)


def emulate_cuda(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)


FLASH_ATTN_STATES = {
    "2.8.3": lambda mp: install_flash_attn(mp, "2.8.3"),
    "2.6.3": lambda mp: install_flash_attn(mp, "2.6.3"),
    "broken": break_flash_attn,
    "old": lambda mp: install_flash_attn(mp, "2.5.9", api="2.6.3"),
    "absent": lambda mp: mp.setitem(sys.modules, "flash_attn", None),
}

# (flash-attn, capability, dtype, head_dim) -> (chosen kernel, what the log must say)
AUTO_MATRIX = [
    ("2.8.3", (8, 0), torch.bfloat16, 128, "flash_attn", r"chose 'flash_attn' for torch\.bfloat16 head_dim 128"),
    ("2.6.3", (9, 0), torch.float16, 72, "flash_attn", r"chose 'flash_attn'"),
    ("broken", (8, 0), torch.bfloat16, 128, "cuda_flash", r"flash_attn: flash-attn cannot be imported \(OSError"),
    ("old", (9, 0), torch.float16, 64, "cuda_flash", r"flash_attn: flash-attn 2\.5\.9 is too old"),
    ("absent", (8, 0), torch.bfloat16, 64, "cuda_flash", r"flash_attn: flash-attn cannot be imported \(Module"),
    ("2.8.3", (7, 5), torch.float16, 64, "cuda_sdpa", r"cuda_flash: FlashAttention needs compute capability >= 8\.0"),
    ("2.8.3", (7, 5), torch.bfloat16, 64, "reference", r"cuda_sdpa: bfloat16 needs compute capability >= 8\.0"),
    (
        "2.8.3",
        (8, 0),
        torch.bfloat16,
        320,
        "cuda_sdpa",
        r"\(flash_attn: head_dim 320 > 256 \| cuda_flash: head_dim 320",
    ),
    (
        "broken",
        (8, 6),
        torch.bfloat16,
        200,
        "cuda_sdpa",
        r"cuda_flash: head_dim 200 \(padded to 200\) in \(192, 224\] has no backward",
    ),
    ("2.8.3", (8, 0), torch.float32, 64, "cuda_sdpa", r"chose 'cuda_sdpa' for torch\.float32"),
    ("2.8.3", (9, 0), torch.float64, 64, "reference", r"chose 'reference' for torch\.float64 head_dim 64 on cuda:0$"),
]


@pytest.mark.parametrize(("fa", "capability", "dtype", "head_dim", "chosen", "logged"), AUTO_MATRIX)
def test_auto_falls_back_and_says_why(monkeypatch, caplog, fa, capability, dtype, head_dim, chosen, logged) -> None:
    emulate_cuda(monkeypatch, capability)
    FLASH_ATTN_STATES[fa](monkeypatch)
    with caplog.at_level(logging.INFO, logger="mesh_cp"):
        kernel = kernels.resolve_kernel("auto", CUDA0, dtype, head_dim)
        again = kernels.resolve_kernel("auto", CUDA0, dtype, head_dim)
    assert kernel.name == chosen and again is kernel
    records = [r for r in caplog.records if r.name == "mesh_cp"]
    assert len(records) == 1, [r.getMessage() for r in records]  # decided and logged once
    assert records[0].levelno == (logging.WARNING if chosen == "reference" and dtype != torch.float64 else logging.INFO)
    message = records[0].getMessage()
    assert message.startswith(f"mesh_cp: kernel 'auto' chose {chosen!r}")
    assert re.search(logged, message), message


def test_auto_never_raises_on_cuda(monkeypatch) -> None:
    """Every machine, install and head dim gets a kernel that states it can run them."""
    for fa, install in FLASH_ATTN_STATES.items():
        for capability in ((6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
            with monkeypatch.context() as mp:
                emulate_cuda(mp, capability)
                install(mp)
                kernels.forget_choices()
                for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                    for head_dim in (32, 72, 128, 200, 256, 320):
                        name, _ = kernels.choose(CUDA0, dtype, head_dim)
                        assert kernels.not_supported_reasons(name, CUDA0, dtype, head_dim) == (), (fa, capability, name)


def test_named_kernel_that_cannot_run_says_why_and_what_can(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (8, 0))
    install_flash_attn(monkeypatch, "2.8.3")
    with pytest.raises(NotImplementedError) as err:
        kernels.resolve_kernel("flash_attn", CUDA0, torch.float32, 64)
    assert str(err.value) == (
        "kernel 'flash_attn' cannot run torch.float32 head_dim 64 on cuda:0: dtype torch.float32 is not one of "
        "['torch.float16', 'torch.bfloat16']; kernels that can: ['reference', 'cuda_sdpa'] (or kernel='auto')"
    )
    with pytest.raises(
        NotImplementedError, match=r"'cuda_flash' cannot run torch\.bfloat16 head_dim 320 .*: head_dim 320 > 256"
    ):
        kernels.resolve_kernel("cuda_flash", CUDA0, torch.bfloat16, 320)
    with pytest.raises(NotImplementedError, match=r"'cpu_flash' cannot run .*needs CPU tensors, got cuda"):
        kernels.resolve_kernel("cpu_flash", CUDA0, torch.bfloat16, 64)
    assert kernels.resolve_kernel("flash_attn", CUDA0, torch.bfloat16, 64).name == "flash_attn"
    assert kernels.resolve_kernel("auto", torch.device("cpu"), torch.float16, 64).name == "cpu_flash"


def test_auto_and_named_kernels_give_every_reason_of_a_kernel_passed_over(monkeypatch, caplog) -> None:
    emulate_cuda(monkeypatch, (7, 5))
    FLASH_ATTN_STATES["absent"](monkeypatch)
    flash_attn = (
        "head_dim 320 > 256",
        "flash-attn 2 needs compute capability >= 8.0 (Ampere), got 7.5",
        "flash-attn cannot be imported (ModuleNotFoundError: import of flash_attn halted; None in sys.modules); "
        "install a build matching this torch and CUDA (pip install 'mesh-cp[flash]')",
    )
    cuda_flash = ("head_dim 320 > 256", "FlashAttention needs compute capability >= 8.0 (Ampere), got 7.5")
    cuda_sdpa = ("bfloat16 needs compute capability >= 8.0, got 7.5",)
    for name, reasons in {"flash_attn": flash_attn, "cuda_flash": cuda_flash, "cuda_sdpa": cuda_sdpa}.items():
        assert kernels.not_supported_reasons(name, CUDA0, torch.bfloat16, 320) == reasons, name
    with caplog.at_level(logging.INFO, logger="mesh_cp"):
        name, reason = kernels.choose(CUDA0, torch.bfloat16, 320)
    assert name == "reference" and reason == (
        "kernel 'auto' chose 'reference' for torch.bfloat16 head_dim 320 on cuda:0 ("
        f"flash_attn: {'; '.join(flash_attn)} | cuda_flash: {'; '.join(cuda_flash)} | cuda_sdpa: {cuda_sdpa[0]})"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "mesh_cp"] == [f"mesh_cp: {reason}"]
    with pytest.raises(NotImplementedError) as err:
        kernels.resolve_kernel("flash_attn", CUDA0, torch.bfloat16, 320)
    assert str(err.value) == (
        f"kernel 'flash_attn' cannot run torch.bfloat16 head_dim 320 on cuda:0: {'; '.join(flash_attn)}; "
        "kernels that can: ['reference'] (or kernel='auto')"
    )
