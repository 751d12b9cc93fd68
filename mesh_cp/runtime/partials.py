"""The partial results one rank holds per ring offset in the overlapped schedule: the rows of ``(o, lse)`` (merged,
Note [LSE merge]) or of ``dq`` or ``dk, dv`` (summed), as its calls return them or in one fp32 buffer.

Note [Partials as pieces]
~~~~~~~~~~~~~~~~~~~~~~~~~
A call writes some rows of an offset's partial. Writing each call's output into an fp32 buffer costs a copy per
call (Note [First writes] in :mod:`mesh_cp.core.blocks`) where the buffer is not needed yet: a partial is *held as
pieces*, disjoint row ranges each holding what a call returned (a view of it, in the input dtype) or what two
pieces combined into (the LSE merge or the sum, out of place, in fp32). The buffer is made only when one is needed:

- to send the partial along the ring: the rows the pieces cover are written into it (what a first write did), the
  others filled with the identity;
- when a partial of the same rows arrives from the ring: the pieces are merged into, or added to, the received
  buffer, which becomes the partial (no copy);
- the rank's own rows at the end: one piece over every row and the partial that arrived give the result in the input
  dtype in one pass.

So a rank copies an output into an fp32 buffer only for the partials it sends before any other arrives. Rows are the
same numbers either way: a first write copies the call's values, and the merge and the sum widen their operands to
fp32 as they read them. Once the buffer exists, later calls write into it (a first write a copy, later ones in place).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from mesh_cp.core.blocks import uncovered
from mesh_cp.kernels.fused import added, merge_, merged

Values = tuple[Tensor, ...]
"""One tensor per part of a partial: ``(o, lse)``, ``(dq,)`` or ``(dk, dv)``, rows along the part's dim."""


class Partial:
    """The partial of one ring offset (Note [Partials as pieces]): ``kind`` ``"merge"`` (``(o, lse)``) or ``"sum"``;
    ``alloc()`` makes the buffer and its views, ``dims`` the rows' dim of each view, ``fills`` the identity of each,
    ``size`` the rows."""

    def __init__(
        self,
        kind: str,
        alloc: Callable[[], tuple[Tensor, Values]],
        dims: tuple[int, ...],
        fills: tuple[float, ...],
        size: int,
    ) -> None:
        self.kind, self.alloc, self.dims, self.fills, self.size = kind, alloc, dims, fills, size
        self.flat: Tensor | None = None
        self.views: Values = ()
        self.spans: list[tuple[int, int]] = []
        """Rows written into the buffer so far."""
        self.pieces: list[tuple[int, int, Values]] = []
        """Rows held as pieces while there is no buffer."""

    def adopt(self, flat: Tensor, views: Values) -> Partial:
        """Take a partial received whole as the buffer."""
        self.flat, self.views, self.spans = flat, views, [(0, self.size)]
        return self

    def write(self, rows: tuple[int, int], values: Values) -> None:
        """Merge or add a call's ``values`` over ``rows``."""
        if self.flat is None:
            self._piece(rows, values)
            return
        start, stop = rows
        target = self._rows(self.views, 0, start, stop)
        if self._fresh(rows):
            for view, value in zip(target, values, strict=True):
                view.copy_(value)
        else:
            self._into(target, values)

    def buffer(self) -> Tensor:
        """The whole buffer (made from the pieces if there is none), every row holding its value."""
        if self.flat is None:
            self.flat, self.views = self.alloc()
            for start, stop, values in self.pieces:
                for view, value in zip(self._rows(self.views, 0, start, stop), values, strict=True):
                    view.copy_(value)
                self.spans.append((start, stop))
            self.pieces = []
        self._fill(0, self.size)
        return self.flat

    def land(self, flat: Tensor, views: Values) -> None:
        """Combine a partial of the same rows received whole: into this buffer, or the pieces into the received one."""
        if self.flat is not None:
            self.buffer()
            self._into(self.views, views)
            return
        for start, stop, values in self.pieces:
            self._into(self._rows(views, 0, start, stop), values)
        self.pieces = []
        self.adopt(flat, views)

    def whole_piece(self) -> Values | None:
        """The values of the one piece over every row, if that is what is held."""
        if self.flat is None and len(self.pieces) == 1 and self.pieces[0][:2] == (0, self.size):
            return self.pieces[0][2]
        return None

    def _piece(self, rows: tuple[int, int], values: Values) -> None:
        start, stop = rows
        kept, covered = [], []
        for s0, s1, held in self.pieces:
            lo, hi = max(s0, start), min(s1, stop)
            if lo >= hi:
                kept.append((s0, s1, held))
                continue
            if s0 < lo:
                kept.append((s0, lo, self._rows(held, s0, s0, lo)))
            if hi < s1:
                kept.append((hi, s1, self._rows(held, s0, hi, s1)))
            kept.append((lo, hi, self._combined(self._rows(held, s0, lo, hi), self._rows(values, start, lo, hi))))
            covered.append((lo, hi))
        at = start
        for lo, hi in sorted(covered):
            if lo > at:
                kept.append((at, lo, self._rows(values, start, at, lo)))
            at = max(at, hi)
        if at < stop:
            kept.append((at, stop, self._rows(values, start, at, stop)))
        self.pieces = kept

    def _rows(self, values: Values, origin: int, start: int, stop: int) -> Values:
        """Rows ``start:stop`` of ``values`` whose first row is row ``origin``."""
        return tuple(v.narrow(d, start - origin, stop - start) for v, d in zip(values, self.dims, strict=True))

    def _combined(self, a: Values, b: Values) -> Values:
        """``a`` and ``b`` combined into new tensors, in fp32."""
        if self.kind == "merge":
            return merged(*a, *b)
        return tuple(added(x, y) for x, y in zip(a, b, strict=True))

    def _into(self, target: Values, values: Values) -> None:
        """``values`` combined into ``target`` in place."""
        if self.kind == "merge":
            merge_(*target, *values)
        else:
            for view, value in zip(target, values, strict=True):
                view.add_(value)

    def _fresh(self, rows: tuple[int, int]) -> bool:
        """Before writing ``rows`` into the buffer: whether none of them is written (a first write, a copy); otherwise
        the rows among them nothing wrote are filled with the identity."""
        start, stop = rows
        if all(stop <= s0 or s1 <= start for s0, s1 in self.spans):
            self.spans.append(rows)
            return True
        self._fill(start, stop)
        return False

    def _fill(self, start: int, stop: int) -> None:
        """Fill the rows of ``[start, stop)`` nothing wrote with the identity; they count as written."""
        for a, b in uncovered(self.spans, start, stop):
            for view, fill in zip(self._rows(self.views, 0, a, b), self.fills, strict=True):
                view.fill_(fill)
        self.spans.append((start, stop))
