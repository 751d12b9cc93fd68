"""Long-context fine-tuning of a causal LM with Mesh-Attention context parallelism, under ``accelerate launch``.

On CPU (4 gloo processes, 2x2 mesh, 8192-token sequences)::

    ACCELERATE_USE_CPU=true .venv/bin/accelerate launch --config_file configs/accelerate_mesh_cp.yaml \\
        examples/accelerate/finetune.py --cp 4 --tile 2x2

On GPUs (NCCL), the same config without ``ACCELERATE_USE_CPU``, one process per GPU::

    accelerate launch --config_file configs/accelerate_mesh_cp.yaml --num_processes 8 \\
        examples/accelerate/finetune.py --cp 8 --tile 2x4

accelerate needs no adapter of its own: ``accelerate launch`` starts the processes and the gloo/NCCL group
and ``Accelerator.autocast`` does mixed precision; mesh_cp's public API and its Hugging Face adapter do the
rest: the DP x CP layout (:class:`mesh_cp.DataContextParallel`), the sharded batches
(:func:`mesh_cp.shard_batch`), the loss (:func:`mesh_cp.causal_lm_loss`) and the model's ``mesh_cp``
attention (:func:`mesh_cp.integrations.hf.attach`), and torch's ``DistributedDataParallel`` over DP x CP, its
gradients summed over CP and averaged over DP (:meth:`mesh_cp.DataContextParallel.data_parallel`). The CP sizes
may instead come from the accelerate config file's ``parallelism_config`` block (``hf.parallel_from_accelerate``,
docs/accelerate.md).

Each process binds GPU ``LOCAL_RANK`` before accelerate makes the NCCL group; the model, the reference
and each step's batch shard live on ``accelerator.device``, the token sequences on the host.

The processes form DP x CP replicas (``--cp`` consecutive ranks per replica, tiled ``--tile``); each
replica trains on its own sequences, every rank of a replica holds a zig-zag shard of them. ``--head-parallel u``
(default 1; the former ``--cp-heads`` is refused, naming it) runs the head-parallel x mesh hybrid: groups of ``u``
consecutive ranks exchange heads and ``--tile`` tiles the ``--cp / u`` ranks holding the same heads (``--cp 8
--head-parallel 2 --tile 2x2``). The text
is the Python standard library's source and the tokenizer a BPE trained on it (no downloads); data, model
and options are shared with the DeepSpeed example (``examples/common.py``). ``--reference`` also trains,
on rank 0, an unsharded copy with stock SDPA attention on the same global batches and prints both loss
curves side by side. ``--checkpoint-dir`` saves every ``--save-every`` steps and resumes from the latest
checkpoint there.

The last ``--eval-seqs`` sequences (default 2) are held out of training; after it the model is evaluated on them
under CP (the mean over the sequences of their token-mean loss: each replica evaluates every ``dp_size``-th sequence,
each rank's loss is its share, and one all-reduce sums them), printed as ``eval: ...`` with, under ``--reference``,
the unsharded reference's loss on the same sequences beside it.

Rank 0 ends its output with one JSON line::

    {"example": "accelerate", "world": 4, "device": "cpu", "layout": "DP(1) x CP(2x2) ...", "steps": 30,
     "first_step": 1, "losses": [...], "reference_losses": [...] | null, "resumed_from": null | step,
     "checkpoint": null | path, "tokens_per_step": 8192, "tokens_per_s": median,
     "attention_bytes_per_step": {"q": bytes, "kv": bytes} | null, "eval_sequences": 2, "eval_loss": loss,
     "reference_eval_loss": loss | null}

``losses[i]`` is the loss of step ``first_step + i`` (steps count from 1; a resumed run starts after
``resumed_from``); ``attention_bytes_per_step`` is what rank 0 sends in one step in its Q- and KV-groups.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root: examples/ is not installed

import torch
import torch.distributed as dist

import mesh_cp
from examples.common import (
    add_example_arguments,
    bind_local_device,
    build_model,
    example_data,
    print_result,
    reference_step,
    replica_batch,
)
from mesh_cp.core import most_square_tile
from mesh_cp.integrations import hf
from mesh_cp.testing import gloo_exit_workaround


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--cp", type=int, default=None, help="ranks per CP group (default: all processes)")
    p.add_argument(
        "--tile", default=None, help="mesh tile AxB with A*B = --cp / --head-parallel (default: the most square)"
    )
    p.add_argument(
        "--head-parallel",
        type=int,
        default=1,
        help="head-parallel ranks per CP group (the head-parallel x mesh hybrid: groups of this many consecutive ranks "
        "exchange heads by all-to-all, --tile tiles the rest; must divide --cp and --heads)",
    )
    p.add_argument("--cp-heads", dest="renamed_cp_heads", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help="sequences per DP replica and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--eval-seqs", type=int, default=2, help="sequences held out of training, evaluated after it")
    add_example_arguments(p, steps=30)
    args = p.parse_args(argv)
    if hasattr(args, "renamed_cp_heads"):
        p.error("--cp-heads was renamed --head-parallel (the head-parallel degree u)")
    return args


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator

    args = parse_args(argv)
    gloo_exit_workaround()  # before accelerate makes the process group
    bind_local_device()  # on GPUs: this rank's GPU before accelerate makes the NCCL group
    accelerator = Accelerator()
    if not dist.is_initialized():
        raise RuntimeError("run under `accelerate launch` with several processes (see the module docstring)")
    result = train(args, accelerator)
    dist.barrier()
    dist.destroy_process_group()
    if result is not None:
        print_result("accelerate", **result)


def train(args: argparse.Namespace, accelerator) -> dict | None:
    """Build the layout, data and model, then fine-tune on ``accelerator.device`` (see the module docstring).

    The model (and the reference) live on ``accelerator.device``; the token sequences stay on the host and
    each step copies only this rank's shard there (``mesh_cp.shard_batch(..., device=...)``). Returns, on rank 0,
    the fields of the result line (the module docstring), else ``None``."""
    from tqdm import tqdm

    device = accelerator.device
    world = accelerator.num_processes
    cp = args.cp or world
    u = args.head_parallel
    if u < 1 or cp % u:
        raise ValueError(f"--head-parallel {u} must divide --cp {cp} (the ranks of each CP group)")
    tile = args.tile or "x".join(map(str, most_square_tile(cp // u)))
    layout = mesh_cp.DataContextParallel.create(dist.group.WORLD, cp_size=cp, tile=tile, head_parallel=u)
    main_rank = accelerator.is_main_process
    if main_rank:
        print(f"{world} processes on {device.type}: {layout}")

    tokenizer, sequences = example_data(args)
    if not 1 <= args.eval_seqs < len(sequences):
        raise ValueError(f"--eval-seqs {args.eval_seqs} must be >= 1 and leave training some of the {len(sequences)}")
    sequences, held_out = sequences[: -args.eval_seqs], sequences[-args.eval_seqs :]
    model = build_model(args, len(tokenizer), tokenizer.pad_token_id).to(device)
    reference = copy.deepcopy(model) if args.reference and main_rank else None
    hf.attach(model, layout.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None

    start, ckpt = 0, None
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt_dir is not None and (ckpt := latest_checkpoint(ckpt_dir)) is not None:
        # On the host: load_state_dict copies into the parameters on the device, the optimizers move their state.
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if reference is not None and "reference" in state:
            reference.load_state_dict(state["reference"])
            ref_optimizer.load_state_dict(state["reference_optimizer"])
        start = state["step"]
        if main_rank:
            print(f"resumed from {ckpt} at step {start}")
    # torch DDP over DP x CP, summing over CP and averaging over DP: each bucket's all-reduce starts during backward;
    # forward and backward go through it, the checkpoints and the evaluation use the model itself
    ddp = layout.data_parallel(model)

    tokens_per_step = args.batch * layout.dp_size * args.seq_len
    rates: list[float] = []
    losses: list[float] = []
    ref_losses: list[float] = []
    sent = None  # bytes this rank sends in one step, counted on the first step
    bar = tqdm(range(start, args.steps), disable=not main_rank, desc="fine-tuning", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        sequences_of_replica = replica_batch(sequences, step, layout.dp_rank, layout.dp_size, args.batch)
        batch = mesh_cp.shard_batch(sequences_of_replica, mesh=layout.mesh, device=device)
        counter = mesh_cp.CommCounter() if sent is None else contextlib.nullcontext()
        with counter, accelerator.autocast():
            logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            loss = mesh_cp.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
            loss.backward()
        if sent is None:
            sent = counter.bytes_by_role(layout.mesh)
        optimizer.step()  # the gradients DDP left: summed over CP, averaged over DP
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over CP of the shares, summed over replicas ...
        total /= layout.dp_size  # ... then averaged over them
        loss_value = total.item()  # host sync: printed
        seconds = time.perf_counter() - t0
        rates.append(tokens_per_step / seconds)
        losses.append(loss_value)
        postfix = {"loss": f"{loss_value:.4f}", "tok/s": f"{tokens_per_step / seconds:,.0f}", "seq": args.seq_len}
        if reference is not None:
            ref_loss = reference_step(reference, ref_optimizer, sequences, step, layout.dp_size, args.batch)
            ref_losses.append(ref_loss)
            postfix["reference"] = f"{ref_loss:.4f}"
            bar.write(f"step {step + 1:3d}  mesh_cp loss {loss_value:.6f}  reference loss {ref_loss:.6f}")
        bar.set_postfix(postfix)
        if ckpt_dir is not None and (step + 1) % args.save_every == 0:
            save(ckpt_dir, step + 1, model, optimizer, reference, ref_optimizer, main_rank)
    eval_loss, ref_eval_loss = evaluate(model, reference, held_out, layout, accelerator)
    if not main_rank:
        return None
    reference_text = f"  reference loss {ref_eval_loss:.6f}" if reference is not None else ""
    print(f"eval: {len(held_out)} held-out sequences, mesh_cp loss {eval_loss:.6f}{reference_text}")
    if rates:
        attention_bytes = sent.get("q", 0) + sent.get("kv", 0)
        print(
            f"done: {args.steps} steps, final loss {losses[-1]:.4f}; median {statistics.median(rates):,.0f} tokens/s; "
            f"attention traffic {attention_bytes:,d} bytes per rank per step (rank 0; Q-group {sent.get('q', 0):,d}, "
            f"KV-group {sent.get('kv', 0):,d})"
        )
    return {
        "world": world,
        "device": device.type,
        "layout": str(layout),
        "steps": args.steps,
        "first_step": start + 1,
        "losses": losses,
        "reference_losses": ref_losses if reference is not None else None,
        "resumed_from": start if ckpt is not None else None,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": statistics.median(rates) if rates else None,
        "attention_bytes_per_step": {"q": sent.get("q", 0), "kv": sent.get("kv", 0)} if sent is not None else None,
        "eval_sequences": len(held_out),
        "eval_loss": eval_loss,
        "reference_eval_loss": ref_eval_loss,
    }


@torch.no_grad()
def evaluate(model, reference, held_out: torch.Tensor, layout, accelerator) -> tuple[float, float | None]:
    """The mean over ``held_out`` of each sequence's token-mean loss, under CP (collective): replica ``r`` evaluates
    sequences ``r, r + dp_size, ...``, each rank's loss is its share of its sequence's loss, so the sum over all ranks
    is the sum over the sequences (a CP group's sequence counts once). Beside it, with ``reference`` (rank 0), the
    unsharded reference's loss on the same sequences."""
    device = accelerator.device
    total = torch.zeros((), device=device)
    training = model.training
    model.eval()
    for i in range(layout.dp_rank, len(held_out), layout.dp_size):
        batch = mesh_cp.shard_batch(held_out[i : i + 1], mesh=layout.mesh, device=device)
        with accelerator.autocast():
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            total += mesh_cp.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    model.train(training)
    dist.all_reduce(total)
    loss = total.item() / len(held_out)  # host sync: once, after training
    if reference is None:
        return loss, None
    ref = [reference(input_ids=ids, labels=ids).loss for ids in held_out.to(device)[:, None]]
    return loss, torch.stack(ref).mean().item()


def save(directory: Path, step: int, model, optimizer, reference, ref_optimizer, main_rank: bool) -> None:
    """Rank 0 writes the (replicated) model and optimizer state; every rank waits for it."""
    if main_rank:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if reference is not None:
            state |= {"reference": reference.state_dict(), "reference_optimizer": ref_optimizer.state_dict()}
        torch.save(state, directory / f"step_{step}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
