"""Block kernels against the pure-torch reference and autograd; the LSE merge; the layering rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mesh_cp.core.numerics import attention_delta, merge_, reference_attention
from mesh_cp.kernels import _REGISTRY, KERNEL_NAMES, get_kernel, resolve_kernel

CPU_KERNELS = ("reference", "cpu_flash")


def _inputs(heads: int, kv_heads: int, seq_q: int = 10, seq_k: int = 10, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq_q, heads, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, seq_k, kv_heads, 16, generator=gen, dtype=dtype)
    v = torch.randn(2, seq_k, kv_heads, 16, generator=gen, dtype=dtype)
    do = torch.randn(2, seq_q, heads, 16, generator=gen, dtype=dtype)
    return q, k, v, do


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_kernel_matches_autograd_of_plain_attention(name: str, causal: bool, heads: int, kv_heads: int) -> None:
    kernel = get_kernel(name)
    q, k, v, do = _inputs(heads, kv_heads, seq_k=10 if causal else 7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, causal=causal, softmax_scale=0.3)
    (ref_out * do).sum().backward()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.3)
    assert out.shape == q.shape and lse.shape == (2, heads, q.shape[1])
    torch.testing.assert_close(out, ref_out.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-12, rtol=0)
    grads = kernel.backward(do, q, k, v, lse, attention_delta(do, out), causal=causal, scale=0.3)
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got.to(leaf.dtype), leaf.grad, atol=1e-12, rtol=0)


def test_cpu_flash_backward_takes_a_global_delta_and_lse() -> None:
    """A block of a longer row: the kernels must use the row's lse/delta, not the block's own."""
    q, k, v, do = _inputs(4, 2, seq_q=6, seq_k=12)
    out_full, lse_full = get_kernel("reference").forward(q, k, v, causal=False, scale=0.25)
    delta = attention_delta(do, out_full)
    grads = [
        get_kernel(name).backward(do, q, k[:, :5], v[:, :5], lse_full, delta, causal=False, scale=0.25)
        for name in CPU_KERNELS
    ]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-12, rtol=0)


def test_lse_merge_of_two_halves_is_the_whole() -> None:
    q, k, v, _ = _inputs(4, 4, seq_k=12)
    kernel = get_kernel("reference")
    o_all, lse_all = kernel.forward(q, k, v, causal=False, scale=0.25)
    o_acc = torch.zeros_like(o_all)
    lse_acc = torch.full_like(lse_all, float("-inf"))
    for part in (slice(0, 5), slice(5, 12)):
        merge_(o_acc, lse_acc, *kernel.forward(q, k[:, part], v[:, part], causal=False, scale=0.25))
    torch.testing.assert_close(o_acc, o_all, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_acc, lse_all, atol=1e-12, rtol=0)
    # Rows with no keys on either side stay empty (lse -inf, o 0) instead of becoming nan.
    empty_o, empty_lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf"))
    merge_(empty_o, empty_lse, torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf")))
    assert torch.isneginf(empty_lse).all() and (empty_o == 0).all()


def test_registry_names_match_the_literal_and_unknown_names_raise() -> None:
    assert set(KERNEL_NAMES) == set(_REGISTRY)
    with pytest.raises(ValueError, match=r"unknown kernel 'triton'; choose one of \['cpu_flash'"):
        get_kernel("triton")
    with pytest.raises(ValueError, match="BlockKernel"):
        resolve_kernel(42, torch.device("cpu"), torch.float32)
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32).name == "cpu_flash"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("name", ["cuda_sdpa", "flash_attn"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernels_match_the_reference(name: str, causal: bool) -> None:
    if name == "flash_attn":
        pytest.importorskip("flash_attn")
    dtype = torch.bfloat16 if name == "flash_attn" else torch.float32
    q, k, v, do = (t.to("cuda", dtype) for t in _inputs(8, 2, seq_q=40, seq_k=40, dtype=torch.float32))
    ref = get_kernel("reference")
    out, lse = get_kernel(name).forward(q, k, v, causal=causal, scale=0.25)
    ref_out, ref_lse = ref.forward(q, k, v, causal=causal, scale=0.25)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=0)
    torch.testing.assert_close(lse.float(), ref_lse.float(), atol=tol, rtol=0)
    delta = attention_delta(do, ref_out)
    for got, want in zip(
        get_kernel(name).backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.25),
        ref.backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.25),
        strict=False,
    ):
        torch.testing.assert_close(got.float(), want.float(), atol=5 * tol, rtol=0)


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())


def test_plan_imports_no_torch_and_core_kernels_import_no_runtime() -> None:
    assert not any(m == "torch" or m.startswith("torch.") for m in _modules_after_import("mesh_cp.core.plan"))
    for module in ("mesh_cp.core.numerics", "mesh_cp.kernels", "mesh_cp"):
        loaded = _modules_after_import(module)
        assert not any(m.startswith("mesh_cp.runtime") for m in loaded), module
