"""The accelerate fine-tuning example, launched as users launch it (4 gloo processes, 2x2 mesh).

Its loss equals the unsharded SDPA reference trained beside it at every step, and stopping at a
checkpoint then resuming gives the same losses as not stopping.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--seq-len", "512", "--hidden", "32", "--corpus-mb", "0.5", "--vocab", "512", "--reference"]
STEP = re.compile(r"step\s+(\d+)\s+mesh_cp loss ([0-9.]+)\s+reference loss ([0-9.]+)")


def accelerate_launch(script: Path, *args: str, port: int) -> str:
    """Run ``script`` under ``accelerate launch`` with the project's CPU config; its stdout (must succeed)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "configs" / "accelerate_mesh_cp.yaml")]
    cmd += ["--main_process_port", str(port), str(script), *args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def launch(*args: str, port: int) -> dict[int, tuple[float, float]]:
    """The fine-tuning example's printed (mesh_cp, reference) loss per step."""
    stdout = accelerate_launch(ROOT / "integrations" / "accelerate" / "finetune.py", *SMALL, *args, port=port)
    assert "DP(1) x CP(2x2)" in stdout, stdout[-2000:]
    return {int(m[1]): (float(m[2]), float(m[3])) for m in STEP.finditer(stdout)}


def test_loss_equals_reference_and_resume_equals_not_stopping(tmp_path: Path) -> None:
    straight = launch("--steps", "4", port=29601)
    assert sorted(straight) == [1, 2, 3, 4]
    for step, (mesh, ref) in straight.items():
        assert abs(mesh - ref) <= 1e-4, (step, mesh, ref)  # printed with 6 decimals
    assert straight[4][0] < straight[1][0]  # it learns
    ckpt = tmp_path / "ckpt"
    first = launch("--steps", "2", "--checkpoint-dir", str(ckpt), "--save-every", "2", port=29602)
    resumed = launch("--steps", "4", "--checkpoint-dir", str(ckpt), "--save-every", "2", port=29603)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    for step in (1, 2):
        assert first[step] == straight[step]
    for step in (3, 4):
        assert abs(resumed[step][0] - straight[step][0]) <= 1e-6, (step, resumed, straight)


def test_trainer_with_dp_by_cp_equals_single_process(tmp_path: Path) -> None:
    stdout = accelerate_launch(ROOT / "tests" / "distributed" / "trainer_script.py", str(tmp_path), port=29604)
    errors = {int(m[1]): float(m[2]) for m in re.finditer(r"rank (\d+) params err ([0-9.e+-]+)", stdout)}
    assert sorted(errors) == [0, 1, 2, 3], stdout[-2000:]
    assert max(errors.values()) <= 1e-5, errors
