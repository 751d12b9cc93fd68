"""What the whole-sequence trainers' cases (dpo_cases.py, grpo_cases.py, reward_cases.py) and their tests share: the
docs block a case runs as written, every step's logged metrics, and a case's result read by a test."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[3] / "docs" / "hf.md"
"""The page that holds the trainers' examples."""


def doc_block(marker: str) -> str:
    """The Python block of docs/hf.md between the ``<!-- {marker}:start -->`` and ``<!-- {marker}:end -->`` lines."""
    found = re.search(rf"<!-- {marker}:start -->\n```python\n(.*?)```\n<!-- {marker}:end -->", DOC.read_text(), re.S)
    assert found is not None, f"{DOC} has no block between the {marker} markers"
    return found.group(1)


def run_doc_block(marker: str, scope: dict[str, Any]) -> dict[str, Any]:
    """The block of :func:`doc_block` run as written with the user's objects in ``scope``; the steps its trainer
    trained and the layout it made."""
    exec(compile(doc_block(marker), str(DOC), "exec"), scope)  # noqa: S102 - the documented example, run as written
    return {"steps": scope["trainer"].state.global_step, "layout": str(scope["parallel"])}


def logged(trainer: Any, metrics: tuple[str, ...]) -> dict[str, list]:
    """Every training step's value of each of ``metrics`` in ``trainer``'s log (``None`` where a step did not log it)."""
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h.get(key) for h in steps] for key in metrics}


def result(runs: dict, name: str) -> dict:
    """Case ``name``'s result in ``runs``; fails with its traceback if it raised."""
    found = runs[name]
    assert "raised" not in found, f"{name}: {found['raised']}"
    return found


def check_refusals(runs: dict, name: str, expected: set[str]) -> None:
    """Case ``name`` (a refusals case) checked every refusal of ``expected``, each with the message it names."""
    outcomes = {k: v for k, v in result(runs, name).items() if k != "case"}
    assert set(outcomes) == expected, outcomes
    for refusal, outcome in outcomes.items():
        assert outcome is True, (refusal, outcome)
