"""The whole-step memory model (mesh_cp.sim.step) and ``mesh-cp plan --model``.

- Calibration: real training steps (forward with labels, backward, AdamW step) of transformers models in fp32 on CPU
  (scripts/step_memory.py's cases: checkpointing on and off, 64 to 2048 tokens, vocabularies of 256 to 16K so the
  logits dominate or not, 4 and 8 layers, MHA, GQA and Qwen3's q/k norms, the chunked LM head, both AdamW
  implementations; and one CP case, 2 gloo ranks through ``hf.attach`` with DDP) each within 15% of the predicted
  peak, the non-CP ones also above the bytes held on entry (the activations, logits and temporaries alone). Measured
  with the profiler's allocation events (:class:`mesh_cp.testing.MemoryPeak`), the bytes held on entry (weights and
  AdamW's states) summed from the tensors.
- The model's arithmetic on the presets: parameter counts, 16 bytes per parameter, the [T, V] logits and the
  checkpointed layer inputs at 1M tokens on 8 ranks, the longest sequence at the edge of the budget.
- The command: a preset, a config.json, ``--budget``, and the errors.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from mesh_cp.cli import main
from mesh_cp.sim.step import (
    MODEL_PRESETS,
    ModelConfig,
    StepOptions,
    longest_seq,
    loss_bytes,
    seq_unit,
    step_memory,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import step_memory as script  # noqa: E402

TOLERANCE = 0.15


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [script.measure(case) for case in script.CASES]
    finally:
        torch.set_num_threads(threads)


def test_calibration_covers_the_variations() -> None:
    cases = script.CASES
    assert len(cases) >= 6
    assert {c.checkpointing for c in cases} == {True, False}
    assert {c.lm_head for c in cases} == {"full", "chunked"} and {c.foreach for c in cases} == {True, False}
    assert (
        len({c.seq for c in cases}) >= 3 and len({c.vocab for c in cases}) >= 3 and len({c.layers for c in cases}) >= 2
    )
    assert any(c.kv_heads < c.heads for c in cases) and any(c.model.startswith("Qwen3") for c in cases)


@pytest.mark.parametrize("index", range(len(script.CASES)), ids=[c.name for c in script.CASES])
def test_predicted_peak_within_15_percent_of_the_measured(measured: list[dict], index: int) -> None:
    row = measured[index]
    assert abs(row["predicted"] / row["measured"] - 1) <= TOLERANCE, row
    assert abs(row["predicted_above_entry"] / row["measured_above_entry"] - 1) <= TOLERANCE, row


def test_the_peaks_land_at_different_moments(measured: list[dict]) -> None:
    """The cases exercise the loss, the MLP's backward with and without checkpointing, and the optimizer step."""
    moments = {row["moment"].split(" of layer")[0] + (", MLP" if "MLP" in row["moment"] else "") for row in measured}
    assert {"loss backward", "backward, MLP", "optimizer step"} <= moments, moments


def test_cp_step_over_two_gloo_ranks_within_15_percent() -> None:
    rows = script.measure_cp(2)
    assert len(rows) == 2
    for row in rows:
        assert abs(row["predicted"] / row["measured"] - 1) <= TOLERANCE, row


# ----------------------------------------------------------------------------------------------
# The model's arithmetic


def test_presets_match_their_parameter_counts() -> None:
    # Meta-Llama-3-8B has 8,030,261,248 parameters, Llama-3.1-70B 70,553,706,496, Qwen3-8B 8.19B (model cards)
    assert MODEL_PRESETS["llama-3-8b"].params == 8_030_261_248
    assert MODEL_PRESETS["llama-3.1-70b"].params == 70_553_706_496
    assert round(MODEL_PRESETS["qwen3-8b"].params / 1e9, 2) == 8.19


