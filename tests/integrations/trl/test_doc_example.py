"""The TRL example of docs/hf.md runs as written: its code block, given a tiny model, tokenizer, dataset and output
folder (what the user brings), under ``accelerate launch`` on 4 gloo processes (DP 2 x CP 2), trains 2 steps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.integrations.accelerate.test_accelerate import ROOT, accelerate_launch  # noqa: E402

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


def test_docs_trl_block_runs(tmp_path: Path) -> None:
    script = tmp_path / "docs_trl.py"
    prelude = PRELUDE.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"))
    script.write_text(prelude + doc_block() + EPILOGUE)
    accelerate_launch(script, port=29634, cwd=tmp_path)
    for rank in range(4):
        done = (tmp_path / f"out.rank{rank}").read_text()
        assert done.startswith("trained 2 steps on DP(2) x CP(1x2)"), (rank, done)
