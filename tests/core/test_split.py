"""Split documents (:mod:`mesh_cp.core.split`, Note [Split documents]).

- The three packed mixes of ``scripts/bench_rank.py`` at ``P = 16``, 8192 tokens per rank, tile 4x4, split: the
  busiest rank's pairs within 1% of the mean (the plan's own count), and every masked block at most three varlen
  calls on a kernel that takes segments.
- The layout: a permutation of the packed row; a half-chunk holds one part of a document at most, parts in document
  order, a document's parts within one token of each other, the half-chunks' fills too.
- The mask counts what the packed row means: pairs per rank equal a count over the packed row's documents and their
  own positions, which never reads the split mask.
- Bad input is refused with the value and the fix.
"""

from __future__ import annotations

import bisect
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, make_plan
from mesh_cp.core.balance import rank_pairs
from mesh_cp.core.layout import chunk_ranges
from mesh_cp.core.split import split_documents, thd_layout, thd_partitioned_indices
from mesh_cp.kernels import Capabilities
from mesh_cp.runtime.call import AttentionCall

ROOT = Path(__file__).resolve().parents[2]
WORLD, PER_RANK = 16, 8192
SEQ = WORLD * PER_RANK


class SegmentsOnly:
    """Stands for a flash kernel: takes masked blocks as varlen segments (never called here)."""

    name = "segments-only"
    capabilities = Capabilities(keywords={"segments"})


