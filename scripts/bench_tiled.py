"""Peak memory of a training step with the sequence-tiled MLP and the fused LM head (``hf.tile_mlp``,
``hf.fused_lm_head``) against the model's own MLP and loss, on CPU in fp32, and what the step memory model predicts.

The tiled stages are per token, so a CP rank holding T tokens of a sequence runs them as one process runs a sequence
of T tokens: each case is one process with ``seq`` = the tokens of a rank. Each case builds a Llama in fp32 (random
weights), runs one step (forward, backward, AdamW, ``zero_grad(set_to_none=True)``) to create AdamW's states, then
measures the next: the profiler's peak above what is held on entry (:class:`mesh_cp.testing.MemoryPeak`, every CPU
allocation and free). The prediction is :func:`mesh_cp.sim.step.step_memory` less weights and optimizer states, with
``mlp_tiles`` and ``lm_head="chunked"`` (4096 tokens per chunk: TRL's tile height) for the tiled rows.

On CPU TRL's fused head folds each [min(tokens, 4096), 32768] tile of the logits with torch operations, which hold
about 4 tiles (fp32) in forward and 8 in backward; its Triton kernels on GPUs fold a tile in place. The saving on CPU
is therefore about 12 [tokens, vocab] / 8.4 tiles: it grows with the tokens and the vocabulary beyond one tile.

::

    python scripts/bench_tiled.py            # the table of docs/performance.md ("Sequence-tiled MLP and loss")
    python scripts/bench_tiled.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_memory import Case, measure  # noqa: E402

SIZES = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 4, "vocab": 256, "seq": 2048}
"""The Llama every case starts from (a Llama in fp32, random weights)."""

LOGITS = SIZES | {"name": "logits dominate: vocab 128K", "vocab": 131072}
LOGITS_256K = SIZES | {"name": "logits dominate: vocab 256K", "vocab": 262144, "seq": 1024}
MLP = SIZES | {"name": "MLP dominates: intermediate 16K", "intermediate": 16384}
CASES = (
    Case(**LOGITS),
    Case(**LOGITS, lm_head="fused"),
    Case(**LOGITS_256K),
    Case(**LOGITS_256K, lm_head="fused"),
    Case(**MLP),
    Case(**MLP, mlp_tiles=8),
    Case(**MLP, checkpointing=True),
    Case(**MLP, checkpointing=True, mlp_tiles=8),
)
"""Pairs: the model's own LM head and MLP, then the lever that targets what dominates."""


def row(case: Case) -> dict:
    """The measured and predicted peaks of ``case``'s second step above what it holds on entry, in bytes
    (``step_memory.measure``, which builds and steps the model with its levers)."""
    got = measure(case)
    return {"case": case.name, "tokens": case.seq, "levers": _levers(case), "measured": got["measured_above_entry"],
            "predicted": got["predicted_above_entry"]}  # fmt: skip


def _levers(case: Case) -> str:
    levers = [f"tiled MLP ({case.mlp_tiles})" if case.mlp_tiles > 1 else ""]
    levers.append("fused LM head" if case.lm_head == "fused" else "")
    levers.append("checkpointing" if case.checkpointing else "")
    return ", ".join(x for x in levers if x) or "none"


def table(rows: list[dict]) -> str:
    """The markdown table: each case's measured and predicted peak above entry, and the saving of its lever."""
    lines = [
        "| case (fp32) | tokens per rank | levers | measured | saving | predicted | saving |",
        "|---|---|---|---|---|---|---|",
    ]
    base: dict = {}
    for r in rows:
        key = (r["case"], "checkpointing" in r["levers"])
        first = base.setdefault(key, r)
        saving = [f"{first[k] / r[k]:.1f}x" if r is not first else "" for k in ("measured", "predicted")]
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['levers']} | {r['measured'] / 2**20:.0f} MiB | {saving[0]} | "
            f"{r['predicted'] / 2**20:.0f} MiB | {saving[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rows = []
    for case in CASES:
        rows.append(row(case))
        gc.collect()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
