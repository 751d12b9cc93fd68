"""TRL's ``DPOTrainer`` under mesh_cp (``hf.mesh_cp_trainer_class(DPOTrainer)``) against the single-process
``DPOTrainer`` on the same tiny model, pairs and seed, at DP 1 x CP 4 (tile 2x2) and DP 2 x CP 2 (the cases of
dpo_cases.py, run by rl_script.py in the shared launch): the sigmoid loss with a reference model and with
``use_weighting``, ``ipo`` + ``sigmoid`` with precomputed reference log-probs, ``hinge`` with ``ld_alpha``, gradient accumulation and
``sync_ref_model``, a LoRA adapter as its own reference. Every step's loss and metrics within 1e-5 over 3 steps and
``num_tokens`` equal. TRL's ``sft`` loss type is a token mean within each process's batch: exact at DP 1, TRL's DDP
result at DP 2. An epoch ending on a short batch is exact at DP 1 and refused at DP 2; the DPOTrainer block of
docs/hf.md trains as written; evaluation and the options mesh_cp does not run are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.integrations.trl.dpo_cases import CASES, METRICS, STEPS  # noqa: E402
from tests.integrations.trl.rl_common import check_refusals, result  # noqa: E402

TOL = 1e-5
LAYOUTS = ("dp1xcp4", "dp2xcp2")
TRAINED = sorted(set(CASES) - {"doc_example", "refusals", "short_last_batch", "sft_one_replica"})
MAIN = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""Within :data:`TOL` absolutely; the other metrics (summed log-probs of about -90, gradient norms of about 50)
within :data:`TOL` of their size where it exceeds 1, fp32 rounding being relative; the gradient norm, a root of a sum
over every parameter of squares of sums over every token, within 1e-4 of its size."""
NEAR_ZERO = 1e-4
"""Below this, a step's reward margin is rounding (the policy equals the reference before the first update, and
``use_weighting``'s weights of about 1e-20 make no update): ``rewards/accuracies`` compares two equal rewards there."""


def _check(got: dict, want: dict, steps: int) -> None:
    for key in METRICS:
        assert len(want[key]) == len(got[key]) == steps, (key, want[key], got[key])
        assert all(value is not None for value in want[key]), (key, want[key])
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            if key == "num_tokens":
                assert a == b, (key, got[key], want[key])
            elif key == "rewards/accuracies" and abs(want["rewards/margins"][step]) < NEAR_ZERO:
                continue
            else:
                scale = 1.0 if key in MAIN else max(1.0, abs(b)) * (10 if key == "grad_norm" else 1)
                assert abs(a - b) <= TOL * scale, (key, step, got[key], want[key])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRAINED)
def test_dpo_trainer_equals_single_process(rl_runs, case, layout):
    reference, mesh = rl_runs
    _check(result(mesh, f"dpo:{case}@{layout}"), result(reference, f"dpo:{case}"), STEPS)


def test_dpo_training_moves_the_rewards(rl_runs):
    """The comparison can tell: training moves the rewards far beyond the tolerance."""
    reference = result(rl_runs[0], "dpo:sigmoid")
    assert abs(reference["rewards/margins"][-1]) > 1e-2, reference["rewards/margins"]
    assert len(set(reference["loss"])) == STEPS, reference["loss"]


def test_sft_loss_type_is_trls_ddp_mean(rl_runs):
    """TRL's ``sft`` loss type is a token mean within a process's batch: one replica is the single process's, two
    replicas average their token means as TRL's own DDP does (so the losses part by more than rounding)."""
    reference, mesh = rl_runs
    want = result(reference, "dpo:sft_one_replica")
    _check(result(mesh, "dpo:sft_one_replica@dp1xcp4"), want, STEPS)
    got = result(mesh, "dpo:sft_one_replica@dp2xcp2")
    assert max(abs(a - b) for a, b in zip(got["loss"], want["loss"], strict=True)) > 1e-4


def test_short_last_batch(rl_runs):
    """7 pairs in batches of 4: the epoch's last step has 3, exact at DP 1, refused at DP 2 (2 and 1 pairs) on every
    rank when the dataloader is made, before training."""
    reference, mesh = rl_runs
    want = result(reference, "dpo:short_last_batch")
    _check(result(mesh, "dpo:short_last_batch@dp1xcp4"), want, 2)
    raised = mesh["dpo:short_last_batch@dp2xcp2"].get("raised", "")
    assert (
        "the epoch's last batch of 3 pairs (7 in batches of 2 x 2 replicas) splits unevenly over the 2 DP" in raised
    ), raised


def test_docs_dpo_block_trains(rl_runs):
    done = result(rl_runs[1], "dpo:doc_example@dp2xcp2")
    assert done["steps"] == 2 and "DP(2)" in done["layout"], done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refusals(rl_runs, layout):
    expected = {"evaluate", "eval_strategy", "neftune", "no_parallel", "router_logits", "prompt_tuning"}
    check_refusals(rl_runs[1], f"dpo:refusals@{layout}", expected)
