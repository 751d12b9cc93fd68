"""TRL's ``RewardTrainer`` under mesh_cp (``hf.mesh_cp_trainer_class(RewardTrainer)``) against the single-process
``RewardTrainer`` on the same tiny reward model, pairs and seed, at DP 1 x CP 4 (tile 2x2) and DP 2 x CP 2 (the cases
of reward_cases.py, run by rl_script.py in the shared launch): plain pairs, a ``margin`` column,
``center_rewards_coefficient``, and a ``prompt`` column with the pad token equal to ``<eos>`` (without gradient
checkpointing). Every step's loss, accuracy, margin, minimum, mean and maximum reward and gradient norm within 1e-5
over 3 steps, ``num_tokens`` equal. The RewardTrainer block of docs/hf.md trains as written on DP 2 x CP 2; a PEFT
adapter and ``evaluate()`` are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.integrations.trl.reward_cases import CASES, METRICS, STEPS  # noqa: E402

TOL = 1e-5
LAYOUTS = ("dp1xcp4", "dp2xcp2")
TRAINED = sorted(set(CASES) - {"doc_example", "refusals"})


def _result(runs: dict, name: str) -> dict:
    result = runs[name]
    assert "raised" not in result, f"{name}: {result['raised']}"
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRAINED)
def test_reward_trainer_equals_single_process(rl_runs, case, layout):
    reference, mesh = rl_runs
    want = _result(reference, f"reward:{case}")
    got = _result(mesh, f"reward:{case}@{layout}")
    for key in METRICS:
        assert len(want[key]) == len(got[key]) == STEPS, (key, want[key], got[key])
        assert all(value is not None for value in want[key]), (key, want[key])
        if key == "num_tokens":
            assert got[key] == want[key], (key, got[key], want[key])
        else:
            worst = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
            assert worst <= TOL, (key, worst, got[key], want[key])


def test_reward_cases_differ(rl_runs):
    """The cases are different runs (a margin column, centring and the pad token change what is logged)."""
    reference, _ = rl_runs
    losses = {case: tuple(_result(reference, f"reward:{case}")["loss"]) for case in TRAINED}
    assert len(set(losses.values())) == len(losses), losses


def test_docs_reward_block_runs(rl_runs):
    _, mesh = rl_runs
    done = _result(mesh, "reward:doc_example@dp2xcp2")
    assert done["steps"] == 2, done
    assert done["layout"].startswith("DP(2) x CP(1x2)"), done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reward_refusals(rl_runs, layout):
    _, mesh = rl_runs
    out = dict(_result(mesh, f"reward:refusals@{layout}"))
    out.pop("case")
    assert out and {k: v for k, v in out.items() if v is not True} == {}, out
