"""Block kernels against the pure-torch reference and autograd; the LSE merge; the layering rule."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
import torch

from mesh_cp.core.numerics import attention_delta, merge_, reference_attention
from mesh_cp.kernels import (
    _REGISTRY,
    KERNEL_NAMES,
    NO_CAPABILITIES,
    OPTIONAL_KEYWORDS,
    BlockKernel,
    Capabilities,
    capabilities_of,
    forget_choices,
    get_kernel,
    not_supported_reasons,
    out_for_delta,
    resolve_kernel,
    takes,
)
from mesh_cp.kernels.base import backward_by_parts

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


# Relative to the largest value compared: fp32/fp64 kernels round differently from plain autograd
# (CUDA's memory-efficient fp32 kernel multiplies in 3xTF32).
LOW_PRECISION_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 0.0}


def lse_grad_case(heads: int, kv_heads: int, dim: int, *, seed: int, lse_only: bool):
    """fp64 ``q, k, v, do, dlse`` where the lse receives a gradient: ``do`` is zero (lse-only loss) or
    has a zero row, a tiny row (|do| ~ 1e-6: the scaled ``out`` of Note [Gradient of the lse] would
    overflow fp16) and ordinary rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 12, heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 12, kv_heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, 12, heads, dim, generator=gen, dtype=torch.float64)
    if lse_only:
        do.zero_()
    else:
        do[:, 3] = 0
        do[:, 5] *= 1e-6
    dlse = torch.randn(2, heads, 12, generator=gen, dtype=torch.float64) * 3
    return q, k, v, do, dlse


def check_block_kernel(kernel, dtype, causal, case, *, lse_grad: bool = True, scale: float = 0.3) -> None:
    """``kernel``'s forward and backward in ``dtype`` against autograd of ``reference_attention`` in
    fp64, within twice the error of plain autograd in ``dtype`` (flash-attn's rule; a relative floor
    for fp32/fp64 rounding), and its gradients against the reference kernel on the same inputs. The loss
    is ``<out, do> + <lse, dlse>`` with ``lse_grad`` (the kernel is told so), ``<out, do>`` without."""
    q, k, v, do, dlse = case
    if not lse_grad:
        dlse = torch.zeros_like(dlse)

    def run(prec):
        leaves = [t.to(prec).clone().requires_grad_() for t in (q, k, v)]
        out, lse = reference_attention(*leaves, causal=causal, softmax_scale=scale)
        ((out * do.to(prec)).sum() + (lse * dlse.to(lse.dtype)).sum()).backward()
        return [t.double() for t in (out.detach(), lse.detach(), *(leaf.grad for leaf in leaves))]

    exact, plain = run(torch.float64), run(dtype)
    qd, kd, vd, dod = (t.to(dtype) for t in (q, k, v, do))
    out, lse = kernel.forward(qd, kd, vd, causal=causal, scale=scale)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    delta = attention_delta(dod, out) - dlse.to(lse.dtype)
    got = kernel.backward(dod, qd, kd, vd, lse, delta, causal=causal, scale=scale, lse_grad=lse_grad)
    spec = get_kernel("reference").backward(dod, qd, kd, vd, lse, delta, causal=causal, scale=scale)
    for name, g, want, low, ref in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *got), exact, plain, (None, None, *spec), strict=True
    ):
        assert g.shape == want.shape, name
        assert torch.isfinite(g).all(), f"{name} not finite"
        tol = 2 * (low - want).abs().max().item() + LOW_PRECISION_FLOOR[dtype] * max(1.0, want.abs().max().item())
        err = (g.double() - want).abs().max().item()
        assert err <= tol, f"{name}: error {err:.3g} against fp64 autograd, allowed {tol:.3g}"
        if ref is not None:
            err_ref = (g.double() - ref.double()).abs().max().item()
            assert err_ref <= tol, f"{name}: {err_ref:.3g} from the reference kernel, allowed {tol:.3g}"


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_gradient_reaching_the_lse_is_exact(name: str, dtype, causal: bool, heads: int, kv_heads: int) -> None:
    """A gradient on the lse alone, and on out and lse together (rows with dO = 0 and tiny dO)."""
    for lse_only in (True, False):
        case = lse_grad_case(heads, kv_heads, 17, seed=heads + 10 * lse_only, lse_only=lse_only)
        check_block_kernel(get_kernel(name), dtype, causal, case)


