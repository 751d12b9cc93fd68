"""``scripts/gpu_check.py``: its CPU self-test passes with every expected row, and planted bugs are FAILs.

The self-test runs the GPU acceptance check's own logic on CPU (kernels against fp64, the mesh on 4 gloo
ranks at P = 4 and 2, a tiny Llama with ``hf.attach`` at P = 4); the sections that need GPUs are SKIP.
``--inject-fault`` plants a wrong kernel output, or an exception, to show that the table reports it and
that the other cases still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SHAPES = ("4:4 d64", "8:2 d64", "4:4 d128", "8:2 d72", "8:2 d64 lse grad")
DTYPES = ("fp32", "bf16", "fp16")


def run_check(tmp_path: Path, *args: str) -> tuple[int, dict[tuple[str, str], dict], str]:
    """The self-test with ``args``: exit code, rows by (section, case), and its output."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-selftest", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["section"], r["case"]): r for r in json.loads(out.read_text())["rows"]}
    return proc.returncode, rows, proc.stdout + proc.stderr


def mesh_cases(schedules=("collective", "overlap")) -> list[str]:
    cases = []
    layouts = {
        4: ("1x4", "2x2", "4x1", "1x2 head_parallel=2", "2x1 head_parallel=2"),
        2: ("1x2", "2x1", "1x1 head_parallel=2"),
    }
    for p, tiles in layouts.items():
        cases += [f"gloo cpu P={p} {t} {d} {s}" for t in tiles for d in ("bf16", "fp32") for s in schedules]
    return cases


def test_cpu_selftest_passes_with_every_expected_row(tmp_path: Path) -> None:
    md = tmp_path / "table.md"
    code, rows, output = run_check(tmp_path, "--out", str(md))
    failures = {key: row["detail"] for key, row in rows.items() if row["status"] == "FAIL"}
    assert not failures and code == 0, (failures, output[-3000:])

    expected_pass = [
        ("kernels", f"{k} {d} {s}") for k in ("cpu_flash", "reference", "auto") for d in DTYPES for s in SHAPES
    ]
    expected_pass += [("mesh-gloo", c) for c in mesh_cases()]
    expected_pass += [("mesh-gloo", f"gloo cpu P={p} tiles differ across ranks: refused") for p in (4, 2)]
    expected_pass += [
        ("hf", f"gloo cpu {m} {mode}")
        for m in ("llama", "llama-gqa")
        for mode in ("fp32", "bf16", "autocast", "generate", "generate bf16")
    ]
    not_passed = {key: rows.get(key, {}).get("status", "missing") for key in expected_pass}
    assert all(s == "PASS" for s in not_passed.values()), {k: s for k, s in not_passed.items() if s != "PASS"}
    # Numbers, not just a word: every attention row says its error against what is allowed.
    assert all("/" in rows[key]["detail"] for key in expected_pass if "refused" not in key[1])
    assert rows[("kernels", "auto fp32 4:4 d64")]["detail"].startswith("chose cpu_flash")

    expected_skip = [("kernels", k) for k in ("flash_attn", "cuda_flash", "cuda_sdpa")]
    expected_skip += [("mesh-nccl", "NCCL")] + [("examples", e) for e in ("accelerate", "deepspeed", "megatron")]
    expected_skip += [("mesh-gloo", "gloo cpu fused passes")]  # eager on CPU (Note [Fused passes])
    expected_skip += [
        ("kernels", f"flash decode {d} {s}") for d in ("bf16", "fp16") for s in ("MHA 8:8 d128", "GQA 8:2 d64")
    ]  # CUDA only (Note [Flash decode])
    assert {key: rows.get(key, {}).get("status") for key in expected_skip} == dict.fromkeys(expected_skip, "SKIP")
    assert all(rows[key]["detail"] for key in expected_skip)  # a SKIP says why

    table = md.read_text()
    assert "| section | case | status | detail | s |" in table and "| torch | " in table
    assert all(f"| {case} | PASS |" in table for _, case in expected_pass)


def test_a_wrong_kernel_output_is_reported_as_failure(tmp_path: Path) -> None:
    only = "^(cpu_flash|reference|auto) |P=4 2x2"
    code, rows, output = run_check(
        tmp_path, "--sections", "kernels,mesh-gloo", "--cases", only, "--inject-fault", "cpu_flash"
    )
    assert code == 1, output[-3000:]
    for dtype in DTYPES:
        for shape in SHAPES:
            for kernel in ("cpu_flash", "auto"):  # auto runs cpu_flash on CPU
                row = rows[("kernels", f"{kernel} {dtype} {shape}")]
                assert row["status"] == "FAIL" and "out " in row["detail"], row
            assert rows[("kernels", f"reference {dtype} {shape}")]["status"] == "PASS"
    for case in [c for c in mesh_cases() if "P=4 2x2" in c]:
        row = rows[("mesh-gloo", case)]
        assert row["status"] == "FAIL" and "out " in row["detail"], row
    assert rows[("mesh-gloo", "gloo cpu P=4 2x2 CPMesh.create")]["status"] == "PASS"
    assert {section for section, _ in rows} == {"kernels", "mesh-gloo"}
    assert len([key for key in rows if key[0] == "mesh-gloo"]) == 6  # start, create, 2 dtypes x 2 schedules


def test_a_process_that_dies_in_a_case_fails_that_case_and_the_group_starts_again(tmp_path: Path) -> None:
    only = "P=2 1x2|P=4 2x2 fp32"  # the pairs {0,1} and {2,3} run their cases independently of each other
    code, rows, output = run_check(
        tmp_path, "--sections", "mesh-gloo", "--cases", only, "--inject-fault", "cpu_flash:abort:bf16"
    )
    assert code == 1, output[-3000:]
    for schedule in ("collective", "overlap"):
        died = rows[("mesh-gloo", f"gloo cpu P=2 1x2 bf16 {schedule}")]
        assert died["status"] == "FAIL" and "the processes ended in this case" in died["detail"], died
        assert "SIGABRT" in died["detail"], died
        for case in (f"P=2 1x2 fp32 {schedule}", f"P=4 2x2 fp32 {schedule}"):  # run in a group started again
            assert rows[("mesh-gloo", f"gloo cpu {case}")]["status"] == "PASS", rows[("mesh-gloo", f"gloo cpu {case}")]
    created = rows[("mesh-gloo", "gloo cpu P=2 1x2 CPMesh.create")]
    assert created["status"] == "PASS", created
    assert len(rows) == 8, sorted(rows)


def test_a_case_that_raises_is_its_own_failure_and_the_rest_still_run(tmp_path: Path) -> None:
    code, rows, output = run_check(tmp_path, "--sections", "kernels", "--inject-fault", "reference:raise")
    assert code == 1, output[-3000:]
    for dtype in DTYPES:
        for shape in SHAPES:
            row = rows[("kernels", f"reference {dtype} {shape}")]
            assert row["status"] == "FAIL" and "RuntimeError: fault injected into kernel 'reference'" in row["detail"]
            assert rows[("kernels", f"cpu_flash {dtype} {shape}")]["status"] == "PASS"
            assert rows[("kernels", f"auto {dtype} {shape}")]["status"] == "PASS"
    assert "FAIL" in output and "PASS" in output  # the table is printed


def test_unknown_section_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-selftest", "--sections", "kernels,cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "unknown section(s) ['cuda']" in proc.stderr, proc.stderr[-2000:]
