"""transformers' ``Trainer`` with mesh_cp (``hf.mesh_cp_trainer_class()``, 4 gloo processes under ``accelerate
launch``: DP 2 x CP 2) against the real single-process ``Trainer`` on the same data and seed, with batches of
DP x B (trainer_cases.py runs both): random, sequential and length-grouped sampling, ``data_seed``, gradient
checkpointing and accumulation, ``dataloader_drop_last``, ``include_num_input_tokens_seen="non_padding"``, and
transformers' padding-free ``DataCollatorWithFlattening`` (documents kept apart by their ``position_ids``), and a
hybrid model (Bamba: Mamba 2 layers, head-parallel over the CP group, beside attention).

Every case, in fp32: every step's loss within 1e-5; the token counter equal; ``evaluate()`` before training with a
partial last batch (5 examples in batches of 2) within 2e-6 (4 fp32 ulps of a loss near 5); ``predict()`` after training within 1e-5; the
throughput metrics (samples per second times runtime) within 5% of the reference's samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from tests.integrations.clients import check_samples, reference_and_mesh  # noqa: E402
from tests.integrations.hf.trainer_cases import CASES  # noqa: E402

SCRIPT = Path(__file__).with_name("trainer_cases.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """``(reference, mesh)``: case name -> what the trainer reported."""
    return reference_and_mesh(SCRIPT, tmp_path_factory.mktemp("trainer"), port=29633)


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_equals_single_process(runs, case: str) -> None:
    reference, mesh = runs[0][case], runs[1][case]
    assert len(mesh["loss"]) == len(reference["loss"]) == 4, (mesh, reference)
    err = max(abs(a - b) for a, b in zip(mesh["loss"], reference["loss"], strict=True))
    assert err <= 1e-5, (mesh["loss"], reference["loss"])
    assert mesh["tokens_seen"] == reference["tokens_seen"], (mesh["tokens_seen"], reference["tokens_seen"])
    assert abs(mesh["eval_loss_before"] - reference["eval_loss_before"]) <= 2e-6, (mesh, reference)
    assert abs(mesh["test_loss"] - reference["test_loss"]) <= 1e-5, (mesh["test_loss"], reference["test_loss"])
    check_samples(mesh, reference)


def test_sampling_strategies_differ(runs) -> None:
    """The orders compared above are different orders (a sampler ignored would show)."""
    mesh = runs[1]
    assert mesh["random"]["loss"] != mesh["sequential"]["loss"] != mesh["group_by_length"]["loss"]
    assert mesh["random"]["loss"] != mesh["data_seed"]["loss"]
    assert mesh["tokens_non_padding"]["tokens_seen"][-1] > 0
    # Documents kept apart in one row train exactly as the same examples in padded rows; attending across the
    # boundaries would not.
    assert max(abs(a - b) for a, b in zip(mesh["flattening"]["loss"], mesh["random"]["loss"], strict=True)) <= 1e-5


def _trl_trainers() -> dict[str, type]:
    """TRL's trainers whose batches are not rows of tokens (those of its experimental package that import here)."""
    import importlib

    trl = pytest.importorskip("trl")
    found = {name: getattr(trl, name) for name in ("DPOTrainer", "GRPOTrainer", "RLOOTrainer", "RewardTrainer")}
    found["KTOTrainer"] = trl.KTOTrainer
    for module, name in (
        ("trl.experimental.orpo", "ORPOTrainer"),
        ("trl.experimental.cpo", "CPOTrainer"),
        ("trl.experimental.online_dpo", "OnlineDPOTrainer"),
        ("trl.experimental.gkd", "GKDTrainer"),
        ("trl.experimental.gold", "GOLDTrainer"),
    ):
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except ImportError:  # an optional dependency of that trainer is missing
            continue
    return found


