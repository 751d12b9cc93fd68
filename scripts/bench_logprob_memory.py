"""Per-rank memory of the log-prob path of the whole-sequence trainers under CP (CPU, fp32): TRL's fused LM head with
the call sharded over the mesh (``shard_fused_calls``, Note [Whole sequences under CP] in
:mod:`mesh_cp.integrations.hf.scores`) against the plain logits path, as fractions of the full rows' ``[B, S, V]``
fp32 logits.

For each ``(S, V)`` of ``--sizes`` and each CP of ``--cp`` (one spawned gloo group per CP, tile 1 x CP), every rank
builds a one-layer Llama of width ``--hidden`` over ``V`` tokens (fp32, random weights) and measures the forward and
backward of ``B`` full rows of ``S`` tokens three ways:

- ``fused``: the fused call of full rows, ``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)``, which
  runs this rank's shard with TRL's ``ChunkedLogProbFunction`` and gathers the ``(B, S)`` log-probs (what
  ``hf.mesh_cp_trainer_class(DPOTrainer)`` runs), its ``log_probs`` summed and differentiated;
- ``shard logits``: the same attached model called plainly on this rank's shard (``hf.shard_batch``), its
  ``[B, S / CP, V]`` logits and ``hf.causal_lm_loss`` (mesh_cp's token-mean path, as an SFT step runs it);
- ``plain``: the stock model on the full rows, one process (rank 0 only; the same on every rank).

``peak``: the most bytes allocated above what was held on entry (:class:`mesh_cp.testing.MemoryPeak`, the profiler's
every CPU allocation and free), the weights' gradients included. ``largest``: the largest fp32 storage any op of the
forward or backward returned (a dispatch mode, op by op). Both as fractions of ``B * S * V * 4`` bytes. On CPU TRL
scores every position of the shard in tiles of ``[min(B * S / CP, 4096), 32768]`` and folds each tile with torch
operations that hold a few tile-sized temporaries; its Triton kernels on GPUs fold a tile in place, so a GPU's peak
is lower than these CPU numbers.

::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_logprob_memory.py
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_logprob_memory.py --cp 2 --sizes 1024x131072
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh_cp.testing import MemoryPeak, spawn_gloo  # noqa: E402
from tests.integrations.hf.test_logprob_memory import LargestTensors  # noqa: E402

BATCH = 1
SIZES = ((256, 50_000), (256, 131_072), (1024, 50_000), (1024, 131_072))
"""``(S, V)`` of the rows and vocabulary measured by default."""


def model_of(vocab: int, hidden: int) -> torch.nn.Module:
    """A one-layer Llama of width ``hidden`` over ``vocab`` tokens (fp32, untied head, seed 0)."""
    from transformers import AutoModelForCausalLM

    from mesh_cp.testing.models import tiny_config

    config = tiny_config(
        "LlamaConfig", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=1 << 16,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def measured(step) -> dict:
    """``step()`` (a forward and backward) measured: ``{"peak": bytes above entry, "largest": fp32 elements}``."""
    gc.collect()
    with MemoryPeak() as mem, LargestTensors() as largest:
        step()
    return {"peak": mem.peak, "largest": largest.fp32()[0]}


def size_row(mesh, seq: int, vocab: int, hidden: int) -> dict:
    """This rank's measurements of one ``(seq, vocab)`` (module doc), each as a fraction of the fp32 logits."""
    from trl.trainer.utils import add_fused_lm_head

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.scores import shard_fused_calls

    stock = model_of(vocab, hidden)
    model = copy.deepcopy(stock)
    add_fused_lm_head(model)
    hf.attach(model, mesh)
    shard_fused_calls(model, mesh, grad_scale=mesh.size)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    shard = hf.shard_batch(ids, mesh=mesh)

    def fused() -> None:
        model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True).log_probs.sum().backward()

    def shard_logits() -> None:
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
        hf.causal_lm_loss(logits, shard.shift_labels, shard.num_items_in_batch).backward()

    def plain() -> None:
        stock(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    steps = {"fused": fused, "shard logits": shard_logits}
    if mesh.rank == 0:
        steps["plain"] = plain
    logits_bytes = BATCH * seq * vocab * 4
    row = {"seq": seq, "vocab": vocab, "cp": mesh.size, "rank": mesh.rank, "logits MiB": logits_bytes / 2**20}
    for name, step in steps.items():
        got = measured(step)
        row[name] = {"peak": got["peak"] / logits_bytes, "largest": got["largest"] * 4 / logits_bytes}
        for m in (model, stock):
            m.zero_grad(set_to_none=True)
    return row


def worker(rank: int, world: int, sizes: list[tuple[int, int]], hidden: int) -> list[dict]:
    import torch.distributed as dist
    import transformers

    from mesh_cp.runtime.parallel import DataContextParallel

    transformers.logging.set_verbosity_error()
    mesh = DataContextParallel.create(dist.group.WORLD, cp_size=world, tile=(1, world)).mesh
    return [size_row(mesh, seq, vocab, hidden) for seq, vocab in sizes]


def table(rows: list[dict]) -> str:
    """The markdown table: one line per (CP, S, V, rank)."""
    lines = [
        "| CP | S | V | rank | [B,S,V] fp32 | fused peak | fused largest | shard logits peak | shard logits largest "
        "| plain peak | plain largest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["cp"], r["seq"], r["vocab"], r["rank"])):
        cells = [f"{r[k]['peak']:.3f} | {r[k]['largest']:.3f}" if k in r else "- | -" for k in
                 ("fused", "shard logits", "plain")]  # fmt: skip
        lines.append(f"| {r['cp']} | {r['seq']} | {r['vocab']} | {r['rank']} | {r['logits MiB']:.0f} MiB | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", help="SxV pairs, e.g. 1024x131072", default=None)
    parser.add_argument("--hidden", type=int, default=16)
    args = parser.parse_args()
    sizes = SIZES if args.sizes is None else [tuple(int(x) for x in s.split("x")) for s in args.sizes]
    rows = []
    for cp in args.cp:
        if any(seq % (2 * cp) for seq, _ in sizes):
            raise ValueError(f"every S must be a multiple of 2 * CP = {2 * cp} (the zig-zag layout), got {sizes}")
        for per_rank in spawn_gloo(worker, cp, list(sizes), args.hidden):
            rows += per_rank
    print("CPU, fp32, B = 1; peak and largest as fractions of the [B, S, V] fp32 logits' bytes")
    print(table(rows))


if __name__ == "__main__":
    main()
