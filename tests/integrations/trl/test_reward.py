"""TRL's ``RewardTrainer`` under mesh_cp (``hf.mesh_cp_trainer_class(RewardTrainer)``) against the single-process
``RewardTrainer`` on the same tiny reward model, pairs and seed, at DP 1 x CP 4 (tile 2x2) and DP 2 x CP 2 (the cases
of reward_cases.py, run by rl_script.py in the shared launch): plain pairs, a ``margin`` column,
``center_rewards_coefficient``, and a ``prompt`` column with the pad token equal to ``<eos>`` (without gradient
checkpointing). Every step's loss, accuracy, margin, minimum, mean and maximum reward and gradient norm within 1e-5
over 3 steps, ``num_tokens`` equal; an epoch ending on a short batch too at DP 1, refused at DP 2 where it splits unevenly (on every rank, before
training). The RewardTrainer block of docs/hf.md trains as written on DP 2 x CP 2; a PEFT
adapter and ``evaluate()`` are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.integrations.trl.reward_cases import CASES, METRICS, STEPS  # noqa: E402
from tests.integrations.trl.rl_common import result  # noqa: E402

TOL = 1e-5
LAYOUTS = ("dp1xcp4", "dp2xcp2")
TRAINED = sorted(set(CASES) - {"doc_example", "refusals", "short_last_batch"})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRAINED)
def test_reward_trainer_equals_single_process(rl_runs, case, layout):
    reference, mesh = rl_runs
    want = result(reference, f"reward:{case}")
    got = result(mesh, f"reward:{case}@{layout}")
    for key in METRICS:
        assert len(want[key]) == len(got[key]) == STEPS, (key, want[key], got[key])
        assert all(value is not None for value in want[key]), (key, want[key])
        if key == "num_tokens":
            assert got[key] == want[key], (key, got[key], want[key])
        else:
            worst = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
            assert worst <= TOL, (key, worst, got[key], want[key])


def test_short_last_batch(rl_runs):
    """An epoch of 7 pairs (batches of 4 and 3): at DP 1 x CP 4 the single process's 2 steps; at DP 2 x CP 2 the
    second batch splits 2 and 1 over the replicas (TRL's means per replica would not average to the batch's): refused
    by name on every rank."""
    reference, mesh = rl_runs
    want = result(reference, "reward:short_last_batch")
    got = result(mesh, "reward:short_last_batch@dp1xcp4")
    assert got["num_tokens"] == want["num_tokens"] and len(want["loss"]) == 2, (got, want)
    for key in set(METRICS) - {"num_tokens"}:
        assert max(abs(a - b) for a, b in zip(got[key], want[key], strict=True)) <= TOL, (key, got[key], want[key])
    raised = mesh["reward:short_last_batch@dp2xcp2"].get("raised", "did not raise")
    assert raised.startswith(
        "NotImplementedError: the epoch's last batch of 3 pairs (7 in batches of 2 x 2 replicas)"
    ), raised[:600]


def test_reward_cases_differ(rl_runs):
    """The cases are different runs (a margin column, centring and the pad token change what is logged)."""
    reference, _ = rl_runs
    losses = {case: tuple(result(reference, f"reward:{case}")["loss"]) for case in TRAINED}
    assert len(set(losses.values())) == len(losses), losses


def test_docs_reward_block_runs(rl_runs):
    _, mesh = rl_runs
    done = result(mesh, "reward:doc_example@dp2xcp2")
    assert done["steps"] == 2, done
    assert done["layout"].startswith("DP(2) x CP(1x2)"), done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reward_refusals(rl_runs, layout):
    _, mesh = rl_runs
    out = dict(result(mesh, f"reward:refusals@{layout}"))
    out.pop("case")
    assert out and {k: v for k, v in out.items() if v is not True} == {}, out
