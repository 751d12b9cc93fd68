"""The LSE merge and ``out_for_delta`` compiled into one pass each (Note [Fused passes], :mod:`mesh_cp.kernels.fused`):
compiled on CPU under ``MESH_CP_FUSED=1`` they equal the eager functions (in place through views, empty rows, a bf16
partial, zero rows of ``dO``) without a recompile for new row counts; by default they run eagerly on CPU; a compiled
path that fails falls back to the eager function once, saying why; a bad ``MESH_CP_FUSED`` is refused by name."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from mesh_cp.core import numerics
from mesh_cp.kernels import fused
from mesh_cp.kernels.base import _out_for_delta, out_for_delta


def merge_case(batch: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Accumulators of ``rows + 4`` rows and a bf16 partial for the middle ``rows``, with empty rows on either side and
    on both."""
    gen = torch.Generator().manual_seed(seed)
    o_acc, lse_acc = torch.randn(batch, rows + 4, 4, 8, generator=gen), torch.randn(batch, 4, rows + 4, generator=gen)
    o_new, lse_new = (
        torch.randn(batch, rows, 4, 8, generator=gen).bfloat16(),
        torch.randn(batch, 4, rows, generator=gen),
    )
    lse_acc[0, 1, 3] = lse_new[0, 1, 1] = float("-inf")  # the same row empty on both sides
    lse_acc[0, 2, 4] = float("-inf")  # empty before
    o_acc[0, 4, 2] = 0
    lse_new[0, 3, 0] = float("-inf")  # empty partial
    o_new[0, 0, 3] = 0
    return o_acc, lse_acc, o_new, lse_new


@pytest.fixture
def compiled(monkeypatch):
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:  # CUDA compiles with Triton; Inductor's CPU code needs a C++ compiler
        pytest.skip(f"compiling on CPU needs a C++ compiler for Inductor: {compiler!r} (or $CXX) is not installed")
    monkeypatch.setenv(fused.ENV, "1")
    for f in (fused.merge_, fused.merged, fused.attention_delta, _out_for_delta):
        monkeypatch.setattr(f, "compiled", None)
        monkeypatch.setattr(f, "failed", None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_passes_equal_the_eager_ones(compiled) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    for batch, rows, seed in ((2, 6, 0), (2, 9, 1), (2, 17, 2)):  # new row counts reuse the compiled code
        o_acc, lse_acc, o_new, lse_new = merge_case(batch, rows, seed)
        got, got_lse = o_acc.clone(), lse_acc.clone()
        fused.merge_(got[:, 2 : 2 + rows], got_lse[:, :, 2 : 2 + rows], o_new, lse_new)
        assert fused.merge_.failed is None and fused.merge_.compiled is not None
        numerics.merge_(o_acc[:, 2 : 2 + rows], lse_acc[:, :, 2 : 2 + rows], o_new, lse_new)
        torch.testing.assert_close(got, o_acc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_lse, lse_acc, rtol=1e-6, atol=1e-6)  # -inf where both are empty
        assert torch.isneginf(got_lse[0, 1, 3]) and (got[0, 3, 1] == 0).all()
        gen = torch.Generator().manual_seed(seed)
        do, delta = torch.randn(batch, rows, 4, 8, generator=gen).bfloat16(), torch.randn(batch, 4, rows, generator=gen)
        do[0, 3], delta[0, :, 3] = 0, 0
        do[1, 1] *= 1e-30  # underflows bf16's |do|^2 unless scaled first
        got = _out_for_delta(do, delta)
        assert _out_for_delta.failed is None and _out_for_delta.compiled is not None
        want = out_for_delta(do, delta)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)  # one bf16 rounding apart at most
        torch.testing.assert_close(numerics.attention_delta(do, got), delta, rtol=2e-2, atol=1e-5)
        out, dlse = torch.randn(do.shape, generator=gen).bfloat16(), torch.randn(delta.shape, generator=gen)
        for lse_grad in (None, dlse):  # the rows' delta, with and without a gradient of the lse
            got = fused.attention_delta(do, out, lse_grad)
            assert fused.attention_delta.failed is None and fused.attention_delta.compiled is not None
            torch.testing.assert_close(got, numerics.attention_delta(do, out, lse_grad), rtol=1e-5, atol=1e-5)
        o_acc, lse_acc, o_new, lse_new = merge_case(batch, rows, seed + 10)
        o1, lse1 = o_acc[:, 2 : 2 + rows], lse_acc[:, :, 2 : 2 + rows]
        got_o, got_lse = fused.merged(o1, lse1, o_new, lse_new, torch.bfloat16)  # a final output, in bf16
        want_o, want_lse = numerics.merged(o1, lse1, o_new, lse_new)
        assert fused.merged.failed is None and fused.merged.compiled is not None and got_o.dtype == torch.bfloat16
        torch.testing.assert_close(got_o.float(), want_o, rtol=1e-2, atol=1e-6)  # one bf16 rounding apart
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    assert 4 <= counters["stats"]["unique_graphs"] <= 10, dict(counters["stats"])  # one or two per function and dlse


