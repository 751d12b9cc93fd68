"""The peak-memory model's GPU calibration (``backend="nccl"``) against the peaks measured on an H100 in bf16 by
scripts/bench_rank.py (docs/results/bench_rank_h100.json): rank 0 of P = 16, tile 4x4, causal and three packed mixes,
MHA 32:32 and GQA 32:8, L = 2048 and 8192, forward and backward. The model was fitted on these measurements, so this
guards it against drifting from them; a new GPU run is what validates it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mesh_cp.core import AttentionShape, Tiling, make_plan
from mesh_cp.sim.memory import compute_bytes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_rank import masks  # noqa: E402


def test_gpu_model_within_20_percent_of_the_h100_peaks() -> None:
    doc = json.loads((ROOT / "docs/results/bench_rank_h100.json").read_text())
    assert doc["dtype"] == "bfloat16" and doc["kernel"] == "cuda_flash"
    rows = [r for r in doc["rows"] if r["kind"] == "train"]
    assert len(rows) == 16
    for r in rows:
        mask = masks(doc["world"] * r["L"], doc["doc_scale"], doc["seed"])[r["mask"]]
        shape = AttentionShape(
            batch=1, seq_local=r["L"], heads=r["heads"], kv_heads=r["kv_heads"], head_dim=128, itemsize=2
        )
        plan = make_plan(Tiling(16, 4, 4), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
        for phase, measured in zip(("forward", "backward"), r["peak_mib"], strict=True):
            model = compute_bytes(plan, phase, backend="nccl") / 2**20
            assert 0.8 <= model / measured <= 1.2, (
                r["L"],
                r["heads"],
                r["kv_heads"],
                r["mask"],
                phase,
                model,
                measured,
            )


def test_gpu_model_is_never_far_below_the_h200_peaks() -> None:
    """The same model against a later run on an H200 (docs/results/bench_rank_h200.json; also balanced and split
    packed rows, after first writes stopped filling accumulators): at most 15% below any measured peak, so a tile that
    ``memory_budget`` admits does not run short, and at most 50% above (packed rows, where it is conservative)."""
    doc = json.loads((ROOT / "docs/results/bench_rank_h200.json").read_text())
    rows = [r for r in doc["rows"] if r["kind"] == "train"]
    assert doc["device"] == "NVIDIA H200" and len(rows) == 40
    ratios = []
    for r in rows:
        mask = masks(doc["world"] * r["L"], doc["doc_scale"], doc["seed"], doc["world"], split=True)[r["mask"]]
        shape = AttentionShape(
            batch=1, seq_local=r["L"], heads=r["heads"], kv_heads=r["kv_heads"], head_dim=128, itemsize=2
        )
        plan = make_plan(Tiling(16, 4, 4), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
        for phase, measured in zip(("forward", "backward"), r["peak_mib"], strict=True):
            ratios.append((compute_bytes(plan, phase, backend="nccl") / 2**20 / measured, r["L"], r["mask"], phase))
    assert min(ratios)[0] >= 0.85 and max(ratios)[0] <= 1.5, (min(ratios), max(ratios))
