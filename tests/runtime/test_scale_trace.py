"""Traffic per rank at P = 256 traced from the real runtime on torch's fake process group.

``scripts/trace_scale.py`` runs ``mesh_attn_func`` forward and backward as one rank of a fake world
for every tile; the traced bytes per phase and group must equal the plan (which the gloo runs of
test_exactness.py check against the runtime at P <= 8), and the best MHA tile at P = 256 must send at
least 85% less than the ring.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_traced_traffic_equals_plan_and_beats_ring_at_256(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "trace_scale.py"), "--worlds", "4", "16", "256"]
    cmd += ["--ranks", "0", "3", "--kv-heads", "8", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["world"], r["rank"], r["kv_heads"]) for r in results} == {
        (w, rank, kv) for w in (4, 16, 256) for rank in (0, 3) for kv in (8, 2)
    }
    for summary in results:
        tiles = [row["tile"] for row in summary["rows"]]
        assert len(tiles) == len(set(tiles)) and f"1x{summary['world']}" in tiles
        assert all(row["matches_plan"] and row["total"] > 0 for row in summary["rows"]), summary
    mha_256 = [r for r in results if r["world"] == 256 and r["kv_heads"] == 8]
    assert all(r["best"] == "16x16" and r["best_vs_ring"] <= -0.85 for r in mha_256), mha_256


def test_traced_hybrid_traffic_equals_plan_and_crosses_nodes_least(tmp_path: Path) -> None:
    """Every head-parallel x mesh layout (heads=u) at P = 16 and 64 sends what its plan says (all-to-all bytes on
    the head group, the inner mesh's on its rings); with 8 ranks per node the busiest traced rank of the best hybrid
    sends no more inter-node bytes than that of the best USP split and far fewer than the ring's."""
    out = tmp_path / "trace.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "trace_scale.py"), "--worlds", "16", "64", "--hybrid"]
    cmd += ["--ranks", "0", "7", "--kv-heads", "8", "2", "--ranks-per-node", "8", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for summary in data["results"]:
        assert any(row["heads"] > 1 for row in summary["rows"])
        assert all(row["matches_plan"] and row["total"] > 0 for row in summary["rows"]), summary
    assert {(c["world"], c["kv_heads"]) for c in data["combined"]} == {(w, kv) for w in (16, 64) for kv in (8, 2)}
    for combined in data["combined"]:
        best = combined["least_inter"]
        assert best["hybrid"]["inter"] <= best["usp"]["inter"] and best["hybrid"]["inter"] <= best["mesh"]["inter"]
        if combined["world"] == 64:
            assert best["hybrid"]["inter"] < best["ring"]["inter"] / 4, combined
