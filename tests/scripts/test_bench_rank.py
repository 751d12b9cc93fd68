"""``scripts/bench_rank.py --quick`` on CPU: it exits 0 and prints its tables, and its JSON has a row per head
layout and mask and a decode row per head layout, positive times, fractions of the single call's rate in ``(0,
5)``, the kernel calls counted in rank 0's forward equal to what the plan says (one per block for causal rows,
``len(plan.blocks(0))``), and a baseline whose causal pairs match rank 0's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mesh_cp.core import AttentionShape, Tiling, make_plan, most_square_tile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_rank.py"
WORLD, L, HEADS, HEAD_DIM = 16, 128, 4, 64
MASKS = ("causal", "packed long", "packed mixed", "packed short")


def test_bench_rank_quick(tmp_path: Path) -> None:
    out = tmp_path / "rank.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--world", str(WORLD), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["world"], doc["head_dim"], doc["kernel"], doc["dtype"]) == (WORLD, HEAD_DIM, "cpu_flash", "float32")
    layouts = {(HEADS, HEADS), (HEADS, HEADS // 4)}
    train = {(r["L"], (r["heads"], r["kv_heads"]), r["mask"]): r for r in doc["rows"] if r["kind"] == "train"}
    decode = {(r["L"], (r["heads"], r["kv_heads"])): r for r in doc["rows"] if r["kind"] == "decode"}
    assert set(train) == {(L, hk, m) for hk in layouts for m in MASKS}
    assert set(decode) == {(L, hk) for hk in layouts}
    table = [line for line in proc.stdout.splitlines() if line.startswith(f"| {L} |")]
    assert len(table) == len(train) + len(decode)

    a, b = most_square_tile(WORLD)
    for (_, (heads, kv_heads), mask), r in train.items():
        assert r["ms_fwd"] > 0 and r["ms_bwd"] > 0 and r["single_ms"] > 0 and r["tflops"] > 0
        assert 0 < r["fraction"] < 5, r
        assert r["kernel_calls"] == r["plan_kernel_calls"] > 0
        n = r["single_tokens"]
        assert abs(n * (n + 1) // 2 - r["pairs"]) <= n
        if mask == "causal":
            shape = AttentionShape(batch=1, seq_local=L, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, itemsize=4)
            plan = make_plan(Tiling(WORLD, a, b), shape, causal=True, layout="zigzag")
            assert r["blocks"] == len(plan.blocks(0)) == a * b
            # cpu_flash takes no segments: each Q chunk is its two halves (the diagonal's chunk one call more each)
            assert a <= r["kernel_calls"] <= 2 * a + 2 < r["blocks"]
            assert r["masked_blocks"] == 0 and r["pairs"] == plan.pairs(0)
        else:
            assert r["pairs"] < train[(L, (heads, kv_heads), "causal")]["pairs"]
    for r in decode.values():
        assert r["context"] == WORLD * L
        assert r["rank_ms"] > 0 and r["single_ms"] > 0 and r["ratio"] > 0 and r["local_step_ms"] > 0
        assert r["kernel"] == "local step"  # the flash decode kernel runs on CUDA only
