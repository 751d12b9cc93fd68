"""The bytes counter (Note [Bytes outside the kernels]) and scripts/bench_copies.py against the runtime before the rank
programs (docs/results/bench_copies_before.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mesh_cp.kernels import get_kernel
from mesh_cp.kernels.fused import merge_
from mesh_cp.testing.copies import WrittenBytes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_copies  # noqa: E402


def test_counter_counts_writes_outside_kernels_once_per_fused_pass() -> None:
    x, y = torch.zeros(4, 8), torch.ones(4, 8)
    kernel = get_kernel("reference")
    q = torch.randn(1, 3, 2, 4)
    o_acc, lse_acc = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf"))
    with WrittenBytes() as counter:
        x.copy_(y)  # 128 bytes written
        x[1:].view(-1)  # views write nothing
        torch.cat([x, y])  # 256
        o, lse = kernel.forward(q, q, q, causal=True, scale=0.5)  # the kernel's own ops: not counted
        merge_(o_acc, lse_acc, o, lse)  # one pass: the accumulators it rewrites, 96 + 24
    assert counter.by_op == {"copy_": 128, "cat": 256, "fused:merge_": 120}
    assert counter.copied == 384 and counter.total == 504
    assert counter.calls == {"forward": 1}


def test_fewer_bytes_and_no_more_calls_than_before(tmp_path) -> None:
    """P = 4, tile 2x2, collective and overlapped, causal and packed, MHA and GQA, for cpu_flash and the flash kernels'
    call structure: every row copies at most half the bytes it copied before, writes at most 0.55 of them, and makes
    no more calls per Q chunk. Nothing is stacked before a collective."""
    out = tmp_path / "copies.json"
    rows = bench_copies.main(["--worlds", "4", "--json", str(out)])
    before = {
        bench_copies.key(r): r for r in json.loads((ROOT / "docs/results/bench_copies_before.json").read_text())["rows"]
    }
    assert len(rows) == 16 and json.loads(out.read_text())["rows"] == rows
    for row in rows:
        old = before[bench_copies.key(row)]
        written, copied = (row[f"forward{s}"] + row[f"backward{s}"] for s in ("", "_copied"))
        assert copied <= 0.5 * (old["forward_copied"] + old["backward_copied"]), row
        assert written <= 0.55 * (old["forward"] + old["backward"]), row
        assert "stack" not in {*row["forward_by_op"], *row["backward_by_op"]}, row
        assert row["calls_per_q_chunk"] <= old["calls_per_q_chunk"], row
        if row["schedule"] == "collective":  # the keys laid once per phase, at most 1.5 times the KV chunks held
            assert row["forward_by_op"].get("cat", 0) <= 1.5 * 2, row
