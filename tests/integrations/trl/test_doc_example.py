"""The TRL example of docs/hf.md runs as written: its code block, given a tiny model, tokenizer, dataset and output
folder (what the user brings), under ``accelerate launch`` on 4 gloo processes (DP 2 x CP 2), trains 2 steps. It runs
in the processes of test_trl.py's launch, after sft_script.py (conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.integrations.accelerate.test_accelerate import ROOT  # noqa: E402

PRELUDE = """
import sys
sys.path.insert(0, {tests!r})
from mesh_cp.testing import gloo_exit_workaround
gloo_exit_workaround()
from transformers import AutoModelForCausalLM
import sft_script
model = AutoModelForCausalLM.from_config(sft_script.MODEL())
tokenizer = sft_script.tokenizer()
dataset = sft_script.datasets()["short"]
output_dir = {out!r}
"""

EPILOGUE = """
assert trainer.state.global_step == 2, trainer.state

with open(f"{output_dir}.rank{dist.get_rank()}", "w") as f:  # one file a rank: printed lines interleave
    f.write(f"trained {trainer.state.global_step} steps on {parallel}")
dist.barrier()
dist.destroy_process_group()
"""


DOC = "docs/hf.md"
"""The page that holds the example, between the trl-example markers."""


def doc_block() -> str:
    text = (ROOT / DOC).read_text()
    section = re.search(r"<!-- trl-example:start -->\n```python\n(.*?)```\n<!-- trl-example:end -->", text, re.S)
    assert section is not None, f"{DOC} has no TRL example between the trl-example markers"
    return section.group(1)


def doc_script(folder: Path) -> Path:
    """The example's code block between :data:`PRELUDE` and :data:`EPILOGUE`, as a script in ``folder`` that writes
    ``folder/out.rank<R>`` on every rank."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "docs_trl.py"
    prelude = PRELUDE.format(tests=str(Path(__file__).parent), out=str(folder / "out"))
    script.write_text(prelude + doc_block() + EPILOGUE)
    return script


def test_docs_trl_block_runs(trl_runs) -> None:
    _, folder = trl_runs
    for rank in range(4):
        done = (folder / f"out.rank{rank}").read_text()
        assert done.startswith("trained 2 steps on DP(2) x CP(1x2)"), (rank, done)
