"""FSDP2 beside mesh_cp (fsdp_cases.py: every case in the 4 gloo processes of one ``accelerate launch``) against
the single-process ``Trainer`` / ``SFTTrainer`` on the same data and seed, with batches of DP x B: DP 2 x CP 2 and
CP 4, gradient accumulation and checkpointing, clipping (the global norm over the shards),
``reshard_after_forward=False``, a bf16 mixed-precision policy, AdamW, a checkpoint saved after 2 steps and resumed
(full and sharded state dicts, the latter through torch.distributed.checkpoint), LoRA, a model sharded by the user
over ``hf.fsdp_mesh``, the documented plain loop, and FSDP switched on by an accelerate config file
(configs/accelerate_fsdp_mesh_cp.yaml; its case runs, in the same launch, in the environment a launch with that file
gives). Every step's loss within 1e-5 in fp32; each rank holds a quarter of the parameters and of the optimizer
states; ``evaluate()`` after training (a partial last batch) within 1e-5; the mistakes are refused by name.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("peft")

from tests.integrations.clients import reference_and_mesh  # noqa: E402
from tests.integrations.hf.fsdp_cases import CASES  # noqa: E402

SCRIPT = Path(__file__).with_name("fsdp_cases.py")
COMPARED = sorted(set(CASES) - {"refusals", "bf16_policy"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """``(reference, mesh)``: case name -> what the trainer reported, every case of the mesh from one launch."""
    reference, mesh = reference_and_mesh(SCRIPT, tmp_path_factory.mktemp("fsdp"), port=29641)
    assert set(reference) == set(mesh) == set(CASES), (sorted(reference), sorted(mesh))
    return reference, mesh


@pytest.mark.parametrize("case", COMPARED)
def test_fsdp_equals_single_process(runs, case: str) -> None:
    reference, mesh = runs[0][case], runs[1][case]
    assert len(mesh["loss"]) == len(reference["loss"]) == 4, (mesh, reference)
    err = max(abs(a - b) for a, b in zip(mesh["loss"], reference["loss"], strict=True))
    assert err <= 1e-5, (mesh["loss"], reference["loss"])
    if "eval_loss" in reference:
        assert abs(mesh["eval_loss"] - reference["eval_loss"]) <= 1e-5, (mesh["eval_loss"], reference["eval_loss"])
    if reference.get("grad_norm", [None])[0] is not None:  # logged by the Trainer cases
        # 1e-4 of the norm: four steps of training grow the fp32 rounding of the attention's partials, which no order
        # of merges makes the single process's (each call is exact to fp64 rounding: tests/runtime/test_exactness.py)
        tolerance = 1e-4
        norms = zip(mesh["grad_norm"], reference["grad_norm"], strict=True)
        assert all(abs(a - b) <= tolerance * b for a, b in norms), (mesh["grad_norm"], reference["grad_norm"])


@pytest.mark.parametrize("case", [c for c in COMPARED if c != "torch_loop"])
def test_each_rank_holds_a_quarter(runs, case: str) -> None:
    """Parameters and optimizer states sharded over all 4 ranks (a 2-D mesh would leave each rank a half)."""
    shares = runs[1][case]["shares"]
    assert sum(shares["held"]) == shares["total"] and max(shares["held"]) * 4 <= shares["total"] + 4 * 64, shares
    assert sum(shares["state_held"]) == shares["state_total"], shares
    assert max(shares["state_held"]) * 4 <= shares["state_total"] + 4 * 128, shares
    if "adamw" in case or case in ("resume", "resume_sharded", "lora"):
        assert shares["state_total"] > 0, shares


def test_resume_equals_not_stopping(runs) -> None:
    """2 steps, a checkpoint, 2 more steps from it in a new trainer: the losses of 4 steps without stopping."""
    for name in ("resume", "resume_sharded"):
        err = max(abs(a - b) for a, b in zip(runs[1][name]["loss"], runs[1]["adamw"]["loss"], strict=True))
        assert err <= 1e-6, (name, runs[1][name]["loss"], runs[1]["adamw"]["loss"])


def test_mixed_precision_policy(runs) -> None:
    """A bf16 ``MixedPrecisionPolicy`` (fp32 reduction) applied, and within bf16 rounding of the single process
    sharded the same way: the first step (the same weights) within 1e-2, where bf16 itself moves the loss by 5e-3
    from fp32; the next steps within 5e-2 (bf16 moves them by up to 4e-2). A gradient scaled wrong by 2 moves the
    second step's loss by about 1, and a policy left out gives the fp32 loss."""
    mesh, reference, fp32 = runs[1]["bf16_policy"], runs[0]["bf16_policy"], runs[0]["dp2_cp2"]
    assert abs(mesh["loss"][0] - reference["loss"][0]) <= 1e-2, (mesh["loss"], reference["loss"])
    assert max(abs(a - b) for a, b in zip(mesh["loss"], reference["loss"], strict=True)) <= 5e-2, (mesh, reference)
    assert abs(mesh["loss"][0] - fp32["loss"][0]) > 1e-3, (mesh["loss"], fp32["loss"])


def test_mistakes_refused_by_name(runs) -> None:
    errors = runs[1]["refusals"]["errors"]
    for name in ("hsdp", "hsdp_trainer"):
        assert "2-D mesh (2, 2)" in errors[name] and "HSDP" in errors[name] and "hf.fsdp_mesh" in errors[name], errors
    for name in ("cp_only", "cp_only_trainer"):
        assert "sharded over ranks [0, 1]" in errors[name] and "spans [0, 1, 2, 3]" in errors[name], errors
    assert "fsdp_config version=1: mesh_cp shards with FSDP2" in errors["fsdp1"], errors
    assert "fsdp_config keys ['transformer_layer_cls_to_wrapp'] are not FSDP2 settings" in errors["unknown_key"], errors
    assert "on CPU set TrainingArguments(use_cpu=True)" in errors["no_use_cpu"], errors
    assert "activation_checkpointing=True" in errors["fsdp_ac"] and "gradient_checkpointing" in errors["fsdp_ac"]
    assert "cpu_offload=CPUOffloadPolicy" in errors["offload"], errors


def test_plugin_fields_refused_by_name() -> None:
    """FSDP settings mesh_cp would not apply as accelerate does are refused naming the field (FSDP1 cannot be built
    on a CPU, so its plugin is stood in for)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from mesh_cp.integrations.hf.fsdp import check_plugin

    with pytest.raises(NotImplementedError, match="fsdp_version=1: mesh_cp shards with FSDP2"):
        check_plugin(types.SimpleNamespace(fsdp_version=1))
    check_plugin(FullyShardedDataParallelPlugin(fsdp_version=2))
    for field, value in (("cpu_ram_efficient_loading", True), ("min_num_params", 1000)):
        fields = {"cpu_ram_efficient_loading": False, "min_num_params": 0} | {field: value}  # else read from os.environ
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **fields)
        with pytest.raises(NotImplementedError, match=f"FSDP {field}="):
            check_plugin(plugin)
