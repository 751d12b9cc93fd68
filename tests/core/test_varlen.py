"""Masked tiles as flash-attn varlen sequences ("segments", :mod:`mesh_cp.kernels.varlen`): the dense mask against
the window rule, the calls against the windows the C++ applies, and ``flash_attn`` (every emulated release, with
softcap) and ``cuda_flash`` (emulated ATen ops, meta tensors) against the reference kernel."""

from __future__ import annotations

import random

import pytest
import torch

from mesh_cp.core.numerics import attention_delta, expand_kv
from mesh_cp.kernels import cuda_flash, varlen
from mesh_cp.kernels.cpu_flash import CpuFlashKernel
from mesh_cp.kernels.cuda_flash import CudaFlashKernel
from mesh_cp.kernels.flash_attn import FlashAttnKernel
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.kernels.varlen import segments_mask, varlen_plan
from tests.core.test_kernel_emulation import FAKES, LOW, EmulatedCudaAttention, flash_window, install_flash_attn
from tests.core.test_kernels import LOW_PRECISION_FLOOR

REF = ReferenceKernel()
SQ, SK = 14, 11
CPU = torch.device("cpu")

# Row 0: a tall segment with a left bound and no right bound (its queries outnumber the keys + 1, so the call's
# max_seqlen_k must be raised: Note [Varlen windows]) beside a causal-like band; row 1: nothing in this tile.
FIXED = (((0, 9, 0, 3, 0, -1), (10, 12, 5, 11, 2, 0)), ())


def window_rule(segments, sq: int, sk: int) -> torch.Tensor:
    """The docstring rule of flash_attn_varlen_func, element by element: query ``i`` of a sequence sees key ``j``
    iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (``-1``: no bound on that side); a sequence of five,
    ``(q0, q1, key ranges, left, right)``, reads ``j`` on its key ranges laid end to end (Note [Laid keys])."""
    mask = torch.zeros(len(segments), 1, sq, sk, dtype=torch.bool)
    for b, row in enumerate(segments):
        for q0, q1, *keys, left, right in row:
            cols = [c for k0, k1 in ([keys] if len(keys) == 2 else keys[0]) for c in range(k0, k1)]
            n, m = q1 - q0, len(cols)
            for i in range(n):
                for j, col in enumerate(cols):
                    mask[b, 0, q0 + i, col] = (left < 0 or j >= i + m - n - left) and (
                        right < 0 or j <= i + m - n + right
                    )
    return mask


def _ranges(rng: random.Random, size: int) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-empty ranges in ``[0, size)``, touching or with gaps."""
    out, at = [], 0
    while True:
        start = at + rng.choice((0, 0, 1, 2))
        stop = start + rng.randint(1, 6)
        if stop > size:
            return out
        out.append((start, stop))
        at = stop


def random_segments(seed: int, rows: int = 2, sq: int = SQ, sk: int = SK, empty_row: int | None = None):
    """Random segments of a ``sq`` x ``sk`` tile: random windows (a right side made large enough that every query
    sees a key), different per row; row ``empty_row`` has none."""
    rng = random.Random(seed)
    segments = []
    for row in range(rows):
        pairs = list(zip(_ranges(rng, sq), _ranges(rng, sk), strict=False))
        segs = []
        for (q0, q1), (k0, k1) in pairs:
            left, right = rng.choice((-1, 0, 1, 2, 4, 9)), rng.choice((-1, -1, 0, 1, 3))
            if right >= 0:
                right = max(right, (q1 - q0) - (k1 - k0))
            segs.append((q0, q1, k0, k1, left, right))
        segments.append(() if row == empty_row else tuple(segs))
    return tuple(segments)


# Laid keys (Note [Laid keys]): key ranges laid end to end, a key in several segments (key 1 of row 0 in three), a
# plain segment among laid ones, causal and left bands read on the laid order.
LAID = (
    (
        (0, 3, ((0, 2), (5, 7)), -1, -1),
        (3, 6, 1, 4, -1, 0),
        (6, 10, ((0, 2), (4, 5), (8, 11)), -1, 0),
        (11, 14, ((3, 4), (6, 10)), 2, -1),
    ),
    ((2, 5, ((0, 3), (7, 9)), -1, 0), (5, 9, ((0, 3), (7, 9)), -1, -1)),
)

CASES = {
    "fixed": FIXED,
    "random": random_segments(1),
    "random, empty row": random_segments(4, empty_row=0),
    "laid keys": LAID,
}


def test_segments_mask_is_the_flash_attn_window_rule() -> None:
    for seed in range(60):
        segments = random_segments(seed, rows=3, empty_row=seed % 4 if seed % 4 < 3 else None)
        assert torch.equal(segments_mask(segments, SQ, SK), window_rule(segments, SQ, SK)), segments
    assert torch.equal(segments_mask(FIXED, SQ, SK), window_rule(FIXED, SQ, SK))


def _plan_mask(plan: varlen.VarlenPlan, batch: int) -> torch.Tensor:
    """The dense mask the plan's calls give on the kernels, with the windows the C++ makes of them."""
    mask = torch.zeros(batch * SQ, batch * SK, dtype=torch.bool)
    for call in plan.calls:
        cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        for n in range(len(cu_q) - 1):
            rows, cols = call.q_rows[cu_q[n] : cu_q[n + 1]], call.k_rows[cu_k[n] : cu_k[n + 1]]
            seen = flash_window(len(rows), len(cols), call.max_seqlen_k, False, *call.window)
            mask[rows[:, None], cols[None, :]] = seen
    return torch.stack([mask[b * SQ : (b + 1) * SQ, b * SK : (b + 1) * SK] for b in range(batch)]).unsqueeze(1)


