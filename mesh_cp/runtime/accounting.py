"""Count every byte a rank sends through torch.distributed, per process group.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees the ``c10d`` ops behind the
``torch.distributed`` API (and the ``_c10d_functional`` ops of functional collectives). Bytes are
those one rank puts on the wire with a bandwidth-optimal algorithm, the model the plan uses:

===========================  ===========================================
all-gather (n members)       ``(n - 1) * input bytes``
all-to-all (n members)       input bytes less the piece kept locally
reduce-scatter               ``(n - 1) / n * input bytes``
all-reduce                   ``2 (n - 1) / n * bytes``
broadcast, send              the tensor's bytes at the root / sender
===========================  ===========================================
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

from mesh_cp.runtime.mesh import CPMesh

_FREE = {"barrier", "monitored_barrier", "recv_", "recv_any_source_"}


@dataclass(frozen=True)
class CommRecord:
    op: str
    group_name: str
    group_size: int
    bytes_sent: int


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group(obj) -> ProcessGroup | None:
    if isinstance(obj, torch.ScriptObject):
        return ProcessGroup.unbox(obj)
    return obj if isinstance(obj, ProcessGroup) else None


class CommCounter(TorchDispatchMode):
    """Records the bytes each communication op sends from this rank while active.

    ``with CommCounter() as counter: ...`` then ``counter.bytes_sent()``, or per group with
    ``counter.bytes_by_role(mesh)`` (``{"q": ..., "kv": ..., "cp": ..., "other": ...}``).
    An unknown communication op raises, so nothing goes uncounted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace == "c10d":
            self._record_c10d(func, args)
        elif namespace == "_c10d_functional":
            self._record_functional(func, args)
        return func(*args, **kwargs)

    def _record_c10d(self, func, args) -> None:
        name = func._opname
        pg = next((g for g in map(_group, args) if g is not None), None)
        if name in _FREE or pg is None:
            if pg is not None:
                self.records.append(CommRecord(name, pg.group_name, pg.size(), 0))
            return
        n = pg.size()
        if name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
            sent = (n - 1) * _nbytes(args[1])
        elif name == "alltoall_base_":
            inp, in_splits = args[1], args[4]
            rows = inp.shape[0] if inp.dim() else 1
            own = in_splits[pg.rank()] if in_splits else rows // n
            sent = _nbytes(inp) - own * (_nbytes(inp) // max(rows, 1))
        elif name == "alltoall_":
            sent = _nbytes(args[1]) - _nbytes(args[1][pg.rank()])
        elif name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            sent = (n - 1) * _nbytes(args[1]) // n
        elif name == "allreduce_":
            sent = 2 * (n - 1) * _nbytes(args[0]) // n
        elif name == "broadcast_":
            sent = _nbytes(args[0]) if pg.rank() == args[2] else 0
        elif name == "send":
            sent = _nbytes(args[0])
        else:
            raise NotImplementedError(f"CommCounter does not know how many bytes c10d.{name} sends; add it")
        self.records.append(CommRecord(name, pg.group_name, n, sent))

    def _record_functional(self, func, args) -> None:
        name = func._opname
        if name in ("wait_tensor", "_wrap_tensor_autograd"):  # bookkeeping ops that move no data
            return
        group_name = args[-1]
        if name == "all_gather_into_tensor":
            n = args[1]
            sent = (n - 1) * _nbytes(args[0])
        elif name == "reduce_scatter_tensor":
            n = args[2]
            sent = (n - 1) * _nbytes(args[0]) // n
        elif name == "all_reduce":
            from torch.distributed.distributed_c10d import _resolve_process_group

            n = _resolve_process_group(group_name).size()
            sent = 2 * (n - 1) * _nbytes(args[0]) // n
        elif name == "all_to_all_single":
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(group_name)
            n, inp, in_splits = pg.size(), args[0], args[2]
            rows = inp.shape[0]
            own = in_splits[pg.rank()] if in_splits else rows // n
            sent = _nbytes(inp) - own * (_nbytes(inp) // max(rows, 1))
        else:
            raise NotImplementedError(f"CommCounter does not know how many bytes _c10d_functional.{name} sends; add it")
        self.records.append(CommRecord(name, group_name, n, sent))

    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    def bytes_by_role(self, mesh: CPMesh) -> dict[str, int]:
        """Bytes per group of ``mesh``: ``"q"``, ``"kv"``, ``"cp"``, and ``"other"`` for any other group."""
        totals: dict[str, int] = defaultdict(int)
        for r in self.records:
            totals[mesh.role_of(r.group_name) or "other"] += r.bytes_sent
        return dict(totals)

    def reset(self) -> None:
        self.records.clear()


class MemoryPeak:
    """Peak bytes allocated (net of frees) while active, from ``torch.profiler``'s memory events.

    ``with MemoryPeak() as mem: ...`` then ``mem.peak``: the most bytes allocated at any moment
    above what was allocated on entry, on every device the profiler sees. Slow (it profiles every
    op); meant for tests and benchmarks that check :meth:`AttentionPlan.peak_bytes`.
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
