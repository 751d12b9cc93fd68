"""Note [Keys laid once per phase] and Note [Consecutive sets]: the overlapped schedule's runs share one layout of keys
per phase, every row of it laid once, before the first call that reads it, and every call reads its keys where they
were laid; a KV chunk is freed only after its last reader. Checked on the programs of every rank of many tiles,
against the collective schedule's layout, and the order search against a brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core import Tiling, make_plan
from mesh_cp.core.consecutive import consecutive_order
from mesh_cp.core.layout import local_positions
from mesh_cp.core.program import KernelMode, overlap_programs, rank_program
from mesh_cp.core.shape import AttentionShape
from mesh_cp.kernels.varlen import segments_mask

TILES = [(2, 2), (4, 2), (3, 2), (2, 3), (4, 4), (2, 8), (8, 2), (3, 5), (1, 4), (4, 1)]
MODES = {
    "gaps": KernelMode(frozenset({"segments", "softcap"}), None, True),
    "adjacent": KernelMode(frozenset({"segments"}), None, False),
}
SEQ = 16


def plans(tile: tuple[int, int]):
    a, b = tile
    shape = AttentionShape(batch=1, seq_local=SEQ, heads=8, kv_heads=2, head_dim=16, itemsize=2)
    for (causal, layout), backward in itertools.product(
        [(True, "zigzag"), (True, "contiguous"), (False, "zigzag")], ("regather", "reuse")
    ):
        yield make_plan(Tiling(a * b, a, b), shape, causal=causal, layout=layout, backward=backward)


def replay(plan, rank: int, phase: str, mode: KernelMode) -> int:
    """Replay the layout of ``phase``: every row laid once, before it is read, with the rows its readers expect;
    return the rows laid."""
    programs = overlap_programs(plan, rank, phase, mode)
    laid: dict[int, tuple[int, int]] = {}  # layout row -> (col, chunk row)
    size, zeros = None, None  # zeros: the layout is allocated as zeros (its first lays leave rows for later runs)
    for t in sorted(programs.runs):
        end, prog = programs.runs[t]
        size = prog.layout_rows if size is None else size
        assert prog.layout_rows == size, "one layout per phase"
        for col, k0, k1, at in prog.lays:
            for r in range(k1 - k0):
                assert at + r not in laid, f"row {at + r} of the layout laid twice (run {t})"
                laid[at + r] = (col, k0 + r)
        view = len(prog.runs) == 1
        if prog.lays and zeros is None:
            zeros = prog.laid_rows < prog.layout_rows
        for c in (c for c in prog.calls if c.laid and not view):
            v0, v1 = c.keys
            assert 0 <= v0 < v1 <= size
            # rows between its sequences that no run laid yet hold zeros, not what the memory held
            assert zeros or all(r in laid for r in range(v0, v1)), f"run {t} reads rows no run laid yet"
            keys = {}  # row of the call's keys -> (chunk, row)
            for col, y, (k0, k1), at in c.pieces:
                for r in range(k1 - k0):
                    got = laid.get(v0 + at + r)
                    assert got == (col, k0 + r), f"run {t} reads layout row {v0 + at + r}: {got} != {(col, k0 + r)}"
                    keys[at + r] = (y, k0 + r)
            sees_what_the_mask_allows(plan, c, keys)
    if laid:
        assert sorted(laid) == list(range(size)), "the lays cover the layout"
        assert programs.layout_span is not None
    return len(laid)


def sees_what_the_mask_allows(plan, c, keys: dict[int, tuple[int, int]]) -> None:
    """Every query row of call ``c`` sees, through its segments, each key of the call's chunks that causal (or full)
    attention lets it see exactly once, and no other, whatever their order in the layout."""
    world, (q0, q1), (v0, v1) = plan.tiling.world, c.q_rows, c.keys
    seen = segments_mask(c.extra["segments"], q1 - q0, v1 - v0)[0, 0]
    chunks = {y for y, _ in keys.values()}
    pos = {y: local_positions(SEQ * world, world, y, plan.layout) for y in chunks | {c.x}}
    for i in range(q1 - q0):
        got = sorted(keys[k] for k in range(v1 - v0) if seen[i, k])
        want = [(y, r) for y in sorted(chunks) for r in range(SEQ) if not plan.causal or pos[y][r] <= pos[c.x][q0 + i]]
        assert got == want, (c.x, q0 + i)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("mode", list(MODES), ids=str)
def test_keys_laid_once_per_phase_and_read_where_laid(tile, mode) -> None:
    kernel = MODES[mode]
    some = 0
    for plan in plans(tile):
        for rank in range(plan.tiling.world):
            collective = rank_program(plan, rank, kernel).laid_rows
            for phase in ("forward", "backward"):
                rows = replay(plan, rank, phase, kernel)
                assert rows <= collective, (plan.causal, plan.layout, rank, phase)
                some += rows > 0
    assert some or min(tile) == 1  # a tile with a Q move over two KV chunks lays keys


@pytest.mark.parametrize("tile", [(3, 2), (4, 4), (2, 8)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_kv_chunk_freed_after_its_last_reader(tile) -> None:
    """A chunk stays until the last run that reads it (a call on the chunk, or a lay from it) and until it is
    forwarded; the runs on the layout do not hold it."""
    kernel = MODES["gaps"]
    for plan in plans(tile):
        for rank in range(plan.tiling.world):
            for phase in ("forward", "backward"):
                sched = plan.overlap(phase)
                programs = overlap_programs(plan, rank, phase, kernel)
                last = programs.kv_last_use
                for t, act in enumerate(sched.actions):
                    if act.op == "wait" and act.step.ring == "kv" and act.step.kind == "move":
                        assert last[act.step.index - 1] >= t
                for _, (end, prog) in programs.runs.items():
                    direct = {c.pieces[0][0] for c in prog.calls if not c.laid or len(prog.runs) == 1}
                    for col in direct | {col for col, *_ in prog.lays}:
                        assert last[col] >= end - 1, (rank, phase, col)
                assert last.keys() >= sched.last_use("kv").keys()


def test_overlap_layout_is_no_larger_than_the_collective_one_at_4x4() -> None:
    """At 4x4 GQA causal, a rank lays at most the collective schedule's rows per phase (it laid up to 11 chunks in
    forward and 10 in backward when every run laid its own)."""
    plan = next(plans((4, 4)))
    kernel = MODES["gaps"]
    for rank in range(16):
        collective = rank_program(plan, rank, kernel).laid_rows
        for phase in ("forward", "backward"):
            runs = overlap_programs(plan, rank, phase, kernel).runs.values()
            assert sum(prog.laid_rows for _, prog in runs) <= collective, (rank, phase)
            assert sum(prog.laid_rows > 0 for _, prog in runs) >= 1


def brute(items, sets, last) -> bool:
    return any(
        all(runs(order, s, last.get(i, ())) for i, s in enumerate(sets)) for order in itertools.permutations(items)
    )


def runs(order, s, suffix) -> bool:
    """``s`` is one run of ``order``, ending in ``suffix`` in that order."""
    at = sorted(order.index(x) for x in s)
    ends = tuple(order[at[-1] + 1 - len(suffix) : at[-1] + 1]) if at else ()
    return not at or (at[-1] - at[0] + 1 == len(at) and ends == tuple(suffix))


SETS = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.just(list(range(n))),
        st.lists(st.frozensets(st.integers(0, n - 1), min_size=1), max_size=5),
        st.dictionaries(
            st.integers(0, 4), st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True), max_size=2
        ),
    )
)


@settings(max_examples=300, deadline=None)
@given(SETS)
def test_consecutive_order_against_brute_force(case) -> None:
    items, sets, last = case
    last = {i: tuple(x) for i, x in last.items() if i < len(sets) and set(x) <= sets[i]}
    order = consecutive_order(items, sets, last)
    if order is None:
        assert not brute(items, sets, last)
    else:
        assert sorted(order) == items
        assert all(runs(order, s, last.get(i, ())) for i, s in enumerate(sets)), (order, sets, last)


def test_consecutive_order_keeps_a_preferred_order_that_serves() -> None:
    items = list("abcdef")
    sets = [frozenset("abc"), frozenset("cd"), frozenset("def")]
    assert consecutive_order(items, sets) == items
    assert consecutive_order(items, [frozenset("ac"), frozenset("ab")]) == ["b", "a", "c", "d", "e", "f"]
    assert consecutive_order(items, [frozenset("ab"), frozenset("bc"), frozenset("ac")]) is None
