"""The overlapped schedule as data: every block once, chunks present when used, reduce steps in order,
the greedy order, the buffer budget, and the same bytes as the collective schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core import AttentionShape, Tiling, factorizations, make_plan
from mesh_cp.core.schedule import OverlapSchedule, build_overlap_schedule, minimum_budget
from mesh_cp.sim.memory import peak_bytes


@st.composite
def schedules(draw) -> OverlapSchedule:
    a, b = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    reduce = draw(st.sampled_from([("q",), ("q", "kv")]))
    return build_overlap_schedule(
        a,
        b,
        t_q=draw(st.sampled_from([0.5, 1.0, 3.0])),
        t_kv=draw(st.sampled_from([0.5, 1.0, 3.0])),
        reduce=reduce,
        kv_present=draw(st.booleans()) and reduce == ("q", "kv"),
    )


def _index(sched: OverlapSchedule, op: str, ring: str, kind: str, index: int) -> int:
    hits = [
        t
        for t, act in enumerate(sched.actions)
        if act.op == op and (act.step.ring, act.step.kind, act.step.index) == (ring, kind, index)
    ]
    assert len(hits) == 1, (op, ring, kind, index, hits)
    return hits[0]


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_every_block_once_with_its_chunks_present(sched: OverlapSchedule) -> None:
    computed = [act.block for act in sched.actions if act.op == "compute"]
    assert sorted(computed) == list(itertools.product(range(sched.a), range(sched.b)))
    arrived = {ring: sched.arrival(ring) for ring in ("q", "kv")}
    for t, act in enumerate(sched.actions):
        if act.op != "compute":
            continue
        for ring, offset in (("q", act.block[0]), ("kv", act.block[1])):
            if arrived[ring][offset] >= 0:  # received: its move was waited for before this block
                assert _index(sched, "wait", ring, "move", offset) < t
            assert sched.last_use(ring)[offset] >= t


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_moves_forward_what_arrived_and_reduce_steps_follow_completion(sched: OverlapSchedule) -> None:
    launches = [act.step for act in sched.actions if act.op == "launch"]
    waits = [act.step for act in sched.actions if act.op == "wait"]
    assert sorted(map(repr, launches)) == sorted(map(repr, waits))  # every launch is waited for once
    for ring in ("q", "kv"):
        moves = [s.index for s in launches if s.ring == ring and s.kind == "move"]
        n = sched.ring_size(ring)
        assert moves == ([] if ring == "kv" and sched.kv_present else list(range(1, n)))
        for k in moves[1:]:  # move k forwards the chunk move k-1 brought
            assert _index(sched, "wait", ring, "move", k - 1) < _index(sched, "launch", ring, "move", k)
        steps = [s.index for s in launches if s.ring == ring and s.kind == "reduce"]
        if not steps:
            continue
        assert steps == list(range(n - 1))
        for s in steps:
            launch = _index(sched, "launch", ring, "reduce", s)
            touching = [
                t
                for t, act in enumerate(sched.actions)
                if act.op == "compute" and act.block[0 if ring == "q" else 1] == s + 1
            ]
            assert max(touching) < launch  # offset s+1 is complete before it is sent on
            if s:
                assert _index(sched, "wait", ring, "reduce", s - 1) < launch


def test_greedy_takes_most_blocks_per_transfer_time() -> None:
    # Q moves cost 1, KV moves 2: at (i, j) Q unlocks j+1 per 1, KV unlocks i+1 per 2.
    assert build_overlap_schedule(4, 4, t_q=1, t_kv=2, reduce=("q",)).path == ("q", "q", "kv", "q", "kv", "kv")
    # A KV ring 10x slower (crossing nodes) is left for last; a free Q ring goes first.
    assert build_overlap_schedule(4, 4, t_q=1, t_kv=10, reduce=("q",)).path == ("q",) * 3 + ("kv",) * 3
    assert build_overlap_schedule(1, 6, t_q=1, t_kv=1, reduce=("q",)).path == ("kv",) * 5  # Ring-Attention
    assert build_overlap_schedule(6, 1, t_q=1, t_kv=1, reduce=("q",)).path == ("q",) * 5  # pass-Q


def test_buffer_budget_bounds_the_chunks_held() -> None:
    free = build_overlap_schedule(4, 4, t_q=1, t_kv=2, reduce=("q",), q_bytes=10, kv_bytes=20)
    least = minimum_budget(4, 4, False, 10, 20)
    assert least < free.peak_chunk_bytes(10, 20)
    tight = build_overlap_schedule(4, 4, t_q=1, t_kv=2, reduce=("q",), q_bytes=10, kv_bytes=20, budget=least)
    assert tight.peak_chunk_bytes(10, 20) <= least
    with pytest.raises(ValueError, match=rf"budget {least - 1} bytes is too small .* at least {least} bytes"):
        build_overlap_schedule(4, 4, t_q=1, t_kv=2, reduce=("q",), q_bytes=10, kv_bytes=20, budget=least - 1)


def test_ring_holds_a_constant_number_of_chunks_and_partials() -> None:
    shape = AttentionShape(batch=1, seq_local=64, heads=8, kv_heads=8, head_dim=16, itemsize=2)
    peaks = {}
    for world in (8, 64):
        plan = make_plan(Tiling(world=world, a=1, b=world), shape, causal=True, layout="zigzag")
        back = plan.overlap("backward")
        assert max(nkv for _, nkv in back.chunks_alive()) <= 2  # the chunk computed on and the one arriving
        assert max(back.partials_alive("kv", sent_at="wait")) <= 3
        peaks[world] = peak_bytes(plan, "backward")
    assert peaks[64] == peaks[8]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.sampled_from([1, 2, 4]), st.booleans(), st.sampled_from(["regather", "reuse"]))
def test_both_schedules_send_the_same_bytes(world: int, kv_heads: int, causal: bool, backward: str) -> None:
    shape = AttentionShape(batch=2, seq_local=6, heads=4, kv_heads=kv_heads, head_dim=8, itemsize=2)
    for a, b in factorizations(world):
        tiling = Tiling(world=world, a=a, b=b)
        plans = [
            make_plan(tiling, shape, causal=causal, layout="zigzag", backward=backward, schedule=s)
            for s in ("overlap", "collective")
        ]
        for phase in ("forward", "backward"):
            for group in ("q", "kv", None):
                assert plans[0].bytes_sent(phase, group) == plans[1].bytes_sent(phase, group)
