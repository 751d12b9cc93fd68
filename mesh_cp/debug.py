"""Count every byte a rank sends through torch.distributed, per process group.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees the ``c10d`` ops behind the
``torch.distributed`` API (and the ``_c10d_functional`` ops of functional collectives); each is recorded
under the public name of the collective it implements (``"all_gather"``, ``"all_to_all"``, ``"send"``, ...).
Bytes are those one rank puts on the wire with a bandwidth-optimal algorithm, the model the plan uses:

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from mesh_cp.runtime.mesh import CPMesh


@dataclass(frozen=True)
class CommRecord:
    op: str
    """Public name of the collective: ``all_gather``, ``all_to_all``, ``reduce_scatter``, ``all_reduce``,
    ``broadcast``, ``send``, ``recv`` or ``barrier``."""
    group_name: str
    group_size: int
    bytes_sent: int
    peers: tuple[int, ...] = ()
    """Global ranks that receive :attr:`bytes_sent`, in equal shares: the destination of a send, the other
    members for an all-to-all or broadcast, the next member for the ring algorithms of all-gather,
    reduce-scatter and all-reduce."""


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


def _all_to_all_bytes(inp: torch.Tensor, in_splits, n: int, rank: int) -> int:
    """Bytes of an ``all_to_all_single`` input less the rows this rank keeps."""
    rows = inp.shape[0] if inp.dim() else 1
    own = in_splits[rank] if in_splits else rows // n
    return _nbytes(inp) - own * (_nbytes(inp) // max(rows, 1))


# c10d op -> (public name, bytes sent from (args, group size, group rank)).
_SentBytes = Callable[[tuple, int, int], int]
_C10D: dict[str, tuple[str, _SentBytes]] = {
    "_allgather_base_": ("all_gather", lambda a, n, r: (n - 1) * _nbytes(a[1])),
    "allgather_": ("all_gather", lambda a, n, r: (n - 1) * _nbytes(a[1])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a, n, r: (n - 1) * _nbytes(a[1])),
    "alltoall_base_": ("all_to_all", lambda a, n, r: _all_to_all_bytes(a[1], a[4], n, r)),
    "alltoall_": ("all_to_all", lambda a, n, r: _nbytes(a[1]) - _nbytes(a[1][r])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a, n, r: (n - 1) * _nbytes(a[1]) // n),
    "reduce_scatter_": ("reduce_scatter", lambda a, n, r: (n - 1) * _nbytes(a[1]) // n),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a, n, r: (n - 1) * _nbytes(a[1]) // n),
    "allreduce_": ("all_reduce", lambda a, n, r: 2 * (n - 1) * _nbytes(a[0]) // n),
    "broadcast_": ("broadcast", lambda a, n, r: _nbytes(a[0]) if r == a[2] else 0),
    "send": ("send", lambda a, n, r: _nbytes(a[0])),
    "recv_": ("recv", lambda a, n, r: 0),
    "recv_any_source_": ("recv", lambda a, n, r: 0),
    "barrier": ("barrier", lambda a, n, r: 0),
    "monitored_barrier": ("barrier", lambda a, n, r: 0),
}

# _c10d_functional op -> (public name, bytes sent from (args, group size, group rank)); the group is the last arg.
_FUNCTIONAL: dict[str, tuple[str, _SentBytes]] = {
    "all_gather_into_tensor": ("all_gather", lambda a, n, r: (n - 1) * _nbytes(a[0])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, n, r: (n - 1) * _nbytes(a[0]) // n),
    "all_reduce": ("all_reduce", lambda a, n, r: 2 * (n - 1) * _nbytes(a[0]) // n),
    "all_to_all_single": ("all_to_all", lambda a, n, r: _all_to_all_bytes(a[0], a[2], n, r)),
}
_FUNCTIONAL_BOOKKEEPING = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
"""Functional ops that move no data."""


def _peers(public: str, pg: ProcessGroup, args: tuple) -> tuple[int, ...]:
    """The global ranks that receive what this rank sends in one op (:attr:`CommRecord.peers`)."""
    members, me = torch.distributed.get_process_group_ranks(pg), pg.rank()
    if public == "send":
        return (members[args[2]],)
    if public in ("all_to_all", "broadcast"):
        return tuple(g for i, g in enumerate(members) if i != me)
    if public in ("all_gather", "reduce_scatter", "all_reduce") and len(members) > 1:
        return (members[(me + 1) % len(members)],)
    return ()


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
        if func.namespace == "c10d":
            self._record_c10d(func._opname, args)
        elif func.namespace == "_c10d_functional" and func._opname not in _FUNCTIONAL_BOOKKEEPING:
            self._record_functional(func._opname, args)
        return func(*args, **kwargs or {})

    def _record_c10d(self, name: str, args: tuple) -> None:
        pg = next((g for g in map(_group, args) if g is not None), None)
        if pg is None:
            return
        if name not in _C10D:
            raise NotImplementedError(f"CommCounter does not know how many bytes c10d.{name} sends; add it")
        public, sent = _C10D[name]
        nbytes = sent(args, pg.size(), pg.rank())
        self.records.append(CommRecord(public, pg.group_name, pg.size(), nbytes, _peers(public, pg, args)))

    def _record_functional(self, name: str, args: tuple) -> None:
        if name not in _FUNCTIONAL:
            raise NotImplementedError(f"CommCounter does not know how many bytes _c10d_functional.{name} sends; add it")
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(args[-1])
        public, sent = _FUNCTIONAL[name]
        nbytes = sent(args, pg.size(), pg.rank())
        self.records.append(CommRecord(public, args[-1], pg.size(), nbytes, _peers(public, pg, args)))

    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    def bytes_by_role(self, mesh: CPMesh) -> dict[str, int]:
        """Bytes per group of ``mesh`` (:func:`group_roles`: ``"heads"``, ``"q"``, ``"kv"``, ``"cp"``,
        ``"check"``), and ``"other"`` for any other group."""
        roles = group_roles(mesh)
        totals: dict[str, int] = defaultdict(int)
        for r in self.records:
            totals[roles.get(r.group_name, "other")] += r.bytes_sent
        return dict(totals)

    def bytes_by_link(self, node_of: Callable[[int], int]) -> dict[str, int]:
        """Bytes sent to ranks on this rank's node (``"intra"``) and on other nodes (``"inter"``), with ``node_of``
        mapping a global rank to its node (for example ``lambda r: r // ranks_per_node``)."""
        me = node_of(torch.distributed.get_rank())
        totals = {"intra": 0, "inter": 0}
        for r in self.records:
            for peer in r.peers:
                totals["intra" if node_of(peer) == me else "inter"] += r.bytes_sent // len(r.peers)
        return totals

    def reset(self) -> None:
        self.records.clear()


def group_roles(mesh: CPMesh) -> dict[str, str]:
    """Process-group name -> its role in ``mesh``: ``"q"`` (the Q-group), ``"kv"`` (the KV-group), ``"cp"`` (the
    CP group), ``"heads"`` (the head group) and ``"check"`` (the group of the call checks). A group that plays
    two roles is named by the first of that order."""
    roles = (("q", mesh.q_group), ("kv", mesh.kv_group), ("cp", mesh.group), ("heads", mesh.head_group))
    names: dict[str, str] = {}
    for role, group in (*roles, ("check", mesh.check_group)):
        if group is not None:
            names.setdefault(group.group_name, role)
    return names
