"""A PEFT LoRA adapter trained by ``hf.mesh_cp_trainer_class()`` with ``TrainingArguments(deepspeed=...)`` at ZeRO 3 on
4 gloo processes, DP 2 x CP 2 (tile 1x2) built from the config's ``"mesh_attention"`` block, against the
single-process ``Trainer`` on the same data and seed with batches of DP x B (lora_script.py): every step's loss and
the trained adapter within 1e-5, only the adapter trainable, and every parameter and the optimizer's fp32 copy of the
adapter split over the 4 ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("lora_script.py")
TOL, STEPS, WORLD = 1e-5, 3, 4


def ds_config(path: Path) -> Path:
    """The shipped Trainer config (ZeRO 3, "auto" sizes) with its block set to DP 2 x CP 2 and no parameter kept
    whole: ``stage3_param_persistence_threshold`` (default 1e5 elements) would keep every parameter of the tiny
    model on every rank, the partitions beside them."""
    config = json.loads((ROOT / "configs" / "ds_mesh_cp.json").read_text())
    config["mesh_attention"] |= {"cp_size": 2, "tile": "1x2"}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """``(reference, mesh)``: the single-process run and, beside it, the ZeRO 3 run under torchrun (4 processes)."""
    out = tmp_path_factory.mktemp("lora")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = out / "reference.log"
    with log.open("w") as output:
        reference = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(out / "reference.json")], stdout=output, stderr=output, env=env, cwd=out
        )
        try:
            torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(WORLD), "--master-port",
                        "29651", str(SCRIPT), str(out / "mesh.json"), "--deepspeed", str(ds_config(out / "ds.json"))]  # fmt: skip
            proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=600, env=env, cwd=out)
        finally:
            reference.wait(timeout=600)
    assert reference.returncode == 0, log.read_text()[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tuple(json.loads((out / f"{name}.json").read_text()) for name in ("reference", "mesh"))


def _flat(values) -> list[float]:
    return [v for x in values for v in (_flat(x) if isinstance(x, list) else [x])]


def test_every_step_and_the_adapter_equal_single_process(runs) -> None:
    reference, mesh = runs
    print(f"\n{'step':>4} {'ZeRO 3 DP2xCP2':>16} {'single process':>16}")
    for step, (mine, ref) in enumerate(zip(mesh["loss"], reference["loss"], strict=True), start=1):
        print(f"{step:>4} {mine:>16.8f} {ref:>16.8f}")
    assert len(mesh["loss"]) == len(reference["loss"]) == STEPS
    assert max(abs(a - b) for a, b in zip(mesh["loss"], reference["loss"], strict=True)) <= TOL
    assert sorted(mesh["params"]) == sorted(reference["params"])
    errors = {
        name: max(abs(a - b) for a, b in zip(_flat(mesh["params"][name]), _flat(value), strict=True))
        for name, value in reference["params"].items()
    }
    print(f"adapter err {max(errors.values()):.3g}, moved {reference['moved']:.3g} from its initial weights")
    assert max(errors.values()) <= TOL, errors
    assert reference["moved"] > 1000 * TOL and abs(mesh["moved"] - reference["moved"]) <= TOL  # it trained


def test_only_the_adapter_trains(runs) -> None:
    """Two layers, q_proj and v_proj in each, an A and a B matrix each: 8 trainable parameters, on both sides."""
    reference, mesh = runs
    names = reference["trainable_before"]
    assert names == mesh["trainable_before"] and len(names) == 8, names
    for name in names:
        module, _, matrix = name.partition(".lora_")
        assert module.rsplit(".", 1)[-1] in ("q_proj", "v_proj") and matrix in ("A.default.weight", "B.default.weight")
    assert all(p["trainable"]["count"] == 8 for p in mesh["partitions"]), mesh["partitions"]


def test_zero3_partitions_every_parameter_over_all_ranks(runs) -> None:
    """ZeRO 3 over the engine's data-parallel group, all 4 DP x CP ranks: every rank holds ceil(n / 4) elements of
    each parameter and none whole outside a forward; the optimizer's fp32 copy is its part of the adapter."""
    reference, mesh = runs
    sizes = [len(_flat(value)) for value in reference["params"].values()]
    adapter_part = sum(math.ceil(n / WORLD) for n in sizes)
    print(f"\nrank {'adapter full/held':>18} {'frozen full/held':>17} {'fp32 optimizer':>14}")
    for rank, p in enumerate(mesh["partitions"]):
        t, f = p["trainable"], p["frozen"]
        print(f"{rank:>4} {t['full']:>9}/{t['held']:<8} {f['full']:>8}/{f['held']:<8} {p['optimizer_fp32']:>14}")
        assert (p["stage"], p["dp_world_size"]) == (3, WORLD), p
        assert t["full"] == sum(sizes) and t["held"] == adapter_part == p["optimizer_fp32"], p
        assert f["count"] > 0 and 0 <= WORLD * f["held"] - f["full"] < WORLD * f["count"], p
        assert t["visible"] == f["visible"] == t["persistent"] == f["persistent"] == 0, p
