"""The FlashAttention 4 kernel under the mesh, on its CPU emulation (:mod:`mesh_cp.testing.fa4_emulation`): every tile
of P = 4 and both schedules, causal, packed and split documents, MHA and GQA, bf16, against the fp64 reference.

A chunk call's row groups read their keys from the sections of the layout laid once per phase, with the rows between
them left unread through ``seqused_k`` (Note [Keys in global order] in ``mesh_cp/core/key_layout.py``); the bar is the
same mesh with the reference kernel on the same bf16 inputs (whose gradients come back in fp32, where FA4's are rounded
to bf16 per call before they are summed: up to about 3x the reference's error at tile 4x1).
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

import mesh_cp
from mesh_cp.core import AttentionMask, factorizations
from mesh_cp.testing import spawn_gloo
from tests.runtime.reference import errors_against_reference
from tests.runtime.test_masks import random_documents, split_mask

WORLD, HALF = 4, 4
SEQ = 2 * WORLD * HALF


def cases() -> dict[str, AttentionMask | None]:
    rng = random.Random(4)
    packed = AttentionMask(documents=(random_documents(rng, SEQ), random_documents(rng, SEQ)))
    return {"causal": None, "packed": packed, "split": split_mask(rng, SEQ, WORLD)}


def fa4_worker(rank: int, world: int) -> dict[str, tuple[dict, dict, int]]:
    import torch.distributed as dist

    from mesh_cp.kernels.flash_attn4 import FlashAttn4Kernel
    from mesh_cp.testing import fa4_emulation

    results = {}
    with fa4_emulation.installed(arch=90) as emulated:
        kernel = FlashAttn4Kernel.without_device_check()
        for tile in factorizations(world):
            mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
            for schedule, (name, mask), kv_heads in itertools.product(
                ("overlap", "collective"), cases().items(), (4, 2)
            ):
                key = f"{tile[0]}x{tile[1]} {schedule} {name} 4:{kv_heads}"
                seed = zlib.crc32(key.encode()) % 1000
                options = {"seed": seed, "layout": "zigzag", "causal": True, "mask": mask, "schedule": schedule}
                shape = (2, SEQ, 4, kv_heads, 16)
                before = len(emulated.calls)
                fa4 = errors_against_reference(mesh, shape, kernel=kernel, dtype=torch.bfloat16, **options)
                calls = len(emulated.calls) - before
                ref = errors_against_reference(mesh, shape, kernel="reference", dtype=torch.bfloat16, **options)
                results[key] = (fa4, ref, calls)
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return spawn_gloo(fa4_worker, WORLD)


def test_flash_attn4_matches_the_reference_under_the_mesh(spawned) -> None:
    expected = len(factorizations(WORLD)) * 2 * len(cases()) * 2
    for rank, results in enumerate(spawned):
        assert len(results) == expected, sorted(results)
        for key, (fa4, ref, calls) in results.items():
            assert calls > 0, (rank, key)
            for name, err in fa4.items():
                assert err <= 3 * ref[name] + 3e-3, (rank, key, name, err, ref[name])
