"""Packed documents, padding, windows and softcap over a CP mesh, against a single-process fp64 reference.

One spawned group per P (4, 6 and 8) runs every tile and both schedules on masks drawn at random: documents of
1 token, shorter than a chunk and longer than a shard, left and right padding, windows smaller and larger than a
chunk, softcapped logits, causal (zig-zag) and bidirectional documents (contiguous), documents split over the
ranks (Note [Split documents]), GQA, batch 2. Every rank
compares its shard of the output, the lse (with ``-inf`` where a query attends nothing) and dq, dk, dv (a loss on
out and on the lse) with the reference. Masked blocks are cut into tiles of 3 rows, so every kind of tile runs;
at P = 4 and 6 every case also runs on a kernel that takes masked tiles only as flash-attn varlen sequences
(Note [Tile segments]) and softcaps logits itself, as ``flash_attn`` does on CUDA.
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

import mesh_cp
from mesh_cp.core import AttentionMask, factorizations
from mesh_cp.core.split import split_documents
from mesh_cp.kernels import Capabilities
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.testing import spawn_gloo
from tests.group_sizes import by_group_size, size_results
from tests.runtime.reference import errors_against_reference

TOL = 1e-5
REF = ReferenceKernel()
HALF = 4  # tokens per half-chunk: a shard holds 2 * HALF, the sequence 2 * P * HALF


def random_documents(rng: random.Random, seq: int, *, pad_left: int = 0, pad_right: int = 0) -> tuple:
    """Spans covering ``[pad_left, seq - pad_right)``: 1-token documents, short ones and one longer than a shard."""
    spans, start, stop = [], pad_left, seq - pad_right
    while start < stop:
        n = min(stop - start, rng.choice([1, 1, 2, 3, HALF + 1, 3 * HALF, 5 * HALF]))
        spans.append((start, start + n))
        start += n
    return tuple(spans)


def cases(world: int, seed: int) -> dict[str, dict]:
    """Name -> keyword arguments of one case (mask, causal, layout, softcap)."""
    rng, seq = random.Random(seed), 2 * world * HALF
    packed = AttentionMask(documents=(random_documents(rng, seq), random_documents(rng, seq)))
    all_cases = {
        "packed causal": {"mask": packed, "causal": True},
        "packed bidirectional": {"mask": packed, "causal": False, "layout": "contiguous"},
        "window < chunk, packed": {"mask": AttentionMask(documents=packed.documents, window=3), "causal": True},
        "window > chunk": {"mask": AttentionMask(window=3 * HALF + 1), "causal": True},
        "left and right padding": {
            "mask": AttentionMask(documents=(((0, seq - 5),), ((HALF + 3, seq),))),
            "causal": True,
        },
        "softcap, padded documents": {
            "mask": AttentionMask(
                documents=(random_documents(rng, seq, pad_left=3), random_documents(rng, seq, pad_right=HALF + 1))
            ),
            "causal": True,
            "softcap": 2.0,
        },
        "softcap alone": {"mask": None, "causal": True, "softcap": 1.5},
        "split documents": {"mask": split_mask(rng, seq, world), "causal": True},
    }
    kept = ("packed causal", "window < chunk, packed", "split documents")
    return all_cases if world != 8 else {k: all_cases[k] for k in kept}


def split_mask(rng: random.Random, seq: int, world: int) -> AttentionMask:
    """Two rows of documents laid out split (Note [Split documents]): one longer than the row's half, documents
    shorter than the 2P parts (some parts empty), padding after them."""
    rows = [[seq // 2 + 3, 1, 2 * world - 1, 5], [rng.randint(1, 2 * HALF) for _ in range(4)]]
    return split_documents(rows, seq_len=seq, world=world)[0]


def segments_dense(segments: tuple, sq: int, sk: int) -> torch.Tensor:
    """``(B, 1, Sq, Sk)`` boolean of flash-attn varlen sequences with windows (bottom-right aligned, ``-1``: no
    bound), asserting the contract that every query of a sequence sees a key. A sequence of five,
    ``(q0, q1, key ranges, left, right)``, reads the band on its key ranges laid end to end; no key is laid twice in
    it and no query is in two sequences."""
    mask = torch.zeros(len(segments), 1, sq, sk, dtype=torch.bool)
    for b, row in enumerate(segments):
        for seg in row:
            q0, q1, *keys, left, right = seg
            keys = [tuple(keys)] if len(keys) == 2 else list(keys[0])
            cols = [c for k0, k1 in keys for c in range(k0, k1)]
            assert len(set(cols)) == len(cols) and not mask[b, 0, q0:q1].any(), seg
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(len(cols))[None, :]
            shift = len(cols) - (q1 - q0)
            seen = torch.ones(q1 - q0, len(cols), dtype=torch.bool)
            if left >= 0:
                seen &= j >= i + shift - left
            if right >= 0:
                seen &= j <= i + shift + right
            assert seen.any(1).all(), seg
            for c, col in enumerate(cols):
                mask[b, 0, q0:q1, col] = seen[:, c]
    return mask


class SegmentsKernel:
    """A kernel that, like flash-attn, takes masked tiles only as varlen sequences and softcaps logits itself
    (computed by the reference kernel on the dense equivalent)."""

    name = "segments"
    capabilities = Capabilities(keywords={"segments", "softcap"})

    def forward(self, q, k, v, *, causal, scale, segments=None, softcap=None):
        mask = None if segments is None else segments_dense(segments, q.shape[1], k.shape[1])
        assert not (causal and segments is not None)
        return REF.forward(q, k, v, causal=causal, scale=scale, mask=mask, softcap=softcap)

    def backward(self, do, q, k, v, lse, delta, *, causal, scale, lse_grad=False, segments=None, softcap=None):
        mask = None if segments is None else segments_dense(segments, q.shape[1], k.shape[1])
        return REF.backward(do, q, k, v, lse, delta, causal=causal, scale=scale, mask=mask, softcap=softcap)


class GapsKernel(SegmentsKernel):
    """:class:`SegmentsKernel` that reads segments with rows between them in place, as the flash kernels do
    (``seqused_k``, or sequences without queries over the rows between): a chunk call's row groups read the keys from
    one section of the layout each (Note [Keys in global order] in :mod:`mesh_cp.core.key_layout`)."""

    capabilities = Capabilities(keywords={"segments", "softcap"}, gaps=True)


KERNELS = {"auto": "auto", "segments": GapsKernel()}


def run_case(mesh, name: str, case: dict, schedule: str, seed: int, kernel="auto") -> dict[str, float]:
    shape = (2, 2 * mesh.size * HALF, 4, 2, 8)  # batch, seq, heads, kv_heads, head_dim
    options = {"causal": case["causal"], "mask": case["mask"], "softcap": case.get("softcap")}
    layout = case.get("layout", "zigzag")
    return errors_against_reference(mesh, shape, seed=seed, layout=layout, schedule=schedule, kernel=kernel, **options)


def kernels(world: int) -> tuple[str, ...]:
    """The CPU kernel choice everywhere; the varlen-sequence path (Note [Tile segments]) at P = 4 and 6."""
    return ("auto", "segments") if world != 8 else ("auto",)


WORLDS = (4, 6, 8)


def masks_worker(rank: int, world: int) -> dict[int, dict]:
    """Every P of :data:`WORLDS` on the first P ranks of one spawned group."""
    import mesh_cp.core.masks

    mesh_cp.core.masks.TILE = 3  # masked blocks of 4 and 8 rows cut into tiles of every kind: full, causal, masked
    return by_group_size(WORLDS, mask_cases, rank, world)


def mask_cases(group, rank: int, world: int) -> dict:
    results: dict = {}
    for tile in factorizations(world):
        mesh = mesh_cp.CPMesh.create(group, tile=tile)
        for name, case in cases(world, seed=world).items():
            for schedule, kernel in itertools.product(("overlap", "collective"), kernels(world)):
                key = f"P{world} {tile[0]}x{tile[1]} {schedule} {kernel} {name}"
                seed = zlib.crc32(key.encode()) % 1000
                results[key] = run_case(mesh, name, case, schedule, seed, kernel=KERNELS[kernel])
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, dict]]:
    """One spawned group of max(WORLDS) ranks; each P runs on its first P ranks."""
    return spawn_gloo(masks_worker, max(WORLDS))


@pytest.fixture(scope="module", params=WORLDS)
def mask_results(request, spawned) -> tuple[int, list[dict]]:
    return request.param, size_results(spawned, request.param)


def test_masked_attention_matches_single_process_reference(mask_results) -> None:
    world, results = mask_results
    expected = len(factorizations(world)) * len(cases(world, world)) * 2 * len(kernels(world))
    for rank, result in enumerate(results):
        assert len(result) == expected, sorted(result)
        bad = {k: v for k, v in result.items() if max(v.values()) > TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_softcap_needs_a_kernel_that_softcaps() -> None:
    """Named kernels that cannot softcap logits refuse it with the ones that can; 'auto' runs it anywhere."""
    from mesh_cp.runtime.attention import CallOptions

    def options(softcap: object, kernel: object) -> CallOptions:
        return CallOptions(
            causal=True,
            return_lse=False,
            layout="zigzag",
            softmax_scale=None,
            kernel=kernel,
            schedule="overlap",
            backward="regather",
            buffer_budget=None,
            mask=None,
            softcap=softcap,
        )

    for kernel in ("auto", "reference", "flash_attn", SegmentsKernel()):
        assert options(30, kernel).softcap == 30.0
    for kernel in ("cpu_flash", "cuda_flash", "cuda_sdpa"):
        with pytest.raises(NotImplementedError, match=f"kernel '{kernel}' does not softcap logits.*'flash_attn'"):
            options(30.0, kernel)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        options(0, "auto")
