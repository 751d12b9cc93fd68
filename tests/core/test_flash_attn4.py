"""The FlashAttention 4 kernel against its emulation (:mod:`mesh_cp.testing.fa4_emulation`) and the reference kernel:
dense, GQA, odd lengths, plain segments read in place (gaps, windows), laid segments gathered, softcap, fp16 and bf16,
head dims 64, 128 and one padded; a gradient on the lse or not; what ``"auto"`` and the reasons say on emulated GPUs."""

from __future__ import annotations

import sys

import pytest
import torch

import mesh_cp.kernels as kernels
from mesh_cp.kernels.flash_attn4 import FlashAttn4Kernel, in_place_calls, version_key
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.testing import fa4_emulation

REF = ReferenceKernel()
CUDA0 = torch.device("cuda", 0)
LOW = (torch.bfloat16, torch.float16)


@pytest.fixture
def fa4():
    kernels.forget_choices()
    with fa4_emulation.installed(arch=90) as emulation:
        yield emulation
    kernels.forget_choices()


def _case(b, sq, sk, heads, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(b, sk, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(b, sq, heads, dim, generator=gen).to(dtype)
    do[:, 1] = 0  # a row whose gradient reaches only its lse
    dlse = torch.randn(b, heads, sq, generator=gen, dtype=torch.float64)
    return q, k, v, do, dlse


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, name
    assert not torch.isnan(got).any(), f"{name}: nan (a row no call wrote)"
    blind = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), blind), f"{name}: -inf rows differ"
    got, want = got.double().masked_fill(blind, 0), want.masked_fill(blind, 0)
    tol = 4 * torch.finfo(dtype).eps * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= tol, f"{name}: error {err:.3g} against the fp64 reference, allowed {tol:.3g}"


def check(kernel, case, *, causal=False, lse_grad: bool, scale=0.3, **extra) -> None:
    """``kernel``'s forward and backward against the reference kernel in fp64 on the same (rounded) inputs, with the
    same ``delta`` (``dlse`` on every row with ``lse_grad``, none without)."""
    q, k, v, do, dlse = case
    wide = [t.double() for t in (q, k, v, do)]
    want_out, want_lse = REF.forward(*wide[:3], causal=causal, scale=scale, **extra)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, **extra)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == want_lse.shape
    _close("out", out, want_out, q.dtype)
    _close("lse", lse, want_lse, torch.float32)
    delta = (wide[3] * want_out).sum(-1).transpose(1, 2) - (dlse if lse_grad else 0)
    stats = (want_lse.float(), delta.float())
    got = kernel.backward(do, q, k, v, *stats, causal=causal, scale=scale, lse_grad=lse_grad, **extra)
    want = REF.backward(wide[3], *wide[:3], *(s.double() for s in stats), causal=causal, scale=scale, **extra)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        _close(name, g, w, q.dtype)


DENSE = [  # (batch, sq, sk, heads, kv_heads, dim, causal)
    (2, 12, 12, 4, 4, 64, True),
    (1, 10, 14, 4, 4, 64, False),
    (2, 9, 9, 8, 2, 64, True),
    (1, 7, 11, 8, 2, 128, False),
    (1, 8, 8, 2, 1, 36, True),  # padded to 40
]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("shape", DENSE, ids=lambda s: "x".join(map(str, s)))
def test_dense_matches_the_reference(fa4, dtype, lse_grad, shape) -> None:
    *dims, causal = shape
    check(FlashAttn4Kernel.without_device_check(), _case(*dims, dtype), causal=causal, lse_grad=lse_grad)
    fwd, bwd = (a for _, a in fa4.calls)
    assert fwd["return_lse"] and fwd["cu_seqlens_q"] is None and fwd["causal"] is causal
    assert bwd["dlse"] is not None and bool((bwd["out"] == 0).all())  # D = 0 - dlse: delta exactly


