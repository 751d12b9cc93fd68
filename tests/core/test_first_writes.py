"""Note [First writes] (:func:`mesh_cp.core.blocks.first_writes`) and the stacked K, V rows of the varlen gathers
(:func:`mesh_cp.kernels.varlen._key_rows`): against a brute-force replay of the writes, and against two gathers."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core.blocks import first_writes, unwritten
from mesh_cp.kernels.varlen import _key_rows, _stacked

SIZE = 12

WRITES = st.integers(1, 3).flatmap(
    lambda slots: st.tuples(
        st.just(slots),
        st.lists(
            st.tuples(
                st.integers(0, slots - 1),
                st.integers(0, SIZE - 1).flatmap(lambda a: st.tuples(st.just(a), st.integers(a + 1, SIZE))),
            ),
            max_size=8,
        ),
    )
)
"""``(slots, writes)``: up to 8 writes ``(slot, (start, stop))`` into ``slots`` slots of ``SIZE`` rows."""


def replay(writes, slots: int, size: int) -> tuple[bool, ...]:
    """Row by row: a write is first when none of its rows was written."""
    written = [[False] * size for _ in range(slots)]
    first = []
    for slot, (start, stop) in writes:
        rows = range(start, stop)
        first.append(not any(written[slot][r] for r in rows))
        for r in rows:
            written[slot][r] = True
    return tuple(first)


@settings(max_examples=300, deadline=None)
@given(WRITES)
def test_first_writes_match_a_replay(case) -> None:  # fmt: skip
    slots, writes = case
    assert first_writes(writes, slots) == replay(writes, slots, SIZE)


@settings(max_examples=300, deadline=None)
@given(WRITES)
def test_filling_the_unwritten_rows_gives_the_sums_from_zero(case) -> None:  # fmt: skip
    """Rows allocated as NaN, the rows :func:`unwritten` names filled with 0, then every write a copy when first and an
    add otherwise: the sums of the writes from a buffer of zeros, every row finite."""
    slots, writes = case
    first = first_writes(writes, slots)
    acc, expected = torch.full((slots, SIZE), float("nan")), torch.zeros(slots, SIZE)
    for slot, start, stop in unwritten(writes, first, slots, SIZE):
        acc[slot, start:stop] = 0.0
    for i, ((slot, (start, stop)), fresh) in enumerate(zip(writes, first, strict=True)):
        value = torch.arange(start, stop, dtype=torch.float32) + 100.0 * (i + 1)
        expected[slot, start:stop] += value
        if fresh:
            acc[slot, start:stop] = value
        else:
            acc[slot, start:stop] += value
    torch.testing.assert_close(acc, expected, rtol=0, atol=0)


def test_unwritten_examples() -> None:
    writes = [(0, (0, 4)), (0, (2, 8)), (1, (3, 5))]
    assert unwritten(writes, first_writes(writes, 2), 2, 12) == ((0, 4, 12), (1, 0, 3), (1, 5, 12))
    assert unwritten([(0, (0, 12))], (True,), 1, 12) == ()


def test_first_writes_examples() -> None:
    assert first_writes([(0, (0, 6)), (0, (6, 12))], 1) == (True, True)
    assert first_writes([(0, (0, 6)), (0, (0, 6)), (0, (6, 12))], 1) == (True, False, True)
    assert first_writes([(0, (0, 6)), (0, (4, 8)), (0, (8, 12))], 1) == (True, False, True)
    # the rows the second write reaches before any first write (6, 7) and the slot never written are filled
    writes = [(0, (0, 6)), (0, (4, 8)), (0, (8, 12))]
    assert unwritten(writes, first_writes(writes, 2), 2, 12) == ((0, 6, 8), (1, 0, 12))


def test_stacked_key_rows_are_one_gather_with_the_same_rows() -> None:
    kv = torch.randn(2, 3, 5, 2, 4)  # (2, B, S, Hkv, D), as the executors stack K and V
    index = torch.tensor([0, 4, 7, 14, 9])
    k, v = kv[0], kv[1]
    assert _stacked(k, v) is not None
    got_k, got_v = _key_rows(k, v, index)
    assert torch.equal(got_k, k.reshape(-1, 2, 4)[index]) and torch.equal(got_v, v.reshape(-1, 2, 4)[index])
    k_alone, v_alone = torch.randn(3, 5, 2, 4), torch.randn(3, 5, 2, 4)
    assert _stacked(k_alone, v_alone) is None  # not views of one tensor: two gathers
    sliced_k, sliced_v = kv[0, :, 1:4], kv[1, :, 1:4]  # a key range of both halves: rows strided by S, not 3
    assert _stacked(sliced_k, sliced_v) is None
    got_k, got_v = _key_rows(sliced_k, sliced_v, torch.tensor([0, 2, 8]))
    assert torch.equal(got_k, sliced_k.reshape(-1, 2, 4)[[0, 2, 8]])
    assert torch.equal(got_v, sliced_v.reshape(-1, 2, 4)[[0, 2, 8]])
