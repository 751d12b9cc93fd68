"""Tensors built on the host once per hashable arguments and held on the device: the asynchronous copy that puts them
there and a least-recently-used cache bounded by the bytes they hold (Note [Varlen plan cache]).

Note [Varlen plan cache]
~~~~~~~~~~~~~~~~~~~~~~~~
The varlen plans and dense masks of :mod:`mesh_cp.kernels.varlen` are built on the host from hashable segments and
reused by every call that repeats them (every layer of a step). A plan holds int64 gather indices of every row of
its tile, so an unbounded count of them is not a small cache (512 plans of a 64K-token tile: about 1.3 GB of device
memory). They are held in one :class:`ByteBoundedCache`: at most ``MESH_CP_VARLEN_CACHE_MB`` MiB of the storages its
entries hold (:data:`BUDGET_ENV`, default :data:`DEFAULT_BUDGET_MB`; read whenever an entry is built, so a running
process may change it; ``0`` keeps nothing), the least recently used dropped first; an entry larger than the whole
budget is built for its call and not kept.

A new entry's host tensor is allocated in pinned memory when the device is CUDA and copied with
``non_blocking=True``: the copy is queued on the current stream ahead of the kernels that read the result, and the
host does not wait for it. The pinned buffer need not outlive its Python reference: a non-blocking copy records an
event on the buffer's block in PyTorch's caching host allocator, which does not hand the block out again before
the copy has completed (``aten/src/ATen/native/cuda/Copy.cu``, ``copy_kernel_cuda``:
``CachingHostAllocator_recordEvent(ptr, ctx, stream)``; ``torch.empty(..., pin_memory=True)`` allocates from that
allocator). An event recorded after the copy (:class:`Ready`) orders a hit on another stream after it: that stream
waits for the event (a device-side wait, queued; the host never waits). Nothing reads a device tensor back: what the
host needs (lengths, maxima, whether rows are in order) is computed on the host before the copy.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BUDGET_ENV = "MESH_CP_VARLEN_CACHE_MB"
"""The environment variable bounding :data:`CACHE` in MiB (Note [Varlen plan cache])."""
DEFAULT_BUDGET_MB = 256


def budget_bytes() -> int:
    """The bytes :data:`CACHE` may hold: ``MESH_CP_VARLEN_CACHE_MB`` MiB (a number >= 0), else 256 MiB. Raises
    ``ValueError`` naming the value when it is not such a number."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return DEFAULT_BUDGET_MB << 20
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not mb >= 0:
        raise ValueError(f"{BUDGET_ENV}={text!r} is not a number of MiB >= 0; set it to e.g. {DEFAULT_BUDGET_MB}")
    return int(mb * (1 << 20))


def held_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage counted once however many views it has."""
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key[1] and key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised host tensor to fill and :func:`upload` to ``device``: in pinned memory when ``device`` is
    CUDA."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


@dataclass(frozen=True)
class Ready:
    """The event recorded on ``stream`` after an asynchronous copy."""

    stream: Any
    event: Any

    def order_current_stream(self) -> None:
        """Make the current stream of the copy's device wait for the copy, unless the copy was queued on it."""
        current = torch.cuda.current_stream(self.stream.device)
        if current != self.stream:
            current.wait_event(self.event)


def _record(device: torch.device) -> Ready:
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(stream)
    return Ready(stream, event)


def upload(host: Tensor, device: torch.device) -> tuple[Tensor, Ready | None]:
    """``host`` on ``device`` and, for CUDA, the :class:`Ready` of the copy: asynchronous from pinned memory there
    (Note [Varlen plan cache]), the tensor itself on the CPU."""
    if device.type != "cuda":
        return host.to(device=device), None
    return host.to(device=device, non_blocking=True), _record(device)


Built = tuple[Any, list[Tensor], Ready | None]
"""What a builder of :meth:`ByteBoundedCache.get` returns: the value, every tensor it holds, its :class:`Ready`."""


class ByteBoundedCache:
    """A least-recently-used cache of built values bounded by :func:`budget_bytes` of the storages they hold."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, tuple[Any, int, Ready | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        """Bytes of the storages the entries hold (:func:`held_bytes` of each)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, build: Callable[[], Built]) -> Any:
        """The value kept for ``key``, else ``build()``'s, kept when it fits the budget (the least recently used
        entries dropped to make room)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None:
            if entry[2] is not None:
                entry[2].order_current_stream()
            return entry[0]
        value, tensors, ready = build()
        size, budget = held_bytes(tensors), budget_bytes()
        if size <= budget:
            with self._lock:
                if key not in self._entries:
                    while self._entries and self.nbytes + size > budget:
                        self.nbytes -= self._entries.popitem(last=False)[1][1]
                    self._entries[key] = (value, size, ready)
                    self.nbytes += size
        return value

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


CACHE = ByteBoundedCache()
"""The plans and masks of :mod:`mesh_cp.kernels.varlen`."""