# Per batch row: gaps between the segments on both sides (row 0: keys 0, 5-6, 12, 17-19 in none), three windows.
GAPS = (
    ((0, 3, 1, 5, -1, -1), (4, 8, 7, 12, -1, -1), (9, 13, 13, 17, 1, 0)),
    ((1, 5, 0, 6, 2, 1), (6, 12, 8, 16, -1, -1)),
)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 128)])
def test_segments_with_gaps_are_read_in_place(fa4, dtype, lse_grad, heads, kv_heads, dim) -> None:
    case = _case(2, 14, 20, heads, kv_heads, dim, dtype, seed=1)
    check(FlashAttn4Kernel.without_device_check(), case, segments=GAPS, lse_grad=lse_grad)
    k = case[1]
    assert len(fa4.calls) == 6  # three windows, forward and backward
    for _, a in fa4.calls:
        # the flat K itself, no gathered rows; the sequences start where the segments do
        assert a["k"].data_ptr() == k.data_ptr() and a["k"].shape == (2 * 20, kv_heads, dim)
        assert a["cu_seqlens_k"].dtype == torch.int32
    first = fa4.calls[0][1]
    assert first["cu_seqlens_k"].tolist() == [1, 7, 28, 36] and first["seqused_k"].tolist() == [4, 5, 8]
    assert first["cu_seqlens_q"].tolist() == [0, 4, 20, 26] and first["seqused_q"].tolist() == [3, 4, 6]
    assert (first["window_size_left"], first["window_size_right"]) == (None, None)


def test_adjacent_segments_need_no_seqused(fa4) -> None:
    segments = (((0, 4, 0, 6, -1, -1), (4, 8, 6, 8, -1, -1)),)
    check(
        FlashAttn4Kernel.without_device_check(),
        _case(3, 8, 8, 4, 4, 64, torch.bfloat16),
        segments=segments,
        lse_grad=True,
    )
    for _, a in fa4.calls:
        assert a["seqused_q"] is None and a["seqused_k"] is None
        assert a["cu_seqlens_k"].tolist() == [0, 6, 8, 14, 16, 22, 24]


def test_laid_segments_of_one_run_of_keys_are_read_in_place(fa4) -> None:
    touching = (((0, 4, ((0, 2), (2, 5)), -1, -1), (5, 9, ((6, 9),), -1, 1)),)
    case = _case(2, 10, 12, 4, 2, 64, torch.bfloat16, seed=4)
    check(FlashAttn4Kernel.without_device_check(), case, segments=touching, lse_grad=True)
    assert all(a["k"].data_ptr() == case[1].data_ptr() for _, a in fa4.calls)
    assert fa4.calls[0][1]["cu_seqlens_k"].tolist() == [0, 12, 17] and fa4.calls[0][1]["seqused_k"].tolist() == [5, 5]


LAID = (((0, 4, ((0, 3), (6, 9)), -1, -1), (5, 9, ((2, 5), (7, 10)), -1, 2), (10, 12, 11, 14, -1, -1)),)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("lse_grad", [False, True])
def test_laid_segments_are_gathered(fa4, dtype, lse_grad) -> None:
    case = _case(2, 12, 14, 8, 2, 64, dtype, seed=2)
    check(FlashAttn4Kernel.without_device_check(), case, segments=LAID, lse_grad=lse_grad)
    assert fa4.calls and all(a["seqused_k"] is None for _, a in fa4.calls)
    assert all(a["k"].data_ptr() != case[1].data_ptr() for _, a in fa4.calls)  # gathered rows


@pytest.mark.parametrize("lse_grad", [False, True])
@pytest.mark.parametrize("segments", [None, GAPS, LAID], ids=["dense", "gaps", "laid"])
def test_softcap(fa4, lse_grad, segments) -> None:
    batch = 1 if segments is LAID else 2
    case = _case(batch, 14, 20, 4, 2, 64, torch.bfloat16, seed=3)
    extra = {"softcap": 2.0} if segments is None else {"softcap": 2.0, "segments": segments}
    check(FlashAttn4Kernel.without_device_check(), case, lse_grad=lse_grad, **extra)
    assert {a["softcap"] for _, a in fa4.calls} == {2.0}


