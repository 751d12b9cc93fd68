"""The plan as data: ownership, groups, layouts, masks, balance and traffic (no process group)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core import (
    AttentionPlan,
    AttentionShape,
    MaskKind,
    Tiling,
    chunk_ranges,
    factorizations,
    layout_permutation,
    make_plan,
    mask_kind,
)


@st.composite
def tilings(draw, max_world: int = 64) -> Tiling:
    world = draw(st.integers(1, max_world))
    a, b = draw(st.sampled_from(factorizations(world)))
    return Tiling(world=world, a=a, b=b)


def shape(seq_local: int = 8, heads: int = 4, kv_heads: int = 4, itemsize: int = 4) -> AttentionShape:
    return AttentionShape(batch=2, seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=16, itemsize=itemsize)


@given(tilings())
def test_every_block_has_one_owner_and_every_rank_owns_its_diagonal(t: Tiling) -> None:
    owned = [block for rank in range(t.world) for block in t.blocks(rank)]
    assert sorted(owned) == sorted(itertools.product(range(t.world), repeat=2))
    for rank in range(t.world):
        assert (rank, rank) in t.blocks(rank)
        assert len(t.blocks(rank)) == t.world
        assert all(t.owner(x, y) == rank for x, y in t.blocks(rank))


@given(tilings())
def test_groups_partition_the_ranks(t: Tiling) -> None:
    for groups, size in ((t.q_groups(), t.a), (t.kv_groups(), t.b)):
        assert sorted(r for g in groups for r in g) == list(range(t.world))
        assert all(len(g) == size for g in groups)
    for rank in range(t.world):
        assert rank in t.q_group(rank) and rank in t.kv_group(rank)
        assert set(t.q_group(rank)) & set(t.kv_group(rank)) == {rank}
        assert t.q_group(rank) == tuple(range(rank - rank % t.a, rank - rank % t.a + t.a))  # consecutive ranks


def test_ring_and_pass_q_are_the_extreme_tiles() -> None:
    ring, pass_q = Tiling(world=4, a=1, b=4), Tiling(world=4, a=4, b=1)
    assert ring.blocks(2) == ((2, 0), (2, 1), (2, 2), (2, 3))  # one row: KV moves, Q stays
    assert pass_q.blocks(2) == ((0, 2), (1, 2), (2, 2), (3, 2))  # one column: Q moves
    assert factorizations(6) == ((1, 6), (2, 3), (3, 2), (6, 1))


@given(tilings(max_world=16), st.integers(1, 5), st.sampled_from(["contiguous", "zigzag"]))
def test_layouts_cover_the_sequence_once(t: Tiling, unit: int, layout: str) -> None:
    seq = unit * t.world * (2 if layout == "zigzag" else 1)
    perm = layout_permutation(seq, t.world, layout)
    assert sorted(perm) == list(range(seq))
    for rank in range(t.world):
        ranges = chunk_ranges(seq, t.world, rank, layout)
        assert sum(stop - start for start, stop in ranges) == seq // t.world
        starts = [start for start, _ in ranges]
        assert starts == sorted(starts)  # local order increases with global position
    if layout == "zigzag":
        assert chunk_ranges(seq, t.world, 0, layout)[1][1] == seq  # rank 0 holds the first and the last half-chunk


@given(tilings(max_world=32))
def test_zigzag_causal_blocks_are_balanced(t: Tiling) -> None:
    plan = make_plan(t, shape(seq_local=8), causal=True, layout="zigzag")
    pairs = {plan.pairs(rank) for rank in range(t.world)}
    assert len(pairs) == 1
    dense = t.world * 8 * 8
    half = dense // 2
    assert pairs.pop() == half + 8 // 2  # every block is half dense, plus the diagonal's main diagonal
    for rank in range(t.world):
        kinds = [w.kind for w in plan.blocks(rank)]
        assert kinds[0] is MaskKind.CAUSAL and kinds.count(MaskKind.CAUSAL) == 1  # the local block first


def test_mask_kinds_and_rows() -> None:
    assert mask_kind(2, 1, causal=True, layout="zigzag") is MaskKind.KV_FIRST_HALF
    assert mask_kind(1, 2, causal=True, layout="zigzag") is MaskKind.Q_SECOND_HALF
    assert mask_kind(1, 1, causal=True, layout="zigzag") is MaskKind.CAUSAL
    assert mask_kind(1, 2, causal=True, layout="contiguous") is MaskKind.SKIP
    assert mask_kind(2, 1, causal=True, layout="contiguous") is MaskKind.FULL
    assert mask_kind(1, 2, causal=False, layout="zigzag") is MaskKind.FULL
    plan = make_plan(Tiling(world=4, a=2, b=2), shape(seq_local=6), causal=True, layout="zigzag")
    by_block = {(w.x, w.y): w for w in plan.blocks(1)}
    assert by_block[(0, 1)].q_rows == (3, 6) and by_block[(0, 1)].kv_rows == (0, 6)
    assert by_block[(1, 3)].q_rows == (3, 6)
    contiguous = make_plan(Tiling(world=4, a=1, b=4), shape(), causal=True, layout="contiguous")
    assert [(w.x, w.y) for w in contiguous.blocks(1)] == [(1, 1), (1, 0)]  # blocks above the diagonal are skipped


@given(tilings(max_world=64), st.sampled_from([(8, 8), (8, 2), (8, 1)]), st.sampled_from([2, 4]))
@settings(max_examples=60)
def test_bytes_follow_the_traffic_formula(t: Tiling, heads: tuple[int, int], itemsize: int) -> None:
    s = shape(heads=heads[0], kv_heads=heads[1], itemsize=4)
    for backward in ("regather", "reuse"):
        plan = make_plan(t, s, causal=True, layout="zigzag", backward=backward)
        for phase in ("forward", "backward"):
            formula = plan.traffic_units(phase) * s.chunk_elems * s.itemsize
            assert plan.bytes_sent(phase) == pytest.approx(formula + plan.stats_bytes_sent(phase), abs=1e-6)
    a, b, r = t.a, t.b, s.kv_ratio
    plan = make_plan(t, s, causal=True, layout="zigzag")
    assert plan.traffic_units("forward") == pytest.approx(2 * (a - 1) + 2 * r * (b - 1))
    assert plan.traffic_units("backward") == pytest.approx(3 * (a - 1) + 4 * r * (b - 1))


def test_ring_traffic_and_the_square_tile_saving() -> None:
    s = shape()
    ring = make_plan(Tiling(world=256, a=1, b=256), s, causal=True, layout="zigzag")
    assert ring.bytes_sent("forward") == 2 * 255 * s.chunk_elems * s.itemsize  # exactly 2r(P-1) C, nothing else
    assert ring.bytes_sent("forward", "q") == 0
    square = make_plan(Tiling(world=256, a=16, b=16), s, causal=True, layout="zigzag")
    assert square.traffic_units("forward") == 60 and ring.traffic_units("forward") == 510
    assert square.bytes_sent("forward") < 0.13 * ring.bytes_sent("forward")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world": 6, "a": 4, "b": 2}, "does not factor the CP group size 6.*1x6, 2x3, 3x2, 6x1"),
        ({"world": 4, "a": 0, "b": 4}, "positive int"),
    ],
)
def test_bad_tiles_name_the_valid_ones(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tiling(**kwargs)


def test_tile_parsing() -> None:
    assert Tiling.parse("2x3", 6).shape == (2, 3)
    assert Tiling.parse((3, 2), 6).shape == (3, 2)
    with pytest.raises(ValueError, match="not of the form 'AxB'"):
        Tiling.parse("2by3", 6)
    with pytest.raises(ValueError, match=r"choose one of: \(1, 4\), \(2, 2\), \(4, 1\)"):
        Tiling.parse(None, 4)


@pytest.mark.parametrize(
    ("seq", "world", "layout", "message"),
    [
        (1000, 8, "zigzag", "seq_len 1000 must be a positive multiple of 16 .*pad the sequence to 1008"),
        (10, 4, "contiguous", "multiple of 4 .*pad the sequence to 12"),
        (8, 2, "striped", "layout 'striped' is not supported"),
    ],
)
def test_bad_sequence_lengths(seq: int, world: int, layout: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_ranges(seq, world, 0, layout)


def test_plan_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="seq_local 5 must be even for the zigzag layout"):
        AttentionPlan(tiling=Tiling(world=2, a=1, b=2), shape=shape(seq_local=5), causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="backward 'keep'"):
        AttentionPlan(tiling=Tiling(world=2, a=1, b=2), shape=shape(), causal=True, layout="zigzag", backward="keep")
    with pytest.raises(ValueError, match="heads 6 must be a multiple of kv_heads 4"):
        shape(heads=6, kv_heads=4)