@pytest.fixture(scope="module")
def mixes() -> dict[str, list[int]]:
    spec = importlib.util.spec_from_file_location("bench_rank", ROOT / "scripts" / "bench_rank.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    masks = bench.masks(SEQ, 1, 0)
    return {name: [b - a for a, b in masks[f"packed {name}"].documents[0]] for name in bench.MIXES}


@pytest.mark.parametrize("name", ["long", "mixed", "short"])
def test_split_mixes_balance_every_rank(mixes, name: str) -> None:
    lengths = mixes[name]
    mask, _ = split_documents([lengths], seq_len=SEQ, world=WORLD)
    shape = AttentionShape(batch=1, seq_local=PER_RANK, heads=32, kv_heads=8, head_dim=128, itemsize=2)
    plan = make_plan(Tiling(WORLD, 4, 4), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
    pairs = [plan.pairs(rank) for rank in range(WORLD)]
    assert pairs == rank_pairs([lengths], seq_len=SEQ, world=WORLD, tile=(4, 4), split=True)
    assert max(pairs) * WORLD / sum(pairs) <= 1.01, pairs
    packed = rank_pairs([lengths], seq_len=SEQ, world=WORLD, tile=(4, 4))
    assert sum(pairs) == sum(packed)  # the same documents: the same pairs in all
    call = AttentionCall(mesh=None, plan=plan, kernel=SegmentsOnly(), scale=1.0)
    for rank in (0, 5, 15):
        masked = [w for w in plan.blocks(rank) if w.kind is MaskKind.MASKED]
        assert masked and all(len(plan.tiles(w, runs=True)) <= 3 for w in masked)
        assert call.kernel_calls(rank) <= 3 * len(plan.blocks(rank))


def _check_layout(lengths: list[int], seq: int, world: int) -> None:
    mask, (source,) = split_documents([lengths], seq_len=seq, world=world)
    assert sorted(source) == list(range(seq))
    size, starts = seq // (2 * world), [sum(lengths[:d]) for d in range(len(lengths))]
    fills = []
    for h in range(2 * world):
        inside = [
            (s, d) for s, d in zip(mask.documents[0], mask.parts[0], strict=True) if h * size <= s[0] < (h + 1) * size
        ]
        docs = [d for _, d in inside]
        assert docs == sorted(set(docs)), (h, docs)  # one part per document, in document order
        assert all(stop <= (h + 1) * size for (_, stop), _ in inside)
        fills.append(sum(stop - start for (start, stop), _ in inside))
    assert max(fills) - min(fills) <= 1
    for d, n in enumerate(lengths):
        spans = mask.document_spans(0, seq)[d]
        sizes = [b - a for a, b in spans]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
        packed = [source[g] for a, b in spans for g in range(a, b)]
        assert packed == list(range(starts[d], starts[d] + n))  # the parts in order are the document


def _dense_pairs(lengths: list[int], seq: int, world: int, tile: tuple[int, int]) -> list[int]:
    """Pairs per rank counted over the packed row: token ``g`` of the split row is packed token ``source[g]``,
    which attends packed tokens of its own document at or before it."""
    _, (source,) = split_documents([lengths], seq_len=seq, world=world)
    doc = [-1] * seq
    for d in range(len(lengths)):
        for p in range(sum(lengths[:d]), sum(lengths[: d + 1])):
            doc[p] = d
    tiling = Tiling(world, *tile)
    chunks = [[source[g] for a, b in chunk_ranges(seq, world, x, "zigzag") for g in range(a, b)] for x in range(world)]
    out = []
    for rank in range(world):
        total = 0
        for x, y in tiling.blocks(rank):
            total += sum(1 for q in chunks[x] for k in chunks[y] if doc[q] >= 0 and doc[q] == doc[k] and k <= q)
        out.append(total)
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([(2, (1, 2)), (3, (3, 1)), (4, (2, 2)), (6, (2, 3))]),
    st.integers(1, 3),
    st.lists(st.integers(1, 30), min_size=1, max_size=6),
)
def test_split_layout_and_pairs(world_tile, per_half: int, lengths: list[int]) -> None:
    world, tile = world_tile
    seq = 2 * world * per_half * 4
    lengths = [n for i, n in enumerate(lengths) if sum(lengths[: i + 1]) <= seq] or [1]
    _check_layout(lengths, seq, world)
    assert rank_pairs([lengths], seq_len=seq, world=world, tile=tile, split=True) == _dense_pairs(
        lengths, seq, world, tile
    )


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: split_documents([[30]], seq_len=16, world=2),
            ValueError,
            r"documents \[30\] must be .* fit the row's 16",
        ),
        (lambda: split_documents([[3]], seq_len=15, world=2), ValueError, "15"),
        (
            lambda: AttentionMask(documents=(((0, 2), (4, 6)),), parts=((0, 0),), window=3),
            NotImplementedError,
            r"a window \(3\) counts positions inside a document",
        ),
        (
            lambda: AttentionMask(documents=(((0, 2), (4, 6)),), parts=((0,),)),
            ValueError,
            r"parts of row 0 must be a document number >= 0 for each of its 2 spans, got \(0,\)",
        ),
        (
            lambda: rank_pairs([[5]], seq_len=8, world=2, layout="contiguous", split=True),
            ValueError,
            "zig-zag layout's half-chunks, got layout 'contiguous'",
        ),
    ],
)
def test_bad_input_is_refused_with_the_fix(call, error, message: str) -> None:
    with pytest.raises(error, match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 4]), parts=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_thd_layout_holds_transformer_engines_tokens_in_the_split_order(world: int, parts: list[int]) -> None:
    """Note [THD layout]: the partition is TransformerEngine's kernel's, and ``thd_layout``'s order puts exactly those
    tokens in the split layout's order of the same documents (every local token once)."""
    lengths = [2 * world * n for n in parts]
    bounds = [0, *[sum(lengths[: i + 1]) for i in range(len(lengths))]]
    total = bounds[-1]
    split_mask, (source,) = split_documents([lengths], seq_len=total, world=world)
    for rank in range(world):
        mask, order = thd_layout(bounds, world=world, rank=rank)
        assert mask == split_mask
        te = thd_partitioned_indices(bounds, total, world, rank)
        assert te == _thd_partition_indices_kernel(bounds, total, world, rank)
        split_positions = [g for lo, hi in chunk_ranges(total, world, rank, "zigzag") for g in range(lo, hi)]
        assert [te[j] for j in order] == [source[g] for g in split_positions]
        assert sorted(order) == list(range(total // world))


def _thd_partition_indices_kernel(cu_seqlens: list[int], total_tokens: int, world_size: int, rank: int) -> list[int]:
    """TransformerEngine's ``thd_partition_indices_kernel`` (``common/fused_attn/context_parallel.cu``), one thread
    per local token, line by line."""
    cu_seqlens_s = [seqlen // world_size for seqlen in cu_seqlens]
    output = []
    for token_id in range(total_tokens // world_size):
        seq_id = bisect.bisect_right(cu_seqlens_s, token_id) - 1  # binary_search: the last entry <= token_id
        seq_len = cu_seqlens_s[seq_id + 1] - cu_seqlens_s[seq_id]
        index = token_id - cu_seqlens_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_seqlens_s[seq_id] * world_size + seq_len // 2 * offset
        output.append(index)
    return output


def test_thd_layout_refuses_unpadded_documents() -> None:
    with pytest.raises(ValueError, match=r"padded to a multiple of 2\*CP = 4 \(got lengths \[4, 6\]\)"):
        thd_layout([0, 4, 10], world=2, rank=0)
    with pytest.raises(ValueError, match=r"rise from 0 to the row's 12 tokens"):
        thd_partitioned_indices([0, 4, 8], 12, 2, 0)
