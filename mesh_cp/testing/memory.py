"""Peak memory of a block of code, for tests and benchmarks of the plan's memory model."""

from __future__ import annotations

import torch


class MemoryPeak:
    """Peak bytes allocated (net of frees) while active, from ``torch.profiler``'s memory events.

    ``with MemoryPeak() as mem: ...`` then ``mem.peak``: the most bytes allocated at any moment
    above what was allocated on entry, on every device the profiler sees. Slow (it profiles every
    op); meant for tests and benchmarks that check :func:`mesh_cp.sim.memory.peak_bytes`. It reads the
    profiler's per-allocation events (``kineto_results``), which torch keeps outside its public API.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._profile = None

    def __enter__(self) -> MemoryPeak:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = self._profile.profiler.kineto_results.events()
        current = peak = 0
        for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            current += event.nbytes()
            peak = max(peak, current)
        self.peak = peak
