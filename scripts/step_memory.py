"""The whole-step memory model (mesh_cp.sim.step) against measured peaks of real training steps on CPU.

Each case builds a transformers causal LM in fp32 (random weights), runs one training step (forward with labels,
backward, AdamW step, ``zero_grad(set_to_none=True)``) to create the optimizer's states, then measures the next step:
the bytes held on entry (weights and AdamW's states, summed from the tensors) plus the profiler's peak above them
during the step (:class:`mesh_cp.testing.MemoryPeak`, every CPU allocation and free). The prediction is
:func:`mesh_cp.sim.step.step_memory` for the same sizes on one rank, ``precision="fp32"``.

::

    python scripts/step_memory.py               # the calibration table of docs/performance.md
    python scripts/step_memory.py --yardsticks  # the predicted yardstick tables (no torch)
    python scripts/step_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh_cp.sim.step import ModelConfig, StepMemory, StepOptions, step_memory  # noqa: E402

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration: a model's sizes, the sequence, checkpointing, the LM head (``"full"``,
    ``"chunked"``: :func:`_chunked_loss`, ``"fused"``: TRL's fused head through ``hf.fused_lm_head``), the MLP's
    slices (``hf.tile_mlp``), AdamW's kind."""

    name: str
    model: str = "LlamaConfig"
    hidden: int = 128
    intermediate: int = 384
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    vocab: int = 1024
    seq: int = 1024
    checkpointing: bool = False
    lm_head: str = "full"
    mlp_tiles: int = 1
    foreach: bool = False

    def config(self) -> ModelConfig:
        """The model's sizes as the memory model reads them."""
        return ModelConfig(
            name=self.name,
            hidden=self.hidden,
            intermediate=self.intermediate,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            vocab=self.vocab,
            qk_norm=self.model.startswith("Qwen3"),
        )

    def options(self) -> StepOptions:
        """How the step runs, as the memory model reads it."""
        return StepOptions(
            gpus=1,
            precision="fp32",
            sharding="replicated",
            checkpointing=self.checkpointing,
            lm_head="chunked" if self.lm_head == "fused" else self.lm_head,  # type: ignore[arg-type]
            lm_head_chunk=TRL_TILE_TOKENS if self.lm_head == "fused" else CHUNK,
            mlp_tiles=self.mlp_tiles,
            foreach=self.foreach,
        )


CHUNK = 256
"""Tokens per chunk of the chunked LM head the script runs."""

TRL_TILE_TOKENS = 4096
"""Tokens per tile of TRL's fused LM head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``)."""

CASES = (
    Case("llama"),
    Case("llama checkpointed", checkpointing=True),
    Case("llama GQA 8:2, 2048 tokens", kv_heads=2, seq=2048),
    Case("llama vocab 16K", vocab=16384),
    Case("llama vocab 16K, chunked head", vocab=16384, lm_head="chunked"),
    Case("llama 8 layers", layers=8),
    Case("llama 8 layers, 64 tokens, foreach AdamW", layers=8, seq=64, foreach=True),
    Case("llama wide MLP, vocab 256", intermediate=1024, vocab=256),
    Case("llama wide MLP, vocab 256, checkpointed", intermediate=1024, vocab=256, checkpointing=True),
    Case("qwen3 GQA 8:2", model="Qwen3Config", kv_heads=2),
    Case("qwen3 checkpointed, GQA, vocab 8K", model="Qwen3Config", kv_heads=2, vocab=8192, checkpointing=True),
)
"""The calibration cases: checkpointing on and off, sequence length, vocabularies where the logits dominate or not,
layers, GQA, q/k norms (Qwen3), the chunked LM head, AdamW's foreach and one-tensor implementations."""


def _chunked_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The LM head and cross-entropy over :data:`CHUNK` tokens at a time, each chunk recomputed in backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]

    def chunk_loss(h, y):
        logits = model.lm_head(h).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    total = sum(
        checkpoint(chunk_loss, hidden[:, i : i + CHUNK], shifted[:, i : i + CHUNK], use_reentrant=False)
        for i in range(0, hidden.shape[1], CHUNK)
    )
    return total / (shifted != -100).sum()


