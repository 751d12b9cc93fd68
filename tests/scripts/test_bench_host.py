"""``scripts/bench_host.py`` with tiny sizes: it exits 0 and prints a table row per length, head layout and mask with
positive times and op counts, the kernel calls the plan says; its JSON holds the same rows, and ``--profile`` prints
cProfile's listing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_host.py"
WORLD, L, HEADS = 16, 128, 4
MASKS = ("causal", "packed long", "packed mixed", "packed short")
TINY = ["--world", str(WORLD), "--lengths", str(L), "--heads", str(HEADS), "--head-dim", "64", "--doc-scale", "16"]


def run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_host_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    proc = run("--repeats", "2", "--json", str(out))
    layouts = {f"{HEADS}:{HEADS}", f"{HEADS}:{HEADS // 4}"}
    table = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(f"| {L} |")]
    assert {(cells[1].strip(), cells[2].strip()) for cells in table} == {(h, m) for h in layouts for m in MASKS}
    assert len(table) == len(layouts) * len(MASKS)
    for cells in table:
        calls, ms_fwd, ms_bwd, us_fwd, us_bwd = (float(c) for c in cells[3:8])
        assert calls >= 1 and min(ms_fwd, ms_bwd, us_fwd, us_bwd) > 0, cells
        ops = [int(c.split("(")[0]) for c in cells[8:10]]
        assert min(ops) > 0, cells
    doc = json.loads(out.read_text())
    assert (doc["world"], doc["kernel"], len(doc["rows"])) == (WORLD, "cuda_flash", len(table))
    for r in doc["rows"]:
        assert r["ms_fwd"] > 0 and r["ms_bwd"] > 0 and r["ops_fwd"] > 0 and r["ops_bwd"] > 0
        assert math.isclose(r["us_per_call_fwd"] * r["kernel_calls"], r["ms_fwd"] * 1e3)


def test_bench_host_profile() -> None:
    proc = run(
        "--repeats", "1", "--masks", "packed short", "--profile", "--profile-layers", "2", "--profile-rows", "200"
    )
    assert "by cumulative time" in proc.stdout and "forward_blocks" in proc.stdout and "backward_blocks" in proc.stdout