def test_calls_give_the_segments_mask_under_the_windows_the_cpp_applies() -> None:
    """Canonical windows and the raised max_seqlen_k (Note [Varlen windows]) make every call exact."""
    for seed in range(60):
        segments = random_segments(seed, rows=3)
        plan = varlen_plan(segments, SQ, SK, CPU)
        assert torch.equal(_plan_mask(plan, 3), window_rule(segments, SQ, SK)), segments
        assert len({c.window for c in plan.calls}) == len(plan.calls)
        for call in plan.calls:
            assert call.cu_seqlens_q.dtype == call.cu_seqlens_k.dtype == torch.int32
            lengths = call.cu_seqlens_k.diff()
            assert call.max_seqlen_k >= lengths.max() and call.max_seqlen_q == call.cu_seqlens_q.diff().max()
    # The tall segment of FIXED: with max_seqlen_k = sk = 3 its unbounded right side would become the bound 3.
    assert not torch.equal(flash_window(9, 3, 3, False, 0, -1), window_rule((((0, 9, 0, 3, 0, -1),),), 9, 3)[0, 0])
    plan = varlen_plan(FIXED, SQ, SK, CPU)
    assert [(c.window, c.max_seqlen_q, c.max_seqlen_k) for c in plan.calls] == [((0, -1), 9, 8), ((2, 0), 2, 6)]
    assert torch.equal(_plan_mask(plan, 2), window_rule(FIXED, SQ, SK))


def test_rows_between_sequences_are_read_in_place() -> None:
    """Plain sequences of one window with keys between them (a chunk call's row groups over the layout's sections):
    one call reading every key in order, no gather, through sequences of no queries over the rows between and after
    them (Note [Sequences without queries]); a one-row sequence joins the causal ones. The calls give the rule, and
    the cuda_flash kernel on the emulated ops is exact on them."""
    segments = ((0, 3, 2, 5, -1, 0), (3, 6, 7, 10, -1, 0), (6, 7, 10, 11, -1, 0)), ((1, 4, 0, 4, -1, 0),)
    plan = varlen_plan(segments, SQ, SK, CPU)
    assert plan.whole == (False, True) and len(plan.calls) == 1
    (call,) = plan.calls
    assert call.cu_seqlens_q.tolist() == [0, 0, 3, 3, 6, 7, 10, 10]
    assert call.cu_seqlens_k.tolist() == [0, 2, 5, 7, 10, 11, 15, 22]
    assert torch.equal(_plan_mask(plan, 2), window_rule(segments, SQ, SK))
    kernel = CudaFlashKernel.without_device_check()
    with EmulatedCudaAttention():
        for lse_grad in (False, True):
            case = make_case(4, 2, 64, seed=3, lse_grad=lse_grad)
            check_segments_kernel(kernel, torch.bfloat16, case, segments, lse_grad=lse_grad)