def build(case: Case) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The fp32 model of ``case`` (seeded random weights) with its levers, its AdamW and the step function."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, case.model)(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=case.intermediate,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.hidden // case.heads,
        max_position_embeddings=case.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if case.checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x; the old name before
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case.mlp_tiles > 1 or case.lm_head == "fused":
        from mesh_cp.integrations import hf

        if case.mlp_tiles > 1:
            hf.tile_mlp(model, shards=case.mlp_tiles)
        if case.lm_head == "fused":
            hf.fused_lm_head(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=case.foreach)
    ids = torch.randint(case.vocab, (1, case.seq), generator=torch.Generator().manual_seed(1))
    shift_labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)

    def step() -> None:
        if case.lm_head == "fused":
            count = int((shift_labels != -100).sum())
            loss = model(input_ids=ids, shift_labels=shift_labels, num_items_in_batch=count, fused_lm_head=True).loss
        elif case.lm_head == "chunked":
            loss = _chunked_loss(model, ids, ids)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def measure(case: Case) -> dict:
    """The measured and predicted peaks of ``case``'s second training step, in bytes."""
    import torch

    from mesh_cp.testing import MemoryPeak

    model, optimizer, step = build(case)
    step()  # AdamW creates its states in the first step
    gc.collect()
    held = sum(p.nbytes for p in model.parameters())
    held += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    with MemoryPeak() as mem:
        step()
    predicted = step_memory(case.config(), case.seq, case.options())
    return {
        "case": case.name,
        "measured": held + mem.peak,
        "measured_above_entry": mem.peak,
        "predicted": predicted.peak,
        "predicted_above_entry": predicted.peak - predicted.parts["weights"] - predicted.parts["optimizer states"],
        "moment": predicted.moment,
    }


CP_CASE = Case("llama, CP over 2 gloo ranks (ring), DDP", seq=2048)
"""The CP case: ``seq`` tokens split over 2 ranks (zig-zag), mesh_cp's attention through ``hf.attach``, gradients
summed over the group by DDP (``hf.data_parallel``, whose buckets hold a copy of the gradients)."""


