"""TRL's ``SFTTrainer`` with mesh_cp (``hf.mesh_cp_trainer_class(SFTTrainer)``, 4 gloo processes under
``accelerate launch``: DP 2 x CP 2) against the real single-process ``SFTTrainer`` on the same data and seed, with
global batches of DP x B (sft_script.py runs both).

Every case, in fp32: every step's loss within 1e-5, TRL's ``num_tokens`` equal, token accuracy and entropy within
1e-5, ``evaluate()`` before training (a partial last batch: 5 examples in batches of 2) within 1e-6 and after
training within 1e-4 (the trained weights differ by rounding), TRL's eval entropy and token accuracy before
training within 1e-6, and the throughput metrics within 5% of the reference's samples. The sequential case's third
step is its epoch's short last batch (10 examples in batches of 4), where accelerate's ``gather_for_metrics`` would
keep only the first ranks' sums: its training entropy and accuracy count every token once too. bf16 autocast runs and
stays within bf16 rounding. Each refused option is refused by name, ``use_cpu=False`` (accelerate then takes the four
processes for one) as well, under accelerate and under DeepSpeed. ``activation_offloading=True``, with gradient
checkpointing and without, is exact as well: TRL's offloading hooks, made for the CPU (sft_script.cpu_offloading: a
CPU-only torch has no accelerator to make them for), take and give back every saved tensor of at least 1 KiB, mesh_cp
attention's among them without gradient checkpointing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.integrations.clients import ROOT, check_samples  # noqa: E402

SCRIPT = Path(__file__).with_name("sft_script.py")
FP32_CASES = [
    "padded",
    "packing_bfd",
    "packing_wrapped",
    "padding_free",
    "completion_only",
    "assistant_only",
    "no_gradient_checkpointing",
    "sequential",
    "activation_offloading",
    "activation_offloading_no_gc",
]


@pytest.fixture(scope="module")
def runs(trl_runs) -> tuple[dict, dict]:
    """``(reference, mesh)``: case name -> what the trainer reported."""
    return trl_runs[0]


def _err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", FP32_CASES)
def test_sft_trainer_equals_single_process(runs, case: str) -> None:
    reference, mesh = runs[0][case], runs[1][case]
    assert len(mesh["loss"]) == 3, mesh
    assert _err(mesh["loss"], reference["loss"]) <= 1e-5, (mesh["loss"], reference["loss"])
    assert mesh["num_tokens"] == reference["num_tokens"], (mesh["num_tokens"], reference["num_tokens"])
    for metric in ("mean_token_accuracy", "entropy"):
        assert _err(mesh[metric], reference[metric]) <= 1e-5, (metric, mesh[metric], reference[metric])
    assert abs(mesh["eval_loss_before"] - reference["eval_loss_before"]) <= 1e-6, (mesh, reference)
    for metric in ("eval_entropy_before", "eval_accuracy_before"):  # TRL's per-batch metrics, each batch once
        assert abs(mesh[metric] - reference[metric]) <= 1e-6, (metric, mesh[metric], reference[metric])
    assert abs(mesh["eval_loss"] - reference["eval_loss"]) <= 1e-4, (mesh["eval_loss"], reference["eval_loss"])
    check_samples(mesh, reference)  # samples per second x runtime: each replica's counted once


def test_documents_change_the_loss(runs) -> None:
    """The packed cases are not the padded ones in disguise: packing with documents kept apart trains on other rows
    than wrapped packing, so the losses differ (the comparison above can tell)."""
    mesh = runs[1]
    assert _err(mesh["packing_bfd"]["loss"], mesh["packing_wrapped"]["loss"]) > 1e-3


def test_activation_offloading_takes_mesh_cp_attention_tensors(runs) -> None:
    """TRL's offloading hooks ran on both sides and gave back every tensor they took. Without gradient checkpointing
    they took tensors mesh_cp's attention saved; with it the checkpoint's own hooks hold the layers' saved tensors
    (TRL's see the checkpointed layers' inputs and what lies outside them)."""
    for side in runs:
        for case in ("activation_offloading", "activation_offloading_no_gc"):
            counts = side[case]["offloading"]
            assert counts["offloaded"] > 0 and counts["restored"] == counts["offloaded"], (case, counts)
    mesh = runs[1]
    assert mesh["activation_offloading_no_gc"]["offloading"]["in_mesh_attention"] > 0, mesh
    assert mesh["activation_offloading"]["offloading"]["in_mesh_attention"] == 0, mesh
    assert runs[1]["packing_bfd"]["offloading"] is None  # the other cases run without it


def test_bf16_autocast_runs_within_bf16_rounding(runs) -> None:
    reference, mesh = runs[0]["bf16"], runs[1]["bf16"]
    relative = _err(mesh["loss"], reference["loss"]) / max(reference["loss"])
    assert relative <= 2e-2, (mesh["loss"], reference["loss"])
    assert mesh["num_tokens"] == reference["num_tokens"]


@pytest.mark.parametrize(
    "option",
    [
        "label_smoothing_factor",
        "neftune_noise_alpha",
        "average_tokens_across_devices",
        "batch_rebalance",
        "use_liger_kernel",
        "use_cpu",
    ],
)
def test_refused_options_are_named(runs, option: str) -> None:
    message = runs[1]["refusals"]["messages"][option]
    assert message != "accepted", option
    assert option in message, message


def test_world_other_than_the_layout_is_refused(runs) -> None:
    """On CPU without ``use_cpu=True`` accelerate takes the 4 launched processes for one: refused, naming both sizes
    and the fix."""
    message = runs[1]["refusals"]["messages"]["use_cpu"]
    assert message.startswith("ValueError: accelerate sees 1 process(es) but mesh_cp's DP x CP layout spans 4 ranks")
    assert "TrainingArguments(use_cpu=True)" in message and "--use_cpu" in message, message


def test_sft_trainer_with_deepspeed_block_equals_single_process(runs, tmp_path: Path) -> None:
    """``SFTConfig(deepspeed=...)`` with the shipped ZeRO 3 config, its block set to DP 2 x CP 2 (tile 1x2): the
    trainer builds the layout from the block; packing with short documents trains as the single process does. Without
    ``use_cpu=True`` accelerate takes the deepspeed launcher's 4 processes for one: refused at construction."""
    import os

    config = json.loads((ROOT / "configs" / "ds_mesh_cp.json").read_text())
    config["mesh_attention"] |= {"cp_size": 2, "tile": "1x2"}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "deepspeed.json"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--master_port", "29635", str(SCRIPT)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*cmd, str(out), "--deepspeed", str(path), "--cases", "packing_bfd"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["case"]: r for r in json.loads(out.read_text())}
    refused = results["refusals"]["messages"]["use_cpu"]  # the same run without use_cpu=True
    assert refused.startswith("ValueError: accelerate sees 1 process(es) but mesh_cp's DP x CP layout spans 4"), refused
    mesh = results["packing_bfd"]
    reference = runs[0]["packing_bfd"]
    assert _err(mesh["loss"], reference["loss"]) <= 1e-5, (mesh["loss"], reference["loss"])
    assert mesh["num_tokens"] == reference["num_tokens"]
    assert abs(mesh["eval_loss"] - reference["eval_loss"]) <= 1e-4, (mesh["eval_loss"], reference["eval_loss"])