def test_laid_keys_give_the_rule_on_their_order_and_sum_the_gradients_of_a_key() -> None:
    """Laid segments: the dense mask and the plan's calls (the windows the C++ makes of them) give the window rule
    read on the laid keys; a key laid three times has three gather rows, the others point at the row of zeros."""
    want = window_rule(LAID, SQ, SK)
    assert torch.equal(segments_mask(LAID, SQ, SK), want)
    plan = varlen_plan(LAID, SQ, SK, CPU)
    assert torch.equal(_plan_mask(plan, 2), want)
    laid = sum(len(c.k_rows) for c in plan.calls)
    assert plan.k_back.shape == (3, 2 * SK) and plan.kv_back.shape == (3, 4 * SK)
    assert (plan.k_back[:, 1] < laid).all() and (plan.k_back[:2, 0] < laid).all() and plan.k_back[2, 0] == laid
    assert (plan.k_back[:, SK + 10] == laid).all()  # key 10 of row 1 is in no segment
    rows = torch.cat([c.k_rows for c in plan.calls])
    for slot in range(3):
        hit = plan.k_back[slot] < laid
        assert torch.equal(rows[plan.k_back[slot][hit]], torch.arange(2 * SK)[hit])
    laid_broken = {
        r"must be non-empty, sorted and disjoint": (((0, 2, ((0, 3), (2, 4)), -1, -1),),),
        r"is not six ints \(q0, q1, k0, k1, left, right\) or \(q0, q1, \(\(k0, k1\), \.\.\.\), left, right\)": (
            ((0, 2, ((0, 3, 4),), -1, -1),),
        ),
        r"first query sees no key": (((0, 6, ((0, 1), (3, 4)), -1, 1),),),
    }
    for message, segments in laid_broken.items():
        with pytest.raises(ValueError, match=message):
            varlen_plan(segments, SQ, SK, CPU, batch=1)


def test_plan_is_cached_broadcasts_one_row_and_refuses_broken_segments() -> None:
    assert varlen_plan(FIXED, SQ, SK, CPU) is varlen_plan(FIXED, SQ, SK, torch.device("cpu"))
    one_row = (FIXED[0],)
    plan = varlen_plan(one_row, SQ, SK, CPU, batch=3)
    assert torch.equal(_plan_mask(plan, 3), window_rule(one_row * 3, SQ, SK))
    broken = {
        r"segments has 3 rows, the batch has 2": ((), (), ()),
        r"must be non-empty, sorted and disjoint": (((0, 4, 0, 4, -1, -1), (3, 6, 5, 6, -1, -1)),),
        r"first query sees no key \(right < sq - sk\)": (((0, 6, 0, 2, -1, 1),),),
        r"window sides are >= 0, or -1": (((0, 2, 0, 2, -2, -1),),),
        r"is not six ints": (((0, 2, 0, 2, -1),),),
    }
    for message, segments in broken.items():
        with pytest.raises(ValueError, match=message):
            varlen_plan(segments, SQ, SK, CPU, batch=2)
    q = torch.zeros(2, SQ, 2, 8)
    with pytest.raises(ValueError, match=r"causal=True with segments: .*pass causal=False"):
        varlen.plan_for(q, q[:, :SK], FIXED, causal=True)


def test_kernels_declare_what_they_take() -> None:
    assert FlashAttnKernel.capabilities.keywords == {"segments", "softcap"}
    assert CudaFlashKernel.capabilities.keywords == {"segments"}
    assert ReferenceKernel.capabilities.keywords == {"mask", "segments", "softcap"}
    assert CpuFlashKernel.capabilities.keywords == {"mask"}


# --- exactness against the reference ------------------------------------------------------------


