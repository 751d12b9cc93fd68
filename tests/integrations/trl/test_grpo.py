"""TRL's ``GRPOTrainer`` under mesh_cp (``hf.mesh_cp_trainer_class(GRPOTrainer)``) against the single-process
``GRPOTrainer`` on the same tiny model, prompts, reward and seed, and the same sampled completions (grpo_cases.py's
keyed Gumbel sampling), at DP 1 x CP 4 (tile 2x2) and DP 2 x CP 2 (run by rl_script.py in the shared launch):
``grpo`` with a KL term, ``dapo`` with two iterations per generation and the high-entropy mask, ``dr_grpo`` with
``scale_rewards="batch"``, ``bnpo`` with sequence-level importance sampling and two iterations, ``cispo`` with two
iterations, ``sapo`` with a KL term, and ``RLOOTrainer`` (the same mixin) with a KL term. Every step's loss and metrics within 1e-5 over 3 steps, ``num_tokens`` equal; the
GRPOTrainer block of docs/hf.md trains as written (sampling); what mesh_cp does not run is refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.integrations.trl.grpo_cases import CASES, METRICS, STEPS  # noqa: E402
from tests.integrations.trl.rl_common import check_refusals, result  # noqa: E402

TOL = 1e-5
LAYOUTS = ("dp1xcp4", "dp2xcp2")
TRAINED = sorted(set(CASES) - {"doc_example", "refusals"})
MAIN = ("loss", "reward", "reward_std", "kl", "rewards/distinct/mean", "rewards/distinct/std")
"""Within :data:`TOL` absolutely; the others within :data:`TOL` of their size where it exceeds 1, fp32 rounding being
relative; the gradient norm, a root of a sum over every parameter of squares of sums over every token, within 1e-4 of
its size."""


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRAINED)
def test_grpo_trainer_equals_single_process(rl_runs, case, layout):
    reference, mesh = rl_runs
    want, got = result(reference, f"grpo:{case}"), result(mesh, f"grpo:{case}@{layout}")
    assert want["loss"][0] is not None and want["reward"][0] is not None, want
    for key in METRICS:
        assert len(want[key]) == len(got[key]) == STEPS, (key, want[key], got[key])
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            if b is None:  # not logged at this step (no generation, or no KL term), on either side
                assert a is None, (key, step, got[key], want[key])
            elif key == "num_tokens":
                assert a == b, (key, got[key], want[key])
            else:
                scale = 1.0 if key in MAIN else max(1.0, abs(b)) * (10 if key == "grad_norm" else 1)
                assert abs(a - b) <= TOL * scale, (key, step, got[key], want[key])


def test_grpo_cases_learn_from_spread_rewards(rl_runs):
    """The comparison can tell: the rewards of a group differ (non-zero advantages), the gradients are far from zero
    and the policy moves away from the reference (the KL grows)."""
    reference = result(rl_runs[0], "grpo:grpo_kl")
    assert min(reference["reward_std"]) > 1e-3 and reference["frac_reward_zero_std"][0] < 1, reference
    assert min(reference["grad_norm"]) > 0.1 and reference["kl"][-1] > 10 * reference["kl"][0] + 1e-6, reference


def test_docs_grpo_block_trains(rl_runs):
    done = result(rl_runs[1], "grpo:doc_example@dp2xcp2")
    assert done["steps"] == 2 and "DP(2)" in done["layout"], done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refusals(rl_runs, layout):
    check_refusals(
        rl_runs[1],
        f"grpo:refusals@{layout}",
        {"use_vllm", "rollout_func", "tools", "iterable", "evaluate", "generation_batch"},
    )
