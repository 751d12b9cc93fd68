"""Kernel calls per rank and layer of the collective schedule (Note [One call per Q chunk]): the counts at P = 16 and
L = 8192 tokens per rank, and the chunk calls' results against the per-block calls and single-process attention.

The counts run every rank's kernel calls in one process (:func:`~mesh_cp.runtime.executors.forward_blocks` and
:func:`~mesh_cp.runtime.executors.backward_blocks` are what the executor runs between its collectives) with a kernel
that records its calls and computes nothing, so they cost no attention FLOPs.
"""

from __future__ import annotations

import random

import pytest
import torch

from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, make_plan
from mesh_cp.core.blocks import ChunkCall
from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import document_ids, reference_attention, visibility
from mesh_cp.core.split import split_documents
from mesh_cp.kernels import Capabilities, get_kernel
from mesh_cp.runtime.call import AttentionCall
from mesh_cp.runtime.executors import backward_blocks, forward_blocks
from tests.runtime.test_masks import GapsKernel, SegmentsKernel

P, L = 16, 8192
MIXES = {"long": (8192, 32768), "mixed": (1024, 8192), "short": (256, 2048)}


class RecordingKernel:
    """Records every call (its rows, keys and keywords) and returns zeros: counts without FLOPs."""

    name = "recording"

    def __init__(self, keywords: set[str], gaps: bool = False) -> None:
        self.capabilities = Capabilities(keywords=keywords, gaps=gaps)
        self.calls: list[tuple[str, int, int, bool]] = []
        self.storages: list[int] = []
        """The storage every forward call's keys and values are views of."""

    def forward(self, q, k, v, *, causal, scale, **extra):
        self.calls.append(("forward", q.shape[1], k.shape[1], "segments" in extra))
        self.storages += [("k", k.untyped_storage().data_ptr()), ("v", v.untyped_storage().data_ptr())]
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return torch.zeros_like(q), lse

    def backward(self, do, q, k, v, lse, delta, *, causal, scale, lse_grad=False, **extra):
        self.calls.append(("backward", q.shape[1], k.shape[1], "segments" in extra))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def packed(lo: int, hi: int, seed: int, split: bool = False) -> AttentionMask:
    """A row of documents of ``lo`` to ``hi`` tokens filling ``P * L``; with ``split`` laid out per document
    (Note [Split documents])."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < P * L:
        lengths.append(min(rng.randint(lo, hi), P * L - sum(lengths)))
    return split_documents([lengths], seq_len=P * L, world=P)[0] if split else AttentionMask.from_lengths([lengths])


def calls_per_rank(
    tile: tuple[int, int], keywords: set[str], mask: AttentionMask | None = None, gaps: bool = False
) -> list[dict]:
    """Per rank: forward and backward kernel calls and Q chunks held, at P = 16, L = 8192, batch 1, one head."""
    shape = AttentionShape(batch=1, seq_local=L, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    plan = make_plan(Tiling(P, *tile), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
    ids = None if mask is None else document_ids(mask, 1, P * L)
    out = []
    for rank in range(P):
        kernel = RecordingKernel(keywords, gaps)
        call = AttentionCall(mesh=None, plan=plan, kernel=kernel, scale=1.0, doc_ids=ids)
        q_all = torch.zeros(tile[0], 1, L, 1, 8)
        kv_all = torch.zeros(tile[1], 2, 1, L, 1, 8)
        forward_blocks(call, rank, q_all, kv_all)
        backward_blocks(call, rank, q_all, q_all, torch.zeros(tile[0], 2, 1, 1, L), kv_all)
        blocks = plan.blocks(rank)
        out.append(
            {
                "forward": [c for c in kernel.calls if c[0] == "forward"],
                "backward": [c for c in kernel.calls if c[0] == "backward"],
                "q_chunks": len({w.x for w in blocks}),
                "blocks": len(blocks),
                "masked": sum(w.kind is MaskKind.MASKED for w in blocks),
                "storages": {
                    n: {p for m, p in kernel.storages if m == n} - {kv_all.untyped_storage().data_ptr()} for n in "kv"
                },
            }
        )
    return out


@pytest.mark.parametrize("tile", [(4, 4), (2, 8), (8, 2), (1, 16)])
def test_causal_one_call_per_q_chunk_and_phase(tile) -> None:
    """A kernel that takes segments: exactly one call per Q chunk held, in each phase, on every rank."""
    for rank, r in enumerate(calls_per_rank(tile, {"segments"})):
        assert len(r["forward"]) == r["q_chunks"] == tile[0], (rank, r["forward"])
        assert len(r["backward"]) == r["q_chunks"], (rank, r["backward"])


@pytest.mark.parametrize("tile", [(4, 4), (2, 8), (8, 2)])
@pytest.mark.parametrize(("keywords", "gaps"), [(set(), False), ({"segments"}, False), ({"segments"}, True)])
def test_keys_are_laid_once_per_phase(tile, keywords, gaps) -> None:
    """Every call reads its keys and values as views of the gathered K, V chunks or of one tensor laid for the whole
    phase (Note [Keys in global order]): no call gets keys laid for it alone. The calls per Q chunk are one with
    segments (gaps or not), at most two per row group without."""
    for rank, r in enumerate(calls_per_rank(tile, keywords, gaps=gaps)):
        assert all(len(laid) <= 1 for laid in r["storages"].values()), (rank, r)
        limit = 1 if keywords else 4
        assert len(r["forward"]) <= limit * r["q_chunks"], (rank, r["forward"])


def test_program_takes_the_reference_kernels_keywords() -> None:
    """Core routes tiles to the reference kernel by the keywords it takes, written there without importing kernels."""
    from mesh_cp.core.program import REFERENCE_KEYWORDS
    from mesh_cp.kernels.reference import ReferenceKernel

    assert ReferenceKernel.capabilities.keywords == REFERENCE_KEYWORDS


def test_causal_calls_of_a_kernel_without_segments() -> None:
    """Without segments a zig-zag chunk is its two halves, and the diagonal a call of its own: at most 2 calls per Q
    chunk and 2 more for the chunk holding the diagonal, against 4 blocks per chunk at tile 4x4."""
    for r in calls_per_rank((4, 4), set()):
        assert len(r["forward"]) <= 2 * r["q_chunks"] + 2 < r["blocks"], r["forward"]
        assert len(r["backward"]) == len(r["forward"])


@pytest.mark.parametrize("mix", list(MIXES))
def test_packed_masked_blocks_are_one_call_each_on_segment_kernels(mix) -> None:
    """Packed documents on a kernel that takes segments: every block is at most one call in each phase (a masked
    block's documents are the varlen sequences of one call, Note [Block segments]), against 512-row tiles on a kernel
    that takes only masks."""
    mask = packed(*MIXES[mix], seed=len(mix))
    segment_calls = calls_per_rank((4, 4), {"segments"}, mask)
    for r in segment_calls:
        assert len(r["forward"]) == len(r["backward"]) <= r["blocks"], r
    split = calls_per_rank((4, 4), {"segments"}, packed(*MIXES[mix], seed=len(mix), split=True))
    for r in split:  # every block holds a part of every document, and is one call
        assert len(r["forward"]) == len(r["backward"]) == r["blocks"] == r["masked"], r
    tiled = calls_per_rank((4, 4), {"mask"}, mask)
    assert sum(len(r["forward"]) for r in tiled) > 10 * sum(len(r["forward"]) for r in segment_calls)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("tile", [(4, 4), (2, 8), (8, 2)])
def test_packed_layout_holds_only_rows_a_call_reads(mix, tile) -> None:
    """Packed documents as one call per Q chunk (Note [Documents in global order]): every piece the phase lays is read
    by a call, and every call's pieces lie in its key range."""
    from mesh_cp.core.program import KernelMode, rank_program

    shape = AttentionShape(batch=1, seq_local=L, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    plan = make_plan(Tiling(P, *tile), shape, causal=True, layout="zigzag", schedule="collective")
    plan = make_plan(
        plan.tiling, shape, causal=True, layout="zigzag", schedule="collective", mask=packed(*MIXES[mix], 3)
    )
    mode = KernelMode(frozenset({"segments"}), None, True)
    for rank in range(P):
        prog = rank_program(plan, rank, mode)
        starts, at = [], 0
        for _, (r0, r1) in prog.layout:
            starts.append(at)
            at += r1 - r0
        read = {c.keys[0] + off for c in prog.calls for _, _, _, off in c.pieces}
        assert read == set(starts), (rank, sorted(set(starts) - read))
        for c in prog.calls:
            assert all(0 <= off and c.keys[0] + off < c.keys[1] for _, _, _, off in c.pieces), (rank, c)


def test_block_segments_see_exactly_the_masked_pairs() -> None:
    """Every masked block's one-call segments, drawn as a dense mask, equal the mask's visibility over the block's
    global positions (documents, padding; causal zig-zag and contiguous, and full attention; split documents, whose
    segments lay their key parts end to end), for every rank's blocks; a window gives no one-call segments."""
    rng = random.Random(7)
    world, seq_local = 4, 12
    S = world * seq_local
    for trial in range(12):
        rows = []
        for _ in range(2):
            lengths, pad = [], rng.randint(0, 3)
            while pad + sum(lengths) < S - 2:
                lengths.append(rng.randint(1, S // 2))
            rows.append(lengths[:-1] or [1])
        cases = [(AttentionMask.from_lengths(rows, pad_left=[0, 2]), ("zigzag", "contiguous"))]
        cases.append((split_documents(rows, seq_len=S, world=world)[0], ("zigzag",)))
        for mask, layouts in cases:
            _check_block_segments(mask, layouts, world, seq_local, trial)
    windowed = AttentionMask.from_lengths([[S]], window=5)
    shape = AttentionShape(batch=1, seq_local=seq_local, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    plan = make_plan(Tiling(world, 2, 2), shape, causal=True, layout="zigzag", schedule="collective", mask=windowed)
    masked = [w for r in range(world) for w in plan.blocks(r) if w.kind is MaskKind.MASKED]
    assert masked and all(plan.block_segments(w) is None for w in masked)


def _check_block_segments(
    mask: AttentionMask, layouts: tuple[str, ...], world: int, seq_local: int, trial: int
) -> None:
    from mesh_cp.kernels.varlen import segments_mask

    S = world * seq_local
    ids = document_ids(mask, 2, S)
    for causal, layout in [(True, layout) for layout in layouts] + [(False, "contiguous")]:
        shape = AttentionShape(batch=2, seq_local=seq_local, heads=1, kv_heads=1, head_dim=8, itemsize=4)
        plan = make_plan(Tiling(world, 2, 2), shape, causal=causal, layout=layout, schedule="collective", mask=mask)
        for rank in range(world):
            for w in plan.blocks(rank):
                if w.kind is not MaskKind.MASKED:
                    continue
                segments = plan.block_segments(w)
                assert segments is not None, (trial, causal, layout, w)
                (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
                qp = torch.tensor(local_positions(S, world, w.x, layout)[q0:q1])
                kp = torch.tensor(local_positions(S, world, w.y, layout)[k0:k1])
                want = visibility(ids, qp, kp, causal=causal, window=None)
                got = segments_mask(segments, q1 - q0, k1 - k0)
                assert torch.equal(got.expand_as(want), want), (trial, causal, layout, w, segments)


def test_chunk_call_groups_cover_the_blocks() -> None:
    """The row groups of every chunk call hold exactly its blocks' query-key pairs (causal tails counted as the
    bottom-right triangle), for zig-zag causal, contiguous causal and full attention."""
    shape = AttentionShape(batch=1, seq_local=12, heads=1, kv_heads=1, head_dim=8, itemsize=4)
    for causal, layout in ((True, "zigzag"), (True, "contiguous"), (False, "contiguous")):
        plan = make_plan(Tiling(8, 2, 4), shape, causal=causal, layout=layout, schedule="collective")
        for rank in range(8):
            for c in plan.calls(rank):
                if not isinstance(c, ChunkCall):
                    continue
                counted = 0
                for g in c.groups:
                    n = g.q_rows[1] - g.q_rows[0]
                    counted += n * g.key_count - (n * (n - 1) // 2 if g.causal_tail else 0)
                assert counted == sum(w.pairs for w in c.blocks), (causal, layout, rank, c)


@pytest.mark.parametrize("kernel_name", ["reference", "cpu_flash", "segments_only", "segments_gaps"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("packed_rows", [None, "packed", "split"])
def test_chunk_calls_match_single_process_attention(kernel_name, kv_heads, packed_rows) -> None:
    """Every rank's forward and backward through chunk calls (one varlen call on a kernel that takes only segments, as
    the flash kernels do; group by group on ``reference`` and ``cpu_flash``, which take masks) and, with packed
    documents and padding (or split documents), masked blocks (one call of segments on the segments-only kernel, a
    split one's key parts laid end to end; tiles with a mask on the others), assembled over all ranks as the
    collectives would, against single-process attention of the whole sequence: out, lse and dq, dk, dv (fp64)."""
    world, tile, seq_local, heads, dim = 8, (2, 4), 10, 4, 16
    S = world * seq_local
    mask = {
        None: None,
        "packed": AttentionMask.from_lengths([[13, 30, 20, 17], [5, 40, 31]], pad_left=[0, 4]),
        "split": split_documents([[13, 30, 20, 17], [5, 40, 31]], seq_len=S, world=world)[0],
    }[packed_rows]
    shape = AttentionShape(batch=2, seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=8)
    plan = make_plan(Tiling(world, *tile), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, S, heads, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, S, kv_heads, dim, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    do = torch.randn(2, S, heads, dim, dtype=torch.float64, generator=gen)
    out_ref, lse_ref = reference_attention(q, k, v, causal=True, softmax_scale=0.25, mask=mask)
    out_ref.backward(do)
    pos = [torch.tensor(local_positions(S, world, r, "zigzag")) for r in range(world)]
    chunk = lambda t, r: t.detach()[:, pos[r]]  # noqa: E731
    kernels = {"segments_only": SegmentsKernel, "segments_gaps": GapsKernel}
    kernel = kernels[kernel_name]() if kernel_name in kernels else get_kernel(kernel_name)
    # a kernel taking only segments gets no document ids (the runtime builds none for it)
    ids = None if mask is None or kernel_name in kernels else document_ids(mask, 2, S)
    call = AttentionCall(mesh=None, plan=plan, kernel=kernel, scale=0.25, doc_ids=ids)
    t = plan.tiling
    units = [u for r in range(world) for u in call.units(r)]
    assert packed_rows or any(isinstance(u, ChunkCall) for u in units)
    if packed_rows:
        masked = [u for u in units if not isinstance(u, ChunkCall) and u.kind is MaskKind.MASKED]
        assert masked and all(plan.block_segments(w) is not None for w in masked)
    rows = {}
    for rank in range(world):
        q_all = torch.stack([chunk(q, x) for x in t.q_group(rank)])
        kv_all = torch.stack([torch.stack((chunk(k, y), chunk(v, y))) for y in t.kv_group(rank)])
        rows[rank] = (q_all, kv_all, *forward_blocks(call, rank, q_all, kv_all))
    # merge each row's partials over its Q-group (the forward's all-to-all), then check against the reference
    from mesh_cp.core.numerics import attention_delta, merge_

    final = {}
    for x in range(world):
        o = torch.zeros(2, seq_local, heads, dim, dtype=torch.float64)
        lse = torch.full((2, heads, seq_local), float("-inf"), dtype=torch.float64)
        for rank in t.q_group(x):
            i = t.q_group(rank).index(x)
            merge_(o, lse, rows[rank][2][i], rows[rank][3][i])
        final[x] = (o, lse)
        torch.testing.assert_close(o, chunk(out_ref, x), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, lse_ref.detach()[:, :, pos[x]], rtol=1e-10, atol=1e-10)
    dq = {x: 0 for x in range(world)}
    dkv = {y: 0 for y in range(world)}
    for rank in range(world):
        q_all, kv_all = rows[rank][:2]
        xs = t.q_group(rank)
        do_all = torch.stack([chunk(do, x) for x in xs])
        stats = torch.stack([torch.stack((final[x][1], attention_delta(chunk(do, x), final[x][0]))) for x in xs])
        dq_acc, dkv_acc = backward_blocks(call, rank, q_all, do_all, stats, kv_all)
        for i, x in enumerate(xs):
            dq[x] = dq[x] + dq_acc[i]
        for j, y in enumerate(t.kv_group(rank)):
            dkv[y] = dkv[y] + dkv_acc[j]
    for x in range(world):
        torch.testing.assert_close(dq[x], chunk(q.grad, x), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(dkv[x][0], chunk(k.grad, x), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(dkv[x][1], chunk(v.grad, x), rtol=1e-9, atol=1e-9)