def test_trainers_other_than_the_supported_are_refused_by_name() -> None:
    """mesh_cp_trainer_class refuses, before anything distributed, every TRL trainer but SFTTrainer and the
    whole-sequence trainers (DPO, GRPO, Reward), and transformers' Seq2SeqTrainer, naming it, why, and what is
    supported; a user's subclass of one is refused naming the TRL trainer; the supported bases and a user's subclass
    of them are accepted, the whole-sequence ones with their own mixin; the row mixin built by hand over a
    whole-sequence trainer is refused."""
    from transformers import Seq2SeqTrainer, Trainer
    from trl import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.preference import MeshCPDPOMixin
    from mesh_cp.integrations.hf.reward import MeshCPRewardMixin
    from mesh_cp.integrations.hf.rl import MeshCPGRPOMixin
    from mesh_cp.integrations.hf.trainer import MeshCPTrainerMixin

    supported = {"DPOTrainer", "GRPOTrainer", "RewardTrainer", "RLOOTrainer"}
    refused = {k: v for k, v in _trl_trainers().items() if k not in supported} | {"Seq2SeqTrainer": Seq2SeqTrainer}
    assert {"ORPOTrainer", "GKDTrainer", "KTOTrainer", "OnlineDPOTrainer"} <= set(refused), refused
    for name, base in refused.items():
        with pytest.raises(NotImplementedError, match=f"does not support {name} from .*supported: transformers"):
            hf.mesh_cp_trainer_class(base)
    mine = type("MyKTO", (refused["KTOTrainer"],), {})
    with pytest.raises(NotImplementedError, match=r"MyKTO \(a KTOTrainer\).*sequences' log-probabilities"):
        hf.mesh_cp_trainer_class(mine)
    with pytest.raises(NotImplementedError, match=r"a KTOTrainer\).*sequences' log-probabilities"):
        type("Mixed", (MeshCPTrainerMixin, refused["KTOTrainer"]), {})(model=None, args=None)
    for base in (Trainer, SFTTrainer, type("MySFT", (SFTTrainer,), {})):
        assert issubclass(hf.mesh_cp_trainer_class(base), MeshCPTrainerMixin)
    for base, mixin in (
        (DPOTrainer, MeshCPDPOMixin),
        (GRPOTrainer, MeshCPGRPOMixin),
        (RewardTrainer, MeshCPRewardMixin),
    ):
        for cls in (base, type(f"My{base.__name__}", (base,), {})):
            built = hf.mesh_cp_trainer_class(cls)
            assert issubclass(built, cls) and issubclass(built, mixin) and not issubclass(built, MeshCPTrainerMixin)
    with pytest.raises(NotImplementedError, match=r"MixedDPO puts MeshCPTrainerMixin.*hf.mesh_cp_trainer_class"):
        type("MixedDPO", (MeshCPTrainerMixin, DPOTrainer), {})(model=None, args=None)


def test_world_other_than_the_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_world, without a process group (the layout's group taken to hold 4 ranks): accelerate or the DeepSpeed
    engine seeing another number of processes is refused naming both and the fix; 4 and 4 pass. The launched runs of
    tests/integrations/trl/test_trl.py show accelerate's own count refused without use_cpu=True."""
    from types import SimpleNamespace

    from mesh_cp.integrations.hf import replicas as module

    monkeypatch.setattr(module.dist, "get_world_size", lambda group: 4)

    def trainer(processes: int) -> SimpleNamespace:
        return SimpleNamespace(
            parallel=SimpleNamespace(group="group"), accelerator=SimpleNamespace(num_processes=processes)
        )

    module.check_world(trainer(4), engine=SimpleNamespace(dp_world_size=4))
    with pytest.raises(ValueError, match=r"^accelerate sees 1 process\(es\) but .* spans 4 ranks.*use_cpu=True"):
        module.check_world(trainer(1))
    with pytest.raises(ValueError, match=r"^the DeepSpeed engine's data-parallel group sees 2 process\(es\) but .* 4"):
        module.check_world(trainer(4), engine=SimpleNamespace(dp_world_size=2))
    with pytest.raises(ValueError, match=r"^accelerate sees 8 process\(es\) but .* 4 ranks.*Build the layout over the"):
        module.check_world(trainer(8))  # a layout on a subgroup: use_cpu is not the fix there