def test_config_json_reads_like_the_preset(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    loaded = ModelConfig.load(str(path))
    assert loaded == dataclasses.replace(MODEL_PRESETS["qwen3-8b"], name="config.json")
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf({"vocab_size": 10})


def test_adamw_is_16_bytes_per_parameter_sharded_over_the_gpus() -> None:
    for sharding in ("replicated", "fsdp2", "zero3"):
        per_param = StepOptions(gpus=8, sharding=sharding).bytes_per_param()
        total = sum(per_param.values()) * (1 if sharding == "replicated" else 8)
        assert total == 16, (sharding, per_param)
    assert sum(StepOptions(precision="fp32", sharding="replicated").bytes_per_param().values()) == 16


def test_the_issue_numbers_at_1m_tokens_on_8_ranks() -> None:
    qwen, tokens = MODEL_PRESETS["qwen3-8b"], 2**20 // 8
    logits_bf16 = tokens * qwen.vocab * 2  # the [T, V] logits alone
    assert round(logits_bf16 / 1e9, 1) == 39.8
    forward, _ = loss_bytes(qwen, tokens, StepOptions(gpus=8))
    assert forward == tokens * qwen.vocab * (2 + 4 + 4)  # with the fp32 copy and log_softmax's output
    chunked, _ = loss_bytes(qwen, tokens, StepOptions(gpus=8, lm_head="chunked"))
    assert chunked < forward / 30
    memory = step_memory(qwen, 2**20, StepOptions(gpus=8, lm_head="chunked"))
    assert round(memory.parts["saved activations"] / qwen.layers / 1e9, 2) == 1.07  # each layer's bf16 input


def test_longest_seq_is_the_edge_of_the_budget() -> None:
    llama, budget = MODEL_PRESETS["llama-3-8b"], 80 * 10**9
    options = StepOptions(gpus=8, lm_head="chunked", offload=True)
    seq = longest_seq(llama, options, budget)
    assert seq % seq_unit(options) == 0
    assert step_memory(llama, seq, options).peak <= budget < step_memory(llama, seq + seq_unit(options), options).peak
    assert longest_seq(llama, StepOptions(gpus=1, sharding="replicated"), budget) == 0  # 16 B x 8B > 80 GB
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 16"):
        step_memory(llama, 1000, options)


# ----------------------------------------------------------------------------------------------
# The command


def test_cli_preset_prints_every_part_and_the_peak(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "qwen3-8b", "--seq", "1048576", "--gpus", "8", "--lm-head", "chunked", "--offload"]
    assert main(args) == 0
    out = capsys.readouterr().out
    options = StepOptions(gpus=8, lm_head="chunked", offload=True)
    peak = step_memory(MODEL_PRESETS["qwen3-8b"], 2**20, options).peak
    assert f"{peak / 1e9:.2f}" in out and "131072 tokens per rank" in out and "tile 1x8" in out
    for part in ("weights", "gradients", "optimizer states", "saved activations", "logits and loss"):
        assert part in out


def test_cli_budget_gives_the_longest_sequence(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}))  # fmt: skip
    assert main(["plan", "--model", str(path), "--gpus", "8", "--lm-head", "chunked", "--budget", "80GB"]) == 0
    out = capsys.readouterr().out
    seq = longest_seq(MODEL_PRESETS["llama-3-8b"], StepOptions(gpus=8, lm_head="chunked"), 80 * 10**9)
    assert f"the longest sequence that fits is {seq} tokens" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "qwen3-8b", "--seq", "4096", "--heads", "8"], "come from --model"),
        (["--model", "nope", "--seq", "4096"], "neither a preset"),
        (["--model", "qwen3-8b", "--seq", "4096", "--gpus", "8", "--cp", "3"], "cp 3 must divide gpus 8"),
        (["--seq", "4096", "--heads", "8", "--head-dim", "64"], "plan needs --world"),
        (["--model", "qwen3-8b", "--budget", "lots"], "is not a number"),
    ],
)
def test_cli_errors_name_the_fix(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_plan_without_model_runs_as_before(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--world", "4", "--seq", "4096", "--heads", "8", "--head-dim", "64"]) == 0
    assert "chosen" in capsys.readouterr().out
