"""The accelerate fine-tuning example under ``accelerate launch`` (4 gloo processes, 2x2 mesh).

Its loss equals the unsharded SDPA reference trained beside it at every step, its held-out eval loss under CP
equals the reference's, and stopping at a checkpoint then resuming gives the same losses as not stopping. The
example is run by path from another working directory, without the repository on ``PYTHONPATH``, and read through
its final JSON line; its runs (and the generation example's, and then the Trainer's of trainer_script.py) run one after
another in the processes of one launch, each as the launcher runs a script (launched_runs.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from examples.common import read_result  # noqa: E402
from tests.integrations.clients import launched_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--seq-len", "512", "--hidden", "32", "--corpus-mb", "0.5", "--vocab", "512", "--reference"]


def _accelerate(port: int, pythonpath: bool) -> tuple[list[str], dict]:
    """``accelerate launch`` with the project's CPU config, and its environment (the repository on ``PYTHONPATH``
    if ``pythonpath``)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "configs" / "accelerate_mesh_cp.yaml")]
    cmd += ["--main_process_port", str(port)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    return cmd, env


def accelerate_launch(script: Path, *args: str, port: int, cwd: Path = ROOT, pythonpath: bool = True) -> str:
    """Run ``script`` under ``accelerate launch`` with the project's CPU config, from ``cwd`` (with the
    repository on ``PYTHONPATH`` if ``pythonpath``); its stdout (must succeed)."""
    cmd, env = _accelerate(port, pythonpath)
    proc = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def finetune_result(stdout: str) -> dict:
    """The fine-tuning example's result line in its output ``stdout``; ``"steps"`` becomes ``{step: (mesh_cp loss,
    reference loss)}``."""
    result = read_result(stdout)
    assert stdout.rstrip().splitlines()[-1].startswith('{"example"'), stdout[-2000:]  # the very last line
    assert result["example"] == "accelerate" and result["world"] == 4, result
    assert result["layout"].startswith("DP(1) x CP(2x2)"), result["layout"]
    assert len(result["reference_losses"]) == len(result["losses"]), result
    assert result["eval_sequences"] == 2 and abs(result["eval_loss"] - result["reference_eval_loss"]) <= 1e-5, result
    shown = f"eval: 2 held-out sequences, mesh_cp loss {result['eval_loss']:.6f}  reference loss "
    assert shown in stdout, stdout[-2000:]
    first = result["first_step"]
    pairs = zip(result["losses"], result["reference_losses"], strict=True)
    return result | {"steps": {first + i: pair for i, pair in enumerate(pairs)}}


TRAINER = Path(__file__).with_name("trainer_script.py")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[str], Path]:
    """The runs, one after another in the processes of one launch (launched_runs.py), from another working directory
    and without the repository on ``PYTHONPATH``: 4 steps; 2 steps saving a checkpoint; 4 steps resuming from it; the
    generation example loading it; then trainer_script.py (which finds the repository itself, after the examples), its
    output on every rank. ``(outputs, checkpoint folder)``."""
    tmp_path = tmp_path_factory.mktemp("accelerate")
    ckpt = tmp_path / "ckpt"
    finetune = ROOT / "examples" / "accelerate" / "finetune.py"
    saving = ["--checkpoint-dir", str(ckpt), "--save-every", "2"]
    generating = ["--checkpoint", str(ckpt / "step_2.pt"), "--prompt-tokens", "700", "--new-tokens", "6", "--check"]
    runs = [
        (finetune, [*SMALL, "--steps", "4"]),
        (finetune, [*SMALL, "--steps", "2", *saving]),
        (finetune, [*SMALL, "--steps", "4", *saving]),
        (ROOT / "examples" / "accelerate" / "generate.py", [*SMALL, *generating]),
        (TRAINER, [str(tmp_path / "trainer")]),
    ]
    cmd, env = _accelerate(29601, pythonpath=False)
    ports = range(29606, 29611)
    outputs = launched_runs(cmd, runs, tmp_path / "runs", ports, every_rank={4}, timeout=900, env=env, cwd=tmp_path)
    return outputs, ckpt


def test_loss_equals_reference_and_resume_equals_not_stopping(launched) -> None:
    """4 steps; 2 steps saving a checkpoint; 4 steps resuming from it; the generation example loading it."""
    outputs, ckpt = launched
    straight, first, resumed = (finetune_result(stdout) for stdout in outputs[:3])
    assert sorted(straight["steps"]) == [1, 2, 3, 4] and straight["resumed_from"] is None, straight
    for step, (mesh, ref) in straight["steps"].items():
        assert abs(mesh - ref) <= 1e-5, (step, mesh, ref)
    assert straight["steps"][4][0] < straight["steps"][1][0]  # it learns
    assert straight["tokens_per_s"] > 0 and straight["attention_bytes_per_step"]["kv"] > 0, straight
    assert sorted(first["steps"]) == [1, 2] and sorted(resumed["steps"]) == [3, 4]
    assert resumed["resumed_from"] == 2 and resumed["checkpoint"] == str(ckpt / "step_2.pt"), resumed
    for step in (1, 2):
        assert first["steps"][step] == straight["steps"][step]
    for step in (3, 4):
        assert abs(resumed["steps"][step][0] - straight["steps"][step][0]) <= 1e-6, (step, resumed, straight)
        assert abs(resumed["steps"][step][1] - straight["steps"][step][1]) <= 1e-6, (step, resumed, straight)
    assert abs(resumed["eval_loss"] - straight["eval_loss"]) <= 1e-6, (resumed, straight)  # the same model
    assert straight["eval_loss"] < first["eval_loss"], (straight, first)  # evaluated after training
    # The generation example loads that checkpoint: prefill + tree decoding equal single-process generation.
    generated = read_result(outputs[3])
    assert generated["example"] == "generate" and generated["prompt_tokens"] == 700, generated
    assert len(generated["new_tokens"]) == 6 and generated["reference_match"] is True, generated
    assert generated["max_logit_diff"] <= 1e-5, generated


def test_trainer_with_dp_by_cp_equals_single_process(launched) -> None:
    stdout = launched[0][4]  # every rank's
    # the trained parameters; evaluate() / predict() / eval_strategy="steps" losses; resuming mid-epoch
    for name in ("params", "eval", "resume"):
        errors = {int(m[1]): float(m[2]) for m in re.finditer(rf"rank (\d+) {name} err ([0-9.e+-]+)", stdout)}
        assert sorted(errors) == [0, 1, 2, 3], stdout[-2000:]
        assert max(errors.values()) <= 1e-5, (name, errors)


def test_head_parallel_option_defaults_to_a_plain_mesh(capsys) -> None:
    """``--head-parallel`` (the head-parallel x mesh hybrid) sits beside ``--tile``, 1 unless given; the former
    ``--cp-heads`` is refused, naming it."""
    from examples.accelerate import finetune

    assert finetune.parse_args([]).head_parallel == 1
    assert finetune.parse_args(["--cp", "8", "--head-parallel", "2", "--tile", "2x2"]).head_parallel == 2
    with pytest.raises(SystemExit):
        finetune.parse_args(["--cp", "8", "--cp-heads", "2"])
    assert "--cp-heads was renamed --head-parallel" in capsys.readouterr().err
