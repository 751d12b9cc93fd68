"""The varlen plans and masks held within a byte budget, built in pinned memory and copied asynchronously to CUDA
(Note [Varlen plan cache] in :mod:`mesh_cp.kernels.plan_cache`).

CUDA is stood in for on the CPU by a torch function mode: ``torch.empty(..., pin_memory=True)`` is recorded and
allocated unpinned, the upload ``Tensor.to(device=cuda, ...)`` is recorded and answered with a CPU copy, and any read
of a tensor's values after that upload raises; ``torch.cuda.current_stream`` and ``torch.cuda.Event`` are fakes that
record what is waited on.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mesh_cp.kernels import plan_cache, varlen
from mesh_cp.kernels.plan_cache import BUDGET_ENV, ByteBoundedCache, budget_bytes, held_bytes

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture
def cache(monkeypatch) -> ByteBoundedCache:
    fresh = ByteBoundedCache()
    monkeypatch.setattr(varlen, "CACHE", fresh)
    return fresh


def _segments(n: int) -> varlen.Segments:
    """One tile row of two segments, told apart by ``n``."""
    return (((0, n, 0, n, -1, -1), (n, 64, n, 64, 3, 0)),)


def _plan_tensors(plan: varlen.VarlenPlan) -> list[torch.Tensor]:
    calls = [t for c in plan.calls for t in (c.q_rows, c.k_rows, c.cu_seqlens_q, c.cu_seqlens_k)]
    return [plan.q_back, plan.k_back, plan.kv_back, plan.q_covered, *calls]


def _assert_same_plan(a: varlen.VarlenPlan, b: varlen.VarlenPlan) -> None:
    assert a.whole == b.whole and len(a.calls) == len(b.calls)
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(_plan_tensors(a), _plan_tensors(b), strict=True))
    for x, y in zip(a.calls, b.calls, strict=True):
        assert (x.window, x.max_seqlen_q, x.max_seqlen_k) == (y.window, y.max_seqlen_q, y.max_seqlen_k)


def test_the_budget_evicts_the_least_recently_used_and_an_evicted_plan_is_rebuilt(monkeypatch, cache) -> None:
    one = held_bytes(_plan_tensors(varlen.varlen_plan(_segments(1), 64, 64, CPU, batch=2)))
    cache.clear()
    monkeypatch.setenv(BUDGET_ENV, str(5.5 * one / 2**20))  # room for five plans of this size
    budget = budget_bytes()
    first = varlen.varlen_plan(_segments(1), 64, 64, CPU, batch=2)
    for n in range(2, 40):
        varlen.varlen_plan(_segments(n), 64, 64, CPU, batch=2)
        varlen.segments_mask(_segments(n), 64, 64)  # masks share the budget
        if n < 4:  # plan 1 is used again until n = 3, then left to age out
            assert varlen.varlen_plan(_segments(1), 64, 64, CPU, batch=2) is first
        assert 0 < cache.nbytes <= budget
        kept = [v for v, _, _ in cache._entries.values()]
        assert cache.nbytes == sum(
            held_bytes(_plan_tensors(v) if isinstance(v, varlen.VarlenPlan) else [v]) for v in kept
        )
    assert len(cache) < 2 * 38 and ("plan", _segments(39), 64, 64, CPU, 2) in cache
    assert ("plan", _segments(1), 64, 64, CPU, 2) not in cache and ("mask", _segments(2), 64, 64, None) not in cache
    rebuilt = varlen.varlen_plan(_segments(1), 64, 64, CPU, batch=2)
    assert rebuilt is not first and ("plan", _segments(1), 64, 64, CPU, 2) in cache
    _assert_same_plan(rebuilt, first)
    assert varlen.varlen_plan(_segments(1), 64, 64, CPU, batch=2) is rebuilt  # kept again


def test_the_recently_used_entry_outlives_older_ones(monkeypatch, cache) -> None:
    monkeypatch.setenv(BUDGET_ENV, str(3 * 64 * 64 / 2**20))  # three masks of 64 x 64 booleans
    masks = [varlen.segments_mask(_segments(n), 64, 64) for n in (1, 2, 3)]
    assert varlen.segments_mask(_segments(1), 64, 64) is masks[0]  # 1 is now the most recent: 2 goes first
    varlen.segments_mask(_segments(4), 64, 64)
    assert [n for n in (1, 2, 3, 4) if ("mask", _segments(n), 64, 64, None) in cache] == [1, 3, 4]


def test_an_entry_over_the_whole_budget_is_built_and_not_kept(monkeypatch, cache) -> None:
    monkeypatch.setenv(BUDGET_ENV, "0")
    mask = varlen.segments_mask(_segments(5), 64, 64)
    assert mask.shape == (1, 1, 64, 64) and mask[0, 0, 4, :5].all() and len(cache) == 0 and cache.nbytes == 0


def test_the_budget_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert budget_bytes() == 256 << 20
    monkeypatch.setenv(BUDGET_ENV, "1.5")
    assert budget_bytes() == 3 << 19
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=rf"MESH_CP_VARLEN_CACHE_MB='{bad}' is not a number of MiB >= 0"):
            budget_bytes()


READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.equal,
}


class FakeCuda(TorchFunctionMode):
    """CUDA stood in for on the CPU (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[bool] = []
        """``pin_memory`` of every ``torch.empty``."""
        self.uploads: list[dict] = []
        """The keywords of every ``Tensor.to`` to a CUDA device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            self.pinned.append(kwargs.get("pin_memory", False))
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and torch.device(kwargs.get("device", "cpu")).type == "cuda":
            self.uploads.append(kwargs)
            return args[0].clone()
        if self.uploads and func in READS:
            raise AssertionError(f"{func.__name__} reads a tensor back after the upload")
        return func(*args, **kwargs)


class FakeStream:
    def __init__(self) -> None:
        self.device = CUDA
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeEvent:
    def record(self, stream) -> None:
        self.stream = stream


def test_a_cuda_plan_is_built_pinned_copied_asynchronously_and_never_read_back(monkeypatch, cache) -> None:
    streams = [FakeStream(), FakeStream()]
    current = streams[0]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    segments = (((0, 5, 0, 5, -1, -1), (5, 12, ((2, 4), (6, 11)), 2, 0)), ((1, 9, 0, 11, -1, 1),))
    with FakeCuda() as mode:
        plan = varlen.varlen_plan(segments, 14, 11, CUDA)
    assert mode.pinned == [True] and mode.uploads == [{"device": CUDA, "non_blocking": True}]
    _assert_same_plan(plan, varlen.varlen_plan(segments, 14, 11, CPU))
    (_, _, ready), _ = cache._entries.values()
    assert ready.stream is streams[0] and ready.event.stream is streams[0]
    with FakeCuda() as mode:
        assert varlen.varlen_plan(segments, 14, 11, CUDA) is plan  # a hit on the stream that copied: no wait
        current = streams[1]
        assert varlen.varlen_plan(segments, 14, 11, CUDA) is plan  # on another stream: it waits for the copy
        mask = varlen.segments_mask(segments, 14, 11, CUDA)
    assert mode.pinned == [True] and mode.uploads == [{"device": CUDA, "non_blocking": True}]  # the mask's
    assert streams[0].waited == [] and streams[1].waited == [ready.event]
    assert torch.equal(mask, varlen.segments_mask(segments, 14, 11))


def test_a_host_plan_is_not_pinned(cache) -> None:
    with FakeCuda() as mode:
        varlen.varlen_plan(_segments(3), 64, 64, CPU)
        varlen.segments_mask(_segments(3), 64, 64, CPU)
    assert mode.pinned == [False, False] and mode.uploads == []


def test_plan_cache_is_the_one_varlen_uses() -> None:
    assert varlen.CACHE is plan_cache.CACHE