def test_eager_on_cpu_by_default_and_a_bad_setting_is_refused(monkeypatch) -> None:
    monkeypatch.delenv(fused.ENV, raising=False)
    monkeypatch.setattr(fused.merge_, "compiled", None)
    o_acc, lse_acc, o_new, lse_new = merge_case(1, 5, 3)
    fused.merge_(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new, lse_new)
    assert fused.merge_.compiled is None
    assert fused.compiles(torch.device("cuda")) and not fused.compiles(torch.device("cpu"))
    monkeypatch.setenv(fused.ENV, "0")
    assert not fused.compiles(torch.device("cuda"))
    monkeypatch.setenv(fused.ENV, "yes")
    with pytest.raises(ValueError, match=r"MESH_CP_FUSED='yes': use 0 \(eager everywhere\), 1 .* or leave it unset"):
        fused.merge_(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new, lse_new)


def test_a_failing_compiled_pass_falls_back_once_and_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setenv(fused.ENV, "1")
    calls = []

    def broken(*args):
        calls.append(len(args))
        raise torch._dynamo.exc.BackendCompilerFailed(broken, RuntimeError("no working Triton"), None)

    f = fused.Fused(numerics.merge_)
    monkeypatch.setattr(f, "compiled", broken)
    o_acc, lse_acc, o_new, lse_new = merge_case(1, 5, 4)
    want, want_lse = o_acc.clone(), lse_acc.clone()
    numerics.merge_(want[:, 2:7], want_lse[:, :, 2:7], o_new, lse_new)
    with caplog.at_level(logging.WARNING, logger="mesh_cp"):
        for _ in range(2):
            got, got_lse = o_acc.clone(), lse_acc.clone()
            f(got[:, 2:7], got_lse[:, :, 2:7], o_new, lse_new)
            assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert calls == [4] and f.failed.startswith("BackendCompilerFailed") and "no working Triton" in f.failed
    warnings = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "merge_" in warnings[0] and "no working Triton" in warnings[0], warnings


def test_many_signatures_stay_compiled(compiled, caplog) -> None:
    """Accumulators in fp32 and fp64, partials in every dtype, views and whole tensors, batches of 1 and 2: more
    signatures than Dynamo's default recompile limit, all compiled (Note [Fused passes]: the limit is raised for
    these calls only). Dynamo's own backend stands in for Inductor (the limit is Dynamo's; Inductor's code is the
    first test's)."""
    import torch._dynamo.config
    from torch._dynamo.testing import CompileCounter

    assert fused._dynamo_config() is torch._dynamo.config and torch._dynamo.config.recompile_limit == 8
    counter = CompileCounter()
    fused.merge_.compiled = torch.compile(numerics.merge_, backend=counter, dynamic=True, fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="mesh_cp"):
        for acc in (torch.float32, torch.float64):
            for new in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                for batch in (1, 2):
                    o_acc, lse_acc, o_new, lse_new = (t.to(acc) for t in merge_case(batch, 5, 6))
                    want, want_lse = o_acc.clone(), lse_acc.clone()
                    numerics.merge_(want[:, 2:7], want_lse[:, :, 2:7], o_new.to(new), lse_new)
                    fused.merge_(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new.to(new), lse_new)
                    torch.testing.assert_close(o_acc, want, rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(lse_acc, want_lse, rtol=1e-6, atol=1e-6)
    assert fused.merge_.failed is None and not [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert counter.frame_count > 8, counter.frame_count
    assert torch._dynamo.config.recompile_limit == 8  # restored after each call


def test_a_call_under_a_dispatch_mode_runs_eagerly_and_keeps_the_compiled_path(compiled) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    o_acc, lse_acc, o_new, lse_new = merge_case(2, 5, 7)
    with FlopCounterMode(display=False):
        fused.merge_(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new, lse_new)
    assert fused.merge_.compiled is None and fused.merge_.failed is None
    fused.merge_(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new, lse_new)
    assert fused.merge_.compiled is not None and fused.merge_.failed is None


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("Triton Error")]
)
def test_an_error_of_the_compiled_code_is_raised_not_taken_for_a_failed_compile(monkeypatch, error) -> None:
    """Out of memory, or a kernel that fails after others wrote into the accumulators: raised as it is, without the
    eager merge run over what the compiled code may have merged already."""
    monkeypatch.setenv(fused.ENV, "1")

    def merges_then_fails(*args):
        numerics.merge_(*args)
        raise error

    f = fused.Fused(numerics.merge_)
    monkeypatch.setattr(f, "compiled", merges_then_fails)
    o_acc, lse_acc, o_new, lse_new = merge_case(1, 5, 8)
    want, want_lse = o_acc.clone(), lse_acc.clone()
    numerics.merge_(want[:, 2:7], want_lse[:, :, 2:7], o_new, lse_new)
    with pytest.raises(type(error), match=str(error)[:20]):
        f(o_acc[:, 2:7], lse_acc[:, :, 2:7], o_new, lse_new)
    assert f.failed is None and torch.equal(o_acc, want) and torch.equal(lse_acc, want_lse)  # merged once
