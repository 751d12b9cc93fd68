"""A ring offset's partial held as pieces (Note [Partials as pieces] in ``mesh_cp/runtime/partials.py``): any sequence
of writes over row ranges, a partial received from the ring and the buffer sent, against the same writes summed or
LSE-merged into a buffer of zeros (of ``(0, -inf)``) in fp64."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core.numerics import merge_
from mesh_cp.runtime.partials import Partial

ROWS, HEADS, DIM = 12, 2, 3

WRITES = st.lists(
    st.integers(0, ROWS - 1).flatmap(lambda a: st.tuples(st.just(a), st.integers(a + 1, ROWS))), min_size=1, max_size=6
)
"""Row ranges ``(start, stop)`` of the calls' writes, in order."""


def alloc(kind: str):
    def make():
        if kind == "merge":
            flat = torch.empty(ROWS * HEADS * (DIM + 1), dtype=torch.float64)
            return flat, (
                flat[: ROWS * HEADS * DIM].view(1, ROWS, HEADS, DIM),
                flat[ROWS * HEADS * DIM :].view(1, HEADS, ROWS),
            )
        flat = torch.empty(1, ROWS, HEADS, DIM, dtype=torch.float64)
        return flat, (flat,)

    return make


def values(kind: str, rows: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    n = rows[1] - rows[0]
    o = torch.randn(1, n, HEADS, DIM, generator=gen, dtype=torch.float64)
    if kind == "merge":
        return o, torch.randn(1, HEADS, n, generator=gen, dtype=torch.float64)
    return (o,)


def partial(kind: str) -> Partial:
    dims, fills = ((1, 2), (0.0, float("-inf"))) if kind == "merge" else ((1,), (0.0,))
    return Partial(kind, alloc(kind), dims, fills, ROWS)


def reference(kind: str) -> tuple[torch.Tensor, ...]:
    _, views = alloc(kind)()
    views[0].zero_()
    if kind == "merge":
        views[1].fill_(float("-inf"))
    return views


def combine(kind: str, target: tuple[torch.Tensor, ...], rows: tuple[int, int], vals) -> None:
    (a, b), dims = rows, ((1, 2) if kind == "merge" else (1,))
    part = tuple(t.narrow(d, a, b - a) for t, d in zip(target, dims, strict=True))
    if kind == "merge":
        merge_(*part, *vals)
    else:
        part[0].add_(vals[0])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["merge", "sum"]), WRITES, WRITES, st.booleans(), st.integers(0, 2**16))
def test_pieces_equal_the_writes_into_one_buffer(kind, before, after, arrives, seed) -> None:  # fmt: skip
    """Writes, then (maybe) a partial received whole, then more writes; the buffer sent equals the reference, and
    the pieces are never written in place (a call's outputs stay as the kernel returned them)."""
    gen = torch.Generator().manual_seed(seed)
    got, want = partial(kind), reference(kind)
    outputs = []
    for rows in before:
        vals = values(kind, rows, gen)
        outputs.append((vals, tuple(v.clone() for v in vals)))
        got.write(rows, vals)
        combine(kind, want, rows, vals)
    if arrives:
        flat, views = alloc(kind)()
        received = values(kind, (0, ROWS), gen)
        for view, value in zip(views, received, strict=True):
            view.copy_(value)
        got.land(flat, views)
        combine(kind, want, (0, ROWS), received)
    for rows in after:
        vals = values(kind, rows, gen)
        got.write(rows, vals)
        combine(kind, want, rows, vals)
    got.buffer()
    for g, w in zip(got.views, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for vals, copies in outputs:
        assert all(torch.equal(v, c) for v, c in zip(vals, copies, strict=True))


def test_a_whole_piece_is_the_calls_output() -> None:
    gen = torch.Generator().manual_seed(0)
    p = partial("merge")
    vals = values("merge", (0, ROWS), gen)
    p.write((0, ROWS), vals)
    held = p.whole_piece()  # views of the call's outputs, no copy
    assert held is not None and all(h.data_ptr() == v.data_ptr() for h, v in zip(held, vals, strict=True))
    p.write((2, 5), values("merge", (2, 5), gen))
    assert p.whole_piece() is None and p.flat is None  # pieces: (0, 2) and (5, 12) views, (2, 5) merged
    assert sorted(r[:2] for r in p.pieces) == [(0, 2), (2, 5), (5, ROWS)]
