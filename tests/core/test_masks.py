"""Masks in the plan: the closed-form pair count, skipped and masked blocks (no process group)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, factorizations, make_plan
from mesh_cp.core.masks import visible_pairs
from mesh_cp.core.numerics import document_ids, visibility
from mesh_cp.sim import compute_imbalance


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40),
    st.booleans(), st.one_of(st.none(), st.integers(1, 50)),
)  # fmt: skip
def test_visible_pairs_counts_what_a_loop_counts(a: int, n: int, c: int, m: int, causal: bool, window) -> None:
    window = window if causal else None
    brute = sum(
        1
        for i in range(a, a + n)
        for j in range(c, c + m)
        if (not causal or j <= i) and (window is None or i - j < window)
    )
    assert visible_pairs((a, a + n), (c, c + m), causal=causal, window=window) == brute


def dense(mask: AttentionMask, seq: int, causal: bool) -> torch.Tensor:
    pos = torch.arange(seq)
    return visibility(document_ids(mask, mask.rows or 1, seq), pos, pos, causal=causal, window=mask.window)[:, 0]


def test_plan_keeps_the_pairs_of_the_mask_and_skips_empty_blocks() -> None:
    """Summed over ranks, the plan computes exactly the mask's pairs; blocks the mask empties make no kernel
    call, blocks it leaves whole keep their fused kind, the others are MASKED."""
    world, half = 8, 4
    seq, rng = 2 * world * half, random.Random(3)
    lengths = []
    while sum(lengths) < seq - 3:
        lengths.append(min(seq - 3 - sum(lengths), rng.choice([1, 2, 3, 5, 12, 20])))
    packed = AttentionMask.from_lengths([lengths])  # the last 3 tokens are padding
    masks = {
        "packed": (packed, True),
        "packed + window 3": (AttentionMask(documents=packed.documents, window=3), True),
        "window 5": (AttentionMask(window=5), True),
        "bidirectional documents": (packed, False),
    }
    shape = AttentionShape(batch=1, seq_local=2 * half, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    for name, (mask, causal) in masks.items():
        layout = "zigzag" if causal else "contiguous"
        for a, b in factorizations(world):
            tiling = Tiling(world=world, a=a, b=b)
            plan = make_plan(tiling, shape, causal=causal, layout=layout, mask=mask)
            plain = make_plan(tiling, shape, causal=causal, layout=layout)
            assert sum(plan.pairs(r) for r in range(world)) == int(dense(mask, seq, causal).sum()), (name, a, b)
            kinds = [w.kind for r in range(world) for w in plan.blocks(r)]
            assert len(kinds) < sum(len(plain.blocks(r)) for r in range(world)), (name, a, b)  # some skipped
            assert MaskKind.MASKED in kinds, (name, a, b)
            pairs = [plan.pairs(r) for r in range(world)]
            assert compute_imbalance(plan) == max(pairs) * world / sum(pairs) >= 1.0
            assert compute_imbalance(plain) == 1.0 or not causal  # the zig-zag row alone is balanced
            # The overlapped schedule reads the same blocks by ring offsets.
            for r in range(world):
                at = {plan.block_at(r, i, j) for i in range(a) for j in range(b)} - {None}
                assert at == set(plan.blocks(r)), (name, a, b, r)


def test_a_mask_that_removes_nothing_keeps_every_block_and_its_kind() -> None:
    shape = AttentionShape(batch=2, seq_local=8, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    whole = AttentionMask(documents=(((0, 32),), ((0, 32),)), window=32)
    for a, b in factorizations(4):
        tiling = Tiling(world=4, a=a, b=b)
        plan = make_plan(tiling, shape, causal=True, layout="zigzag", mask=whole)
        plain = make_plan(tiling, shape, causal=True, layout="zigzag")
        assert all(plan.blocks(r) == plain.blocks(r) for r in range(4))


def test_masks_refuse_what_they_cannot_mean() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"sorted, disjoint, non-empty"):
        AttentionMask(documents=(((0, 4), (3, 6)),))
    with pytest.raises(ValueError, match=r"window must be a positive number of tokens"):
        AttentionMask(window=0)
    shape = AttentionShape(batch=2, seq_local=4, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    with pytest.raises(ValueError, match=r"documents for 1 rows, the batch has 2"):
        make_plan(
            Tiling(world=2, a=1, b=2), shape, causal=True, layout="zigzag", mask=AttentionMask.from_lengths([[3]])
        )
    with pytest.raises(NotImplementedError, match=r"a window \(3\) needs causal attention"):
        make_plan(Tiling(world=2, a=1, b=2), shape, causal=False, layout="contiguous", mask=AttentionMask(window=3))
    with pytest.raises(ValueError, match=r"a document ends at 9, past the sequence of 8 tokens"):
        make_plan(
            Tiling(world=2, a=1, b=2), shape, causal=True, layout="zigzag", mask=AttentionMask.from_lengths([[9], [1]])
        )


def test_kernels_with_a_mask_match_autograd_including_rows_that_attend_nothing() -> None:
    from mesh_cp.core.numerics import attention_delta, expand_kv
    from mesh_cp.kernels import get_kernel

    gen = torch.Generator().manual_seed(0)
    b, sq, sk, h, hkv, d = 2, 6, 7, 4, 2, 8
    q = torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.5
    mask[0, 0, 2] = False  # a query that attends nothing
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (ref[0].transpose(1, 2) @ expand_kv(ref[1], h).permute(0, 2, 3, 1)) * 0.3
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = (p @ expand_kv(ref[2], h).transpose(1, 2)).transpose(1, 2)
    (out * do).sum().backward()
    for name, dtype, tol in (("reference", torch.float64, 1e-10), ("cpu_flash", torch.float32, 1e-5)):
        kernel = get_kernel(name)
        args = [t.to(dtype) for t in (q, k, v)]
        got_out, got_lse = kernel.forward(*args, causal=False, scale=0.3, mask=mask)
        assert torch.equal(torch.isinf(got_lse), torch.isinf(lse)), name
        finite = ~torch.isinf(lse)
        assert (got_lse.double()[finite] - lse.detach()[finite]).abs().max() < tol, name
        assert (got_out.double() - out.detach()).abs().max() < tol, name
        delta = attention_delta(do.to(dtype), got_out)
        grads = kernel.backward(do.to(dtype), *args, got_lse, delta, causal=False, scale=0.3, mask=mask)
        for got, want in zip(grads, ref, strict=True):
            assert (got.double() - want.grad).abs().max() < tol, name


def test_masked_blocks_are_cut_into_tiles_that_cover_exactly_their_pairs() -> None:
    """Summed over a masked block's tiles, the pairs are the block's; empty tiles are left out, and every kind of
    tile occurs for documents and a window."""
    import mesh_cp.core.masks as masks
    from mesh_cp.core.layout import global_ranges
    from mesh_cp.core.masks import block_pairs

    world, half, seq = 4, 8, 64
    mask = AttentionMask.from_lengths([[1, 9, 3, 30, 17]], window=12)
    shape = AttentionShape(batch=1, seq_local=2 * half, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    plan = make_plan(Tiling(world=world, a=2, b=2), shape, causal=True, layout="zigzag", mask=mask)
    old, masks.TILE = masks.TILE, 4
    try:
        kinds = set()
        for r in range(world):
            for w in plan.blocks(r):
                if w.kind is not MaskKind.MASKED:
                    continue
                tiles = plan.tiles(w)
                kinds |= {kind for *_, kind in tiles}
                counted = sum(
                    block_pairs(
                        mask,
                        0,
                        global_ranges(seq, world, w.x, "zigzag", qr),
                        global_ranges(seq, world, w.y, "zigzag", kr),
                        causal=True,
                        seq_len=seq,
                    )
                    for qr, kr, _ in tiles
                )
                assert counted == w.pairs, (r, w)
        assert kinds == {"full", "causal", "masked"}, kinds
    finally:
        masks.TILE = old


def test_simulator_times_every_rank_of_a_masked_plan() -> None:
    """With a mask ranks differ, so the simulator replays each; skipped pairs cut the predicted compute."""
    from mesh_cp.sim import Topology, simulate
    from mesh_cp.sim.model import timed_ranks

    shape = AttentionShape(batch=1, seq_local=4096, heads=8, kv_heads=8, head_dim=128, itemsize=2)
    tiling = Tiling(world=8, a=2, b=4)
    mask = AttentionMask.from_lengths([[3000, 1, 500, 20000, 9267]])
    plan = make_plan(tiling, shape, causal=True, layout="zigzag", mask=mask)
    plain = make_plan(tiling, shape, causal=True, layout="zigzag")
    assert timed_ranks(plan) == range(8) and timed_ranks(plain) == range(1)
    topology = Topology.preset("h100", head_dim=128)
    masked, full = simulate(plan, topology), simulate(plain, topology)
    assert masked.forward.compute < full.forward.compute
    assert masked.traffic == full.traffic  # a skipped block saves compute, not bytes


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 5),
    st.integers(0, 40), st.integers(1, 12), st.integers(0, 40), st.integers(1, 12),
    st.booleans(), st.one_of(st.none(), st.integers(1, 15)),
)  # fmt: skip
def test_tile_segments_are_the_visible_pairs_as_flash_attn_windows(
    lengths, pad, q0, nq, k0, nk, causal, window
) -> None:
    """Read with flash-attn's varlen window rule (bottom-right anchored band, -1 no bound), a tile's segments see
    exactly the pairs the mask leaves; every query of a segment sees a key; ranges are sorted and disjoint."""
    from mesh_cp.core.segments import _tile_segments

    window = window if causal else None
    mask = AttentionMask.from_lengths([lengths], pad_left=[pad], window=window)
    seq = max(pad + sum(lengths), q0 + nq, k0 + nk)
    ids = document_ids(mask, 1, seq)[0].tolist()
    (segments,) = _tile_segments(mask, (q0, q0 + nq), (k0, k0 + nk), seq, causal)
    seen = set()
    for a, b, c, d, left, right in segments:
        shift = (d - c) - (b - a)
        for i in range(b - a):
            keys = [
                j for j in range(d - c) if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)
            ]
            assert keys, (a + i, segments)
            seen |= {(q0 + a + i, k0 + c + j) for j in keys}
    want = {
        (i, j)
        for i in range(q0, q0 + nq)
        for j in range(k0, k0 + nk)
        if ids[i] >= 0 and ids[i] == ids[j] and (not causal or j <= i) and (window is None or i - j < window)
    }
    assert seen == want
    for earlier, later in zip(segments, segments[1:], strict=False):
        assert earlier[1] <= later[0] and earlier[3] <= later[2]


def test_tiles_never_straddle_the_halves_of_a_zigzag_chunk() -> None:
    """Tiles are cut at TILE rows and at the boundary of a chunk's two halves, so each has consecutive global
    positions (what the varlen segments need); a tile across the boundary is refused by tile_segments."""
    import pytest

    from mesh_cp.core import masks, segments
    from mesh_cp.core.layout import global_ranges

    mask = AttentionMask.from_lengths([[5, 20, 7]])
    where = {"seq_len": 32, "world": 2, "layout": "zigzag", "causal": True}
    tiles = masks._block_tiles(mask, (1, (0, 16)), (0, (0, 16)), *where.values(), 6)
    assert tiles and all(len(global_ranges(32, 2, 1, "zigzag", q)) == 1 for q, _, _ in tiles)
    assert {q for q, _, _ in tiles} == {(0, 6), (6, 8), (8, 14), (14, 16)}
    with pytest.raises(ValueError, match="consecutive global positions"):
        segments.tile_segments(mask, (1, (4, 12)), (0, (0, 4)), **where)


def test_visible_pairs_are_counted_once_per_plan_and_block(monkeypatch) -> None:
    """Every layer and both phases ask the plan for the same blocks: their visible pairs are counted once per plan
    (and make_plan returns that plan for an equal mask, so once per call shape and mask)."""
    import mesh_cp.core.plan as plan_module

    counted = []
    real = plan_module.rectangle_pairs

    def counting(mask, q, kv, **options):
        counted.append((q, kv))
        return real(mask, q, kv, **options)

    monkeypatch.setattr(plan_module, "rectangle_pairs", counting)
    tiling = Tiling(world=4, a=2, b=2)
    mask = AttentionMask.from_lengths([[5, 20, 7], [32]])
    options = {"causal": True, "layout": "zigzag", "mask": mask}
    plan = make_plan(tiling, AttentionShape(2, 8, 2, 2, 8, 4), **options)
    for _ in range(3):  # three layers
        for rank in range(tiling.world):
            plan.blocks(rank)
            for phase in ("forward", "backward"):
                for act in plan.overlap(phase).actions:
                    if act.op == "compute":
                        plan.block_at(rank, *act.block)
    assert len(counted) == len(set(counted)) == tiling.world * tiling.a * tiling.b
    again = make_plan(
        tiling, AttentionShape(2, 8, 2, 2, 8, 4), **{**options, "mask": AttentionMask.from_lengths([[5, 20, 7], [32]])}
    )
    assert again is plan


def test_document_ids_are_built_once_per_mask_and_device() -> None:
    """Every layer of a step passes the same mask: one tensor on the device per step, not one copy per layer."""
    mask = AttentionMask.from_lengths([[5, 20, 7], [32]])
    first = document_ids(mask, 2, 32, "cpu")
    assert document_ids(AttentionMask.from_lengths([[5, 20, 7], [32]]), 2, 32, torch.device("cpu")) is first
    assert first[0].tolist() == [0] * 5 + [1] * 20 + [2] * 7 and first[1].tolist() == [0] * 32