def test_plans_are_cached_int32_and_refuse_causal(fa4) -> None:
    q, k = torch.zeros(2, 14, 1, 8), torch.zeros(2, 20, 1, 8)
    calls = in_place_calls(GAPS, q, k, False)
    assert calls is in_place_calls(GAPS, q, k, False) and len(calls) == 3
    assert all(c.cu_seqlens_q.dtype == c.cu_seqlens_k.dtype == torch.int32 for c in calls)
    assert calls[0].seqused_q.dtype == torch.int32 and calls[1].seqused_q is None  # one sequence: no gap
    assert in_place_calls(LAID, q[:1], k[:1], False) is None
    with pytest.raises(ValueError, match="causal=True with segments"):
        in_place_calls(GAPS, q, k, True)


def test_emulation_refuses_what_the_real_interface_asserts(fa4) -> None:
    fa = sys.modules["flash_attn.cute.interface"]
    q, k, v, do, _ = _case(1, 8, 8, 2, 2, 64, torch.bfloat16)
    with pytest.raises(AssertionError, match="int32"):
        fa._flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 8]))
    with pytest.raises(AssertionError, match="float16 or bfloat16"):
        fa._flash_attn_fwd(q.float(), k.float(), v.float())
    out, lse, *_ = fa._flash_attn_fwd(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="softcap must be a float"):
        fa._flash_attn_bwd(q, k, v, out, do, lse, softcap=None)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(AssertionError, match="over max_seqlen"):
        fa._flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=4)
    fa4.arch = 100
    with pytest.raises(AssertionError, match="not supported on SM100"):
        fa._flash_attn_fwd(*(torch.zeros(1, 8, 2, 160, dtype=torch.bfloat16) for _ in range(3)))


def test_absent_or_old_flash_attn_4_is_named(monkeypatch) -> None:
    kernels.forget_choices()
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    why = FlashAttn4Kernel.not_supported_reasons(torch.device("cpu"), torch.bfloat16, 64)
    assert any("pip install 'flash-attn-4>=" in r for r in why) and any("needs CUDA" in r for r in why)
    with fa4_emulation.installed(version="4.0.0b23"):
        assert any(
            "flash-attn-4 is 4.0.0b23; mesh_cp needs >= 4.0.0b24" in r
            for r in FlashAttn4Kernel.not_supported_reasons(torch.device("cpu"), torch.bfloat16, 64)
        )
    assert version_key("4.0.0") > version_key("4.0.0b36") > version_key("4.0.0.beta24") > version_key("4.0.0b5")


def _emulate_cuda(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize(
    ("capability", "head_dim", "chosen"),
    [
        ((9, 0), 128, "flash_attn4"),
        ((9, 0), 256, "flash_attn4"),
        ((10, 0), 128, "flash_attn4"),
        ((10, 0), 256, None),
        ((8, 0), 128, None),
    ],
)
def test_auto_puts_flash_attn_4_first_on_hopper_and_blackwell(monkeypatch, fa4, capability, head_dim, chosen) -> None:
    _emulate_cuda(monkeypatch, capability)
    assert kernels.candidates(CUDA0, torch.bfloat16)[0] == ("flash_attn4" if capability[0] in (9, 10) else "flash_attn")
    name, reason = kernels.choose(CUDA0, torch.bfloat16, head_dim, needs=("mask|segments", "softcap"))
    if chosen:
        assert name == chosen
    else:
        assert name != "flash_attn4"
        assert ("flash_attn4: head_dim 256 > 128 on compute capability 10.x" in reason) == (capability[0] == 10)


def test_auto_offers_flash_attn_4_only_where_installed_and_names_what_is_wrong(monkeypatch) -> None:
    kernels.forget_choices()
    _emulate_cuda(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "flash_attn4" not in kernels.candidates(CUDA0, torch.float16)
    with fa4_emulation.installed(version="4.0.0b23"):
        kernels.forget_choices()
        name, reason = kernels.choose(CUDA0, torch.float16, 64)
    assert name != "flash_attn4" and "(flash_attn4: flash-attn-4 is 4.0.0b23; mesh_cp needs >= 4.0.0b24" in reason
    kernels.forget_choices()
