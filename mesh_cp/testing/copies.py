"""Bytes a block of code writes outside the kernels and the communication, and the kernel calls it makes.

Note [Bytes outside the kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What a rank does around its kernel calls (laying keys end to end, writing partial results into accumulators,
merging, packing for a collective, casting) costs memory traffic that one kernel call over the whole sequence does not.
:class:`WrittenBytes` counts it as the bytes every ATen op writes, seen through a ``TorchDispatchMode``:

- views write nothing (an op whose outputs alias its inputs without writing them);
- an op that writes one of its arguments (``copy_``, ``add_``, ``out=``) writes that argument's bytes, and any other op
  the bytes of the tensors it returns, except allocations without values (``empty``, ``empty_like``, ...);
- ops inside a block kernel's ``forward`` / ``backward`` (every class in ``kernels``) and the collectives
  (``c10d`` ops) are the kernels and the communication, and are not counted;
- a fused pass (:class:`~mesh_cp.kernels.fused.Fused`: the LSE merge, ``out_for_delta``) counts as the one pass it is
  on a GPU (Note [Fused passes]): the bytes it returns, or for an in-place pass (``merge_``) the accumulators it
  rewrites, whether it runs compiled or eagerly (on CPU it runs eagerly).

Of these, :attr:`WrittenBytes.copied` are the bytes of the ops that only move data (:data:`COPY_OPS`: copies, casts,
concatenations, gathers); the rest are arithmetic (the LSE merge, sums of partial gradients) and fills. The kernel
calls are counted too (:attr:`WrittenBytes.calls`, per ``"forward"`` / ``"backward"``), so a benchmark can
show the calls per Q chunk beside the bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_UNWRITTEN = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_to_copy_meta"}
_COMM_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}
_STATE = threading.local()
COPY_OPS = frozenset(
    {
        "copy_",
        "_to_copy",
        "clone",
        "cat",
        "stack",
        "index_select",
        "index",
        "gather",
        "repeat",
        "repeat_interleave",
        "contiguous",
        "_unsafe_view",
        "expand_copy",
        "slice_scatter",
        "index_put_",
        "index_copy_",
        "scatter",
    }
)
"""The ops that only move data."""


def _kernel_classes() -> list[type]:
    """Every block kernel class of ``mesh_cp.kernels`` that can be imported here."""
    from mesh_cp.kernels import _REGISTRY, _kernel_class

    classes = []
    for name in _REGISTRY:
        with contextlib.suppress(ImportError):
            classes.append(_kernel_class(name))
    return classes


def _written(func, args, kwargs, out) -> int:
    schema = func._schema
    if func.overloadpacket.__name__ in _UNWRITTEN:
        return 0
    mutated = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        values = {**dict(zip([a.name for a in schema.arguments], args, strict=False)), **kwargs}
        return sum(_nbytes(values.get(a.name)) for a in mutated)
    if any(r.alias_info is not None for r in schema.returns):
        return 0  # a view
    return _nbytes(out)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class WrittenBytes(TorchDispatchMode):
    """Bytes written outside the kernels and the communication while active (Note [Bytes outside the kernels]), per
    op (:attr:`by_op`) and in all (:attr:`total`); kernel calls per direction in :attr:`calls`."""

    def __init__(self, kernels: tuple[type, ...] = ()) -> None:
        """``kernels``: kernel classes beyond those of ``mesh_cp.kernels`` whose calls are the kernels' too."""
        super().__init__()
        self.kernels = kernels
        self.by_op: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._patched: list[tuple[type, str, object]] = []

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def copied(self) -> int:
        """Bytes written by the ops that only move data (:data:`COPY_OPS`)."""
        return sum(n for op, n in self.by_op.items() if op in COPY_OPS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(_STATE, "inside", 0) == 0 and func.namespace not in _COMM_NAMESPACES:
            n = _written(func, args, kwargs, out)
            if n:
                self.by_op[func.overloadpacket.__name__] += n
        return out

    def __enter__(self):
        from mesh_cp.kernels.fused import Fused

        self._patch(Fused, "__call__", self._one_pass(Fused.__call__))
        for cls in (*_kernel_classes(), *self.kernels):
            for method in ("forward", "backward"):
                original = cls.__dict__.get(method)
                if original is not None:
                    self._patch(cls, method, self._paused(original, method))
        return super().__enter__()

    def _patch(self, cls: type, method: str, replacement) -> None:
        self._patched.append((cls, method, cls.__dict__[method]))
        setattr(cls, method, replacement)

    def __exit__(self, *exc):
        for cls, method, original in reversed(self._patched):
            setattr(cls, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _paused(self, original, method: str):
        counter = self

        def run(*args, **kwargs):
            depth = getattr(_STATE, "inside", 0)
            if depth == 0:
                counter.calls[method] += 1
            _STATE.inside = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                _STATE.inside = depth

        return run

    def _one_pass(self, original):
        counter = self

        def run(fused, first, *args):
            depth = getattr(_STATE, "inside", 0)
            _STATE.inside = depth + 1
            try:
                out = original(fused, first, *args)
            finally:
                _STATE.inside = depth
            if depth == 0:
                written = _nbytes(out) if out is not None else _nbytes((first, args[0]))
                counter.by_op[f"fused:{fused.fn.__name__}"] += written
            return out

        return run