def cp_worker(rank: int, world: int) -> dict:
    """One rank of :data:`CP_CASE`: the peak of building the model, DDP and AdamW and running two steps, measured
    from nothing (DDP's buckets are allocated when it wraps the model), against the prediction with the attention's
    buffers of the mesh's own plan on gloo (:func:`mesh_cp.sim.memory.peak_bytes`)."""
    import torch
    import torch.distributed as dist

    import mesh_cp
    from mesh_cp.core import AttentionShape, make_plan
    from mesh_cp.integrations import hf
    from mesh_cp.sim.memory import peak_bytes
    from mesh_cp.testing import MemoryPeak

    case = CP_CASE
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    ids = torch.randint(case.vocab, (1, case.seq), generator=torch.Generator().manual_seed(1))
    batch = hf.shard_batch(ids, mesh=mesh)
    with MemoryPeak() as mem:
        model, _, _ = build(case)
        ddp = hf.data_parallel(hf.attach(model, mesh), mesh=mesh)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=case.foreach)
        for _ in range(2):
            logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
            del logits
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    config = case.config()
    shape = AttentionShape(1, case.seq // world, config.heads, config.kv_heads, config.head_dim, 4)
    plan = make_plan(mesh.tiling, shape, causal=True, layout="zigzag")
    attention = (peak_bytes(plan, "forward", backend="gloo"), peak_bytes(plan, "backward", backend="gloo"))
    options = dataclasses.replace(case.options(), gpus=world, cp=world)
    predicted = step_memory(config, case.seq, options, attention=attention)
    name = f"{case.name}, rank {rank}"
    return {"case": name, "measured": mem.peak, "predicted": predicted.peak, "moment": predicted.moment}


def measure_cp(world: int = 2) -> list[dict]:
    """:func:`cp_worker` on ``world`` spawned gloo ranks: every rank's row."""
    from mesh_cp.testing import spawn_gloo

    return spawn_gloo(cp_worker, world)


def table(rows: list[dict]) -> str:
    """The markdown table of docs/performance.md: measured against predicted, whole peak and above the entry."""
    lines = [
        "| case | measured peak | predicted | ratio | above entry: measured | predicted | ratio | peak moment |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        whole, above = r["predicted"] / r["measured"], r["predicted_above_entry"] / r["measured_above_entry"]
        lines.append(
            f"| {r['case']} | {r['measured'] / 2**20:.1f} MiB | {r['predicted'] / 2**20:.1f} MiB | {whole:.2f} | "
            f"{r['measured_above_entry'] / 2**20:.1f} MiB | {r['predicted_above_entry'] / 2**20:.1f} MiB | "
            f"{above:.2f} | {r['moment']} |"
        )
    return "\n".join(lines)


BUDGET = 80 * 10**9
"""The yardsticks' GPU memory: an 80 GB H100, in powers of 1000 (its 80 GiB less the CUDA context, NCCL's buffers
and the caching allocator's slack)."""

YARDSTICK_LEVERS = (
    ("FSDP2, checkpointing, full LM head", {"lm_head": "full"}),
    ("FSDP2, checkpointing, chunked LM head", {}),
    ("+ activation offload", {"offload": True}),
    ("+ tiled MLP (8 slices)", {"offload": True, "mlp_tiles": 8}),
    ("+ fused RMSNorm", {"offload": True, "mlp_tiles": 8, "fused_norm": True}),
    ("+ optimizer offload", {"offload": True, "mlp_tiles": 8, "fused_norm": True, "optimizer_offload": True}),
)
"""The levers, each row adding to the one above (the chunked LM head from the second row on)."""


def _within(model: ModelConfig, options: StepOptions, seq: int) -> StepMemory:
    """The step's memory with the fastest attention layout, or the one of least memory where that exceeds
    :data:`BUDGET` (what ``mesh-cp plan --budget`` does)."""
    from mesh_cp.sim.step import attention_buffers, layout_budget

    budget = layout_budget(model, seq, options, BUDGET)
    return step_memory(model, seq, options, attention=attention_buffers(model, seq, options, memory_budget=budget))


def yardsticks() -> str:
    """The predicted yardstick tables: Qwen3-8B at 1M tokens on 8 GPUs against TRL, Llama-3-8B's longest sequence on
    1, 8 and 32 GPUs against DeepSpeed ALST."""
    from mesh_cp.sim.step import MODEL_PRESETS, longest_seq

    qwen, llama = MODEL_PRESETS["qwen3-8b"], MODEL_PRESETS["llama-3-8b"]
    lines = [
        "| Qwen3-8B, 1M tokens, 8 GPUs (cp 8, FSDP2 over 8) | peak per GPU | at | longest sequence at 80 GB |",
        "|---|---|---|---|",
    ]
    for label, lever in YARDSTICK_LEVERS:
        options = StepOptions(gpus=8, **{"lm_head": "chunked", **lever})
        memory = step_memory(qwen, 2**20, options)
        seq = longest_seq(qwen, options, BUDGET, memory=functools.partial(_within, qwen, options))
        lines.append(
            f"| {label} | {memory.peak / 1e9:.1f} GB (predicted) | {memory.moment} | {seq / 1e6:.2f}M (predicted) |"
        )
    lines += ["", "| Llama-3-8B, longest sequence at 80 GB | 1 GPU | 8 GPUs | 32 GPUs |", "|---|---|---|---|"]
    for label, lever in YARDSTICK_LEVERS:
        cells = []
        for gpus in (1, 8, 32):
            sharding = "zero3" if gpus == 1 else "fsdp2"  # one GPU: bf16 weights and grads, nothing to shard
            options = StepOptions(gpus=gpus, sharding=sharding, **{"lm_head": "chunked", **lever})
            seq = longest_seq(llama, options, BUDGET, memory=functools.partial(_within, llama, options))
            cells.append(f"{seq / 1e6:.2f}M (predicted)" if seq else "does not fit")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--case", action="append", default=None, help="only these cases (by name)")
    parser.add_argument("--yardsticks", action="store_true", help="print the predicted yardstick tables only")
    args = parser.parse_args()
    if args.yardsticks:
        print(yardsticks())
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = [c for c in CASES if args.case is None or c.name in args.case]
    rows = [measure(case) for case in cases]
    print(table(rows))
    if args.case is None or CP_CASE.name in args.case:
        for cp in measure_cp(2):
            rows.append(cp)
            print(
                f"| {cp['case']} (measured from nothing) | {cp['measured'] / 2**20:.1f} MiB | "
                f"{cp['predicted'] / 2**20:.1f} MiB | {cp['predicted'] / cp['measured']:.2f} | | | | {cp['moment']} |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