def test_backward_by_parts_is_exact() -> None:
    """The three-call path that flash kernels take when one more head-dim column does not fit."""
    q, k, v, do, dlse = lse_grad_case(8, 2, 16, seed=3, lse_only=False)
    kernel = get_kernel("cpu_flash")
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    delta = attention_delta(do, out) - dlse
    got = backward_by_parts(kernel, do, q, k, v, lse, delta, causal=True, scale=0.3)
    want = get_kernel("reference").backward(do, q, k, v, lse, delta, causal=True, scale=0.3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_out_for_delta_is_bounded_and_refuses_a_delta_it_cannot_carry() -> None:
    q, k, v, do = _inputs(4, 4)
    out, _ = get_kernel("reference").forward(q, k, v, causal=False, scale=0.3)
    do[:, 2] = 0
    delta = attention_delta(do, out)
    o = out_for_delta(do, delta)
    torch.testing.assert_close(attention_delta(do, o), delta, atol=1e-12, rtol=0)
    assert (o.norm(dim=-1) <= out.norm(dim=-1) + 1e-12).all()  # Cauchy-Schwarz: |o| <= |O|
    assert (o[:, 2] == 0).all()
    # Rows of tiny dO (|dO|^2 underflows even in fp32) still get their delta.
    tiny = (do * 1e-25).float()
    delta_tiny = attention_delta(tiny, out.float())
    o_tiny = out_for_delta(tiny, delta_tiny)
    assert torch.isfinite(o_tiny).all()
    torch.testing.assert_close(attention_delta(tiny, o_tiny), delta_tiny, atol=0, rtol=1e-5)
    # A gradient on the lse of a row with dO = 0 cannot be carried by o = dO * c: nan, never a wrong value.
    delta[:, 1, 2] = 0.5
    assert torch.isnan(out_for_delta(do, delta)[:, 2, 1]).all()


def test_registry_names_match_the_literal_and_unknown_names_raise() -> None:
    assert set(KERNEL_NAMES) == set(_REGISTRY)
    with pytest.raises(ValueError, match=r"unknown kernel 'triton'; choose one of \['cpu_flash'"):
        get_kernel("triton")
    with pytest.raises(ValueError, match="BlockKernel"):
        resolve_kernel(42, torch.device("cpu"), torch.float32)
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32).name == "cpu_flash"
    for name in KERNEL_NAMES:  # every kernel states its limits and takes the lse_grad flag
        cls = _kernel_class(name)
        assert callable(cls.not_supported_reasons) and "lse_grad" in inspect.signature(cls.backward).parameters, name


def _kernel_class(name: str) -> type:
    return importlib.import_module(_REGISTRY[name][0]).__dict__[_REGISTRY[name][1]]


def _optional_keywords(method) -> set[str]:
    """The optional keywords of :class:`BlockKernel` that ``method`` accepts."""
    return set(inspect.signature(method).parameters) & set(OPTIONAL_KEYWORDS)


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_kernel_declares_capabilities_and_its_signatures_take_exactly_them(name: str) -> None:
    cls = _kernel_class(name)
    assert isinstance(cls.__dict__.get("capabilities"), Capabilities), name  # declared by the class itself
    assert capabilities_of(cls) is cls.capabilities
    for method in (cls.forward, cls.backward):
        assert _optional_keywords(method) == cls.capabilities.keywords, (name, method.__name__)
        assert all(takes(name, k) == (k in cls.capabilities.keywords) for k in OPTIONAL_KEYWORDS)
    # The protocol declares every optional keyword, with None as its default.
    for method in (BlockKernel.forward, BlockKernel.backward):
        params = inspect.signature(method).parameters
        assert _optional_keywords(method) == set(OPTIONAL_KEYWORDS)
        assert all(params[k].default is None and params[k].kind is params[k].KEYWORD_ONLY for k in OPTIONAL_KEYWORDS)


