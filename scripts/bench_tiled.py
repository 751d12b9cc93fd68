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
import dataclasses
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh_cp.sim.step import ModelConfig, StepOptions, step_memory  # noqa: E402

TRL_TILE_TOKENS = 4096
"""Tokens per tile of TRL's fused LM head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration: the model's sizes, the tokens of a rank, and the levers."""

    name: str
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 256
    seq: int = 2048
    mlp_tiles: int = 1
    fused: bool = False
    checkpointing: bool = False

    def config(self) -> ModelConfig:
        """The model's sizes as the memory model reads them."""
        return ModelConfig(
            name=self.name,
            hidden=self.hidden,
            intermediate=self.intermediate,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.heads,
            head_dim=self.hidden // self.heads,
            vocab=self.vocab,
        )

    def options(self) -> StepOptions:
        """How the step runs, as the memory model reads it."""
        return StepOptions(
            gpus=1,
            precision="fp32",
            sharding="replicated",
            checkpointing=self.checkpointing,
            lm_head="chunked" if self.fused else "full",
            lm_head_chunk=TRL_TILE_TOKENS,
            mlp_tiles=self.mlp_tiles,
            foreach=False,
        )


LOGITS = {"name": "logits dominate: vocab 128K", "vocab": 131072}
LOGITS_256K = {"name": "logits dominate: vocab 256K", "vocab": 262144, "seq": 1024}
MLP = {"name": "MLP dominates: intermediate 16K", "intermediate": 16384}
CASES = (
    Case(**LOGITS),
    Case(**LOGITS, fused=True),
    Case(**LOGITS_256K),
    Case(**LOGITS_256K, fused=True),
    Case(**MLP),
    Case(**MLP, mlp_tiles=8),
    Case(**MLP, checkpointing=True),
    Case(**MLP, checkpointing=True, mlp_tiles=8),
)
"""Pairs: the model's own LM head and MLP, then the lever that targets what dominates."""


def build(case: Case) -> tuple[object, object, Callable[[], None]]:
    """The fp32 model of ``case`` (seeded random weights) with its levers, its AdamW and the step function."""
    import torch
    import transformers

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=case.intermediate,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.heads,
        max_position_embeddings=case.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if case.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if case.mlp_tiles > 1:
        hf.tile_mlp(model, shards=case.mlp_tiles)
    if case.fused:
        hf.fused_lm_head(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(case.vocab, (1, case.seq), generator=torch.Generator().manual_seed(1))
    shift_labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    count = int((shift_labels != -100).sum())

    def step() -> None:
        if case.fused:
            loss = model(input_ids=ids, shift_labels=shift_labels, num_items_in_batch=count, fused_lm_head=True).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def measure(case: Case) -> dict:
    """The measured and predicted peaks of ``case``'s second step above what it holds on entry, in bytes."""
    from mesh_cp.testing import MemoryPeak

    _, _, step = build(case)
    step()  # AdamW creates its states in the first step
    gc.collect()
    with MemoryPeak() as mem:
        step()
    predicted = step_memory(case.config(), case.seq, case.options())
    above = predicted.peak - predicted.parts["weights"] - predicted.parts["optimizer states"]
    return {"case": case.name, "tokens": case.seq, "levers": _levers(case), "measured": mem.peak, "predicted": above}


def _levers(case: Case) -> str:
    levers = [f"tiled MLP ({case.mlp_tiles})" if case.mlp_tiles > 1 else "", "fused LM head" if case.fused else ""]
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
        rows.append(measure(case))
        gc.collect()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