def dense_attention(q, k, v, mask, scale: float, softcap: float | None):
    """Differentiable masked attention (``mask (B or 1, 1, Sq, Sk)``) in the inputs' dtype: ``out`` and ``lse``,
    ``0`` and ``-inf`` on queries that see no key (whose gradients are then zero)."""
    heads = q.shape[2]
    qh, kh, vh = q.transpose(1, 2), expand_kv(k, heads).transpose(1, 2), expand_kv(v, heads).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = mask.expand(scores.shape)
    some = seen.any(-1, keepdim=True)
    scores = scores.masked_fill(~seen, float("-inf")).masked_fill(~some, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(~some[..., 0], float("-inf"))
    out = (torch.softmax(scores, -1) @ vh).masked_fill(~some, 0.0)
    return out.transpose(1, 2), lse


def make_case(heads: int, kv_heads: int, dim: int, *, seed: int, lse_grad: bool):
    """fp64 ``q, k, v, do, dlse``; with ``lse_grad`` ``do`` has a zero row and a tiny row (Note [Gradient of the
    lse]), without it ``dlse`` is zero."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, SQ, heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, SK, kv_heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, SQ, heads, dim, generator=gen, dtype=torch.float64)
    dlse = torch.randn(2, heads, SQ, generator=gen, dtype=torch.float64) * 3
    if lse_grad:
        do[:, 3] = 0
        do[:, 5] *= 1e-6
    else:
        dlse.zero_()
    return q, k, v, do, dlse


def _covered_keys(segments, batch: int) -> torch.Tensor:
    keys = torch.zeros(batch, SK, dtype=torch.bool)
    for b in range(batch):
        for seg in segments[b if len(segments) > 1 else 0]:
            for k0, k1 in varlen.laid(seg)[2]:
                keys[b, k0:k1] = True
    return keys


def check_segments_kernel(kernel, dtype, case, segments, *, lse_grad: bool, softcap=None, causal=False, scale=0.3):
    """``kernel`` on a tile with ``segments`` (or a plain ``causal`` / full tile with ``segments=None``): forward and
    backward in ``dtype`` against fp64 autograd of :func:`dense_attention`, within twice the error of that autograd
    in ``dtype`` (check_block_kernel's rule), and its gradients against the reference kernel on the same inputs.
    Queries in no segment must get exactly ``out = 0``, ``lse = -inf``, ``dq = 0``; keys in none ``dk = dv = 0``."""
    q, k, v, do, dlse = case
    if segments is None:
        mask = torch.ones(SQ, SK, dtype=torch.bool).tril() if causal else torch.ones(SQ, SK, dtype=torch.bool)
        mask, extra = mask[None, None], {}
    else:
        mask, extra = segments_mask(segments, SQ, SK), {"segments": segments}
    if softcap is not None:
        extra["softcap"] = softcap
    covered = mask.any(-1).expand(2, q.shape[2], SQ)
    dlse = dlse * covered

    def run(prec):
        leaves = [t.to(prec).clone().requires_grad_() for t in (q, k, v)]
        out, lse = dense_attention(*leaves, mask, scale, softcap)
        ((out * do.to(prec)).sum() + (lse.masked_fill(~covered, 0) * dlse.to(lse.dtype)).sum()).backward()
        return [t.double() for t in (out.detach(), lse.detach(), *(leaf.grad for leaf in leaves))]

    exact, plain = run(torch.float64), run(dtype)
    qd, kd, vd, dod = (t.to(dtype) for t in (q, k, v, do))
    out, lse = kernel.forward(qd, kd, vd, causal=causal, scale=scale, **extra)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == covered.shape
    assert torch.equal(torch.isneginf(lse), ~covered) and not torch.isnan(lse).any()
    delta = attention_delta(dod, out) - dlse.float()
    got = kernel.backward(dod, qd, kd, vd, lse, delta, causal=causal, scale=scale, lse_grad=lse_grad, **extra)
    spec = REF.backward(dod, qd, kd, vd, lse, delta, causal=causal, scale=scale, **extra)
    lse_f, exact[1], plain[1] = (t.masked_fill(~covered, 0) for t in (lse.double(), exact[1], plain[1]))
    for name, g, want, low, ref in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse_f, *got), exact, plain, (None, None, *spec), strict=True
    ):
        assert g.shape == want.shape and torch.isfinite(g).all(), name
        tol = 2 * (low - want).abs().max().item() + LOW_PRECISION_FLOOR[dtype] * max(1.0, want.abs().max().item())
        err = (g.double() - want).abs().max().item()
        assert err <= tol, f"{name}: error {err:.3g} against fp64 autograd, allowed {tol:.3g}"
        if ref is not None:
            err_ref = (g.double() - ref.double()).abs().max().item()
            assert err_ref <= tol, f"{name}: {err_ref:.3g} from the reference kernel, allowed {tol:.3g}"
    rows = covered[:, 0]  # (B, Sq)
    keys = _covered_keys(segments, 2) if segments is not None else torch.ones(2, SK, dtype=torch.bool)
    assert (out[~rows] == 0).all() and (got[0][~rows] == 0).all()
    assert (got[1][~keys] == 0).all() and (got[2][~keys] == 0).all()


@pytest.mark.parametrize("version", sorted(FAKES))
@pytest.mark.parametrize("head_dim", [64, 72])
def test_flash_attn_segments_and_softcap_are_exact_on_every_private_api(monkeypatch, version, head_dim) -> None:
    install_flash_attn(monkeypatch, version)
    kernel = FlashAttnKernel.without_device_check()
    for dtype in LOW:
        for lse_grad in (False, True):
            for softcap in (None, 2.0):
                for n, segments in enumerate(CASES.values()):
                    case = make_case(4, 2, head_dim, seed=n + 10 * lse_grad, lse_grad=lse_grad)
                    check_segments_kernel(kernel, dtype, case, segments, lse_grad=lse_grad, softcap=softcap)
            # softcap on unmasked blocks (the dense private API), causal and full
            case = make_case(4, 2, head_dim, seed=7, lse_grad=lse_grad)
            for causal in (False, True):
                check_segments_kernel(kernel, dtype, case, None, lse_grad=lse_grad, softcap=1.5, causal=causal)


def test_flash_attn_lse_gradient_at_head_dim_256_goes_by_parts_with_segments_but_not_with_softcap(monkeypatch):
    install_flash_attn(monkeypatch, "2.8.3")
    kernel = FlashAttnKernel.without_device_check()
    case = make_case(4, 2, 256, seed=3, lse_grad=True)
    # fp16: by parts, dq is a difference of two bf16-rounded terms, about 1% off in bf16 with or without segments
    for segments in (FIXED, CASES["random"]):
        check_segments_kernel(kernel, torch.float16, case, segments, lse_grad=True)
    q, k, v, do, _ = (t.to(torch.bfloat16) for t in case)
    lse = torch.zeros(2, 4, SQ)
    with pytest.raises(NotImplementedError, match=r"does not hold for softcapped logits; use kernel='reference'"):
        kernel.backward(do, q, k, v, lse, lse, causal=False, scale=0.3, lse_grad=True, segments=FIXED, softcap=2.0)
    with pytest.raises(ValueError, match=r"softcap must be a positive number or None, got 0"):
        kernel.forward(q, k, v, causal=True, scale=0.3, softcap=0)


@pytest.mark.parametrize("head_dim", [64, 72])
def test_cuda_flash_segments_are_exact_on_emulated_ops(head_dim: int) -> None:
    kernel = CudaFlashKernel.without_device_check()
    with EmulatedCudaAttention() as mode:
        for dtype in LOW:
            for lse_grad in (False, True):
                for n, segments in enumerate(CASES.values()):
                    case = make_case(4, 2, head_dim, seed=n + 10 * lse_grad, lse_grad=lse_grad)
                    check_segments_kernel(kernel, dtype, case, segments, lse_grad=lse_grad)
    assert {"_flash_attention_forward.default", "_flash_attention_backward.default"} <= set(mode.ran)


def test_cuda_flash_lse_gradient_by_parts_passes_segments(monkeypatch) -> None:
    """At head_dim 192 on sm86 the delta column does not fit: three varlen calls, each with the segments."""
    monkeypatch.setattr(cuda_flash, "_capability", lambda device: (8, 6))
    kernel = CudaFlashKernel.without_device_check()
    with EmulatedCudaAttention() as mode:
        check_segments_kernel(kernel, torch.float16, make_case(4, 2, 192, seed=5, lse_grad=True), FIXED, lse_grad=True)
    assert {shape[-1] for shape in mode.backward_widths} == {192}
    assert set(mode.ran) == {"_flash_attention_forward.default", "_flash_attention_backward.default"}


def test_backward_takes_global_row_statistics(monkeypatch) -> None:
    """Rows of a longer row: lse and delta from elsewhere, finite on every row, also on rows in no segment."""
    install_flash_attn(monkeypatch, "2.7.4.post1")
    segments = CASES["random, empty row"]
    q, k, v, do, _ = (t.to(torch.bfloat16) for t in make_case(4, 2, 72, seed=9, lse_grad=True))
    _, lse_tile = REF.forward(q, k, v, causal=False, scale=0.3, segments=segments)
    gen = torch.Generator().manual_seed(0)
    lse = torch.logaddexp(lse_tile, torch.randn(lse_tile.shape, generator=gen) + 2)  # other keys of the row
    delta = torch.randn(lse.shape, generator=gen)
    want = REF.backward(do, q, k, v, lse, delta, causal=False, scale=0.3, segments=segments)
    rows, keys = segments_mask(segments, SQ, SK).any(-1)[:, 0], _covered_keys(segments, 2)
    with EmulatedCudaAttention():
        kernels = (FlashAttnKernel.without_device_check(), CudaFlashKernel.without_device_check())
        for kernel in kernels:
            got = kernel.backward(do, q, k, v, lse, delta, causal=False, scale=0.3, lse_grad=True, segments=segments)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.float(), w.float(), atol=2e-2 * w.abs().max().item(), rtol=0)
            assert (got[0][~rows] == 0).all() and (got[1][~keys] == 0).all() and (got[2][~keys] == 0).all()


def test_cuda_flash_segments_on_meta_tensors() -> None:
    """Shapes and dtypes through the real meta functions of the varlen ops (which also check the schemas)."""
    kernel = CudaFlashKernel.without_device_check()
    for dim in (64, 100):
        q, do = (torch.empty(2, SQ, 8, dim, device="meta", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.empty(2, SK, 2, dim, device="meta", dtype=torch.bfloat16) for _ in range(2))
        for segments in CASES.values():
            out, lse = kernel.forward(q, k, v, causal=False, scale=0.1, segments=segments)
            assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "meta")
            assert (lse.shape, lse.dtype) == ((2, 8, SQ), torch.float32)
            for lse_grad in (False, True):
                grads = kernel.backward(
                    do, q, k, v, lse, lse, causal=False, scale=0.1, lse_grad=lse_grad, segments=segments
                )
                assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
                assert {g.device.type for g in grads} == {"meta"}


def test_cuda_flash_refuses_a_window_where_the_op_takes_none(monkeypatch) -> None:
    monkeypatch.setattr(cuda_flash, "_op_parameters", lambda: frozenset({"query", "key", "value", "scale"}))
    kernel = CudaFlashKernel.without_device_check()
    q = torch.empty(2, SQ, 4, 64, device="meta", dtype=torch.float16)
    k = torch.empty(2, SK, 2, 64, device="meta", dtype=torch.float16)
    full = (((0, 5, 0, 3, -1, -1),), ())
    assert kernel.forward(q, k, k, causal=False, scale=0.1, segments=full)[0].shape == q.shape
    with pytest.raises(NotImplementedError, match=r"takes no window, which a masked tile with window \(0, -1\)"):
        kernel.forward(q, k, k, causal=False, scale=0.1, segments=FIXED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sdpa_masked_tiles_are_exact_on_emulated_ops(dtype: torch.dtype) -> None:
    """``cuda_sdpa`` takes a masked tile as an aligned additive bias (Note [Masked tiles in the memory-efficient
    kernel]): rows that see no key come out 0 with lse -inf and add nothing to the gradients, whatever the row's
    global lse and delta; against the reference kernel with the same boolean mask, GQA, lse gradient or not."""
    from mesh_cp.kernels.cuda_sdpa import CudaSdpaKernel

    kernel, gen = CudaSdpaKernel.without_device_check(), torch.Generator().manual_seed(5)
    q = torch.randn(2, SQ, 4, 72, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, SK, 2, 72, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, SQ, 4, 72, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 1, SQ, SK, generator=gen) < 0.4
    mask[0, 0, 3] = mask[1, 0, :2] = False  # rows that see nothing in this tile
    empty = ~mask.any(-1)
    want_out, want_lse = REF.forward(q, k, v, causal=False, scale=0.3, mask=mask)
    # Backward takes the rows' global statistics: finite, and a delta that is not 0, where the tile is empty too.
    lse = torch.where(empty, 1.5, want_lse)
    delta = torch.randn(2, 4, SQ, generator=gen, dtype=torch.float64)
    want = REF.backward(do, q, k, v, lse, delta, causal=False, scale=0.3, mask=mask)
    tol = 2e-5 if dtype == torch.float32 else 6e-2
    low = [t.to(dtype) for t in (q, k, v, do)]
    with EmulatedCudaAttention() as mode:
        out, got_lse = kernel.forward(*low[:3], causal=False, scale=0.3, mask=mask)
        grads = {
            lse_grad: kernel.backward(
                low[3], *low[:3], lse.float(), delta.float(), causal=False, scale=0.3, lse_grad=lse_grad, mask=mask
            )
            for lse_grad in (False, True)
        }
    assert {"_scaled_dot_product_efficient_attention.default"} <= set(mode.ran)
    assert (
        torch.equal(torch.isinf(got_lse), empty.expand(2, 4, SQ))
        and (out.double()[empty.transpose(1, 2)[..., 0]] == 0).all()
    )
    assert (out.double() - want_out).abs().max() < tol
    assert (got_lse.double() - want_lse)[~empty.expand(2, 4, SQ)].abs().max() < tol
    for got in grads.values():
        for g, w in zip(got, want, strict=True):
            assert torch.isfinite(g).all() and (g.double() - w).abs().max() < tol * (1 + w.abs().max()), (
                dtype,
                g.shape,
            )


def _call_attention(call: varlen.VarlenCall, q, k, v, scale: float):
    """One varlen call on its rows ``(total, H, D)`` by the windows the C++ makes (:func:`flash_window`), in the
    inputs' dtype with autograd: ``out (total_q, H, D)``, ``lse (H, total_q)``."""
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for n in range(len(cu_q) - 1):
        sq, sk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        mask[cu_q[n] : cu_q[n + 1], cu_k[n] : cu_k[n + 1]] = flash_window(
            sq, sk, call.max_seqlen_k, False, *call.window
        )
    out, lse = dense_attention(q[None], k[None], v[None], mask[None, None], scale, None)
    return out[0], lse[0]


def test_laid_keys_gradients_are_the_sum_over_their_sequences_in_fp64() -> None:
    """:func:`varlen.forward` and :func:`varlen.backward` over :data:`LAID` with exact (fp64) calls equal fp64
    autograd over the dense mask: a key laid in several sequences gets the sum of their ``dk, dv``."""
    q, k, v, do, _ = make_case(4, 2, 16, seed=11, lse_grad=False)
    plan, scale = varlen_plan(LAID, SQ, SK, CPU), 0.3

    def forward_run(call, qs, ks, vs):
        out, lse = _call_attention(call, qs, ks, vs, scale)
        return out.detach(), lse.detach()

    def backward_run(call, dos, qs, ks, vs, outs, lses):
        leaves = [t.clone().requires_grad_() for t in (qs, ks, vs)]
        out, _ = _call_attention(call, *leaves, scale)
        (out * dos).sum().backward()
        return tuple(leaf.grad for leaf in leaves)

    out, lse = varlen.forward(q, k, v, plan, forward_run)
    dq, dk, dv = varlen.backward(do, q, k, v, out, lse, plan, backward_run)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = dense_attention(*leaves, segments_mask(LAID, SQ, SK), scale, None)
    (want_out * do).sum().backward()
    torch.testing.assert_close(out, want_out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)