def test_a_kernel_without_capabilities_takes_no_keyword_and_unknown_names_are_refused() -> None:
    class Plain:  # a user's own kernel: forward and backward, no capabilities
        name = "plain"

        def forward(self, q, k, v, *, causal, scale): ...

        def backward(self, do, q, k, v, lse, delta, *, causal, scale, lse_grad=False): ...

    plain = Plain()
    assert isinstance(plain, BlockKernel) and capabilities_of(plain) is NO_CAPABILITIES
    assert not any(takes(plain, k) for k in OPTIONAL_KEYWORDS)
    assert takes("reference", "softcap") and takes(get_kernel("cpu_flash"), "mask")
    assert not takes("cpu_flash", "segments") and not takes("cuda_flash", "softcap")
    for wrong in ("takes_mask", "window", "Mask"):
        with pytest.raises(
            ValueError, match=rf"unknown kernel keyword '{wrong}'; one of \['mask', 'segments', 'softcap'\]"
        ):
            takes("reference", wrong)
    plain.capabilities = {"mask"}
    with pytest.raises(TypeError, match="capabilities must be a mesh_cp.kernels.Capabilities, got set"):
        takes(plain, "mask")
    with pytest.raises(ValueError, match=r"unknown keywords \['takes_mask'\]"):
        Capabilities(keywords={"takes_mask"})


def test_capabilities_give_every_reason_of_the_data() -> None:
    caps = Capabilities(devices=("cuda",), dtypes=(torch.float16,), head_dim_multiple=8, max_head_dim=256)
    cpu = torch.device("cpu")
    assert caps.not_supported_reasons(torch.device("cuda", 0), torch.float16, 256) == ()
    assert caps.not_supported_reasons(cpu, torch.float64, 257) == (
        "needs CUDA tensors, got cpu",
        "dtype torch.float64 is not one of ['torch.float16']",
        "head_dim 257 (padded to 264) > 256",
    )
    assert caps.not_supported_reasons(cpu, torch.float64, None)[1:] == (
        "dtype torch.float64 is not one of ['torch.float16']",
    )
    assert NO_CAPABILITIES.not_supported_reasons(torch.device("meta"), torch.int8, 10**6) == ()


@pytest.mark.parametrize("name", ["cuda_sdpa", "cuda_flash", "flash_attn"])
def test_a_cuda_kernel_asked_for_cpu_fp64_gives_every_reason(name: str) -> None:
    forget_choices()
    reasons = not_supported_reasons(name, torch.device("cpu"), torch.float64, 321)
    assert reasons[0] == "needs CUDA tensors, got cpu", reasons
    assert reasons[1].startswith("dtype torch.float64 is not one of ['torch.float16', 'torch.bfloat16'"), reasons
    if name != "cuda_sdpa":  # it pads to a multiple of 8 and has no largest head dim
        assert reasons[2] == "head_dim 321 (padded to 328) > 256", reasons
    assert not_supported_reasons("reference", torch.device("cpu"), torch.float64, 321) == ()
    with pytest.raises(NotImplementedError) as err:
        resolve_kernel(name, torch.device("cpu"), torch.float64, 321)
    assert "; ".join(reasons) in str(err.value) and "kernels that can: ['reference', 'cpu_flash']" in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("name", ["cuda_sdpa", "cuda_flash", "flash_attn"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernels_match_the_reference(name: str, causal: bool) -> None:
    if name == "flash_attn":
        pytest.importorskip("flash_attn")
    dtype = torch.float32 if name == "cuda_sdpa" else torch.bfloat16
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
        strict=True,
    ):
        torch.testing.assert_close(got.float(), want.float(), atol=5 * tol, rtol=0)
    for lse_only in (True, False):
        case = [t.cuda() for t in lse_grad_case(8, 2, 72, seed=5, lse_only=lse_only)]
        check_block_kernel(get_kernel(name), dtype, causal, case)


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())


def test_plan_imports_no_torch_and_core_kernels_import_no_runtime() -> None:
    assert not any(m == "torch" or m.startswith("torch.") for m in _modules_after_import("mesh_cp.core.plan"))
    for module in ("mesh_cp.core.numerics", "mesh_cp.kernels", "mesh_cp"):
        loaded = _modules_after_import(module)
        assert not any(m.startswith("mesh_cp.runtime") for m in loaded), module
