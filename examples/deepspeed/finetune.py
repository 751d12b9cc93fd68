"""Long-context fine-tuning with DeepSpeed (any ZeRO stage) and Mesh-Attention switched on in its config.

On CPU (4 gloo processes; the config's ``"mesh_attention"`` block asks for one CP group of 4 tiled 2x2)::

    DS_ACCELERATOR=cpu .venv/bin/deepspeed --num_gpus 4 examples/deepspeed/finetune.py \\
        --deepspeed_config configs/ds_mesh_cp_zero2.json
    .venv/bin/torchrun --nproc-per-node 4 examples/deepspeed/finetune.py \\
        --deepspeed_config configs/ds_mesh_cp_zero3.json

On GPUs (NCCL) drop ``DS_ACCELERATOR=cpu`` and start one process per GPU (``--num_gpus 8``, with ``"cp_size"``
and ``"tile"`` to match). The head-parallel x mesh hybrid is the block's ``"head_parallel"`` key (default 1; the
former ``"heads"`` is refused, naming it): with ``"cp_size": 8, "head_parallel": 2, "tile": "2x2"`` groups of 2
ranks exchange heads and the mesh tiles the other 4. The process binds GPU ``LOCAL_RANK`` before the NCCL group is
made; DeepSpeed puts the model on ``engine.device``, and the reference and each step's batch shard go there too.

:func:`mesh_cp.integrations.deepspeed.initialize` builds the DP x CP replicas from the block; each
replica trains on its own sequences, every rank of a replica holds a zig-zag shard of them. The text is
the Python standard library's source and the tokenizer a BPE trained on it (no downloads). ``--reference``
also trains, on rank 0, an unsharded copy with stock SDPA attention and ``torch.optim.AdamW`` on the same
global batches and prints both losses side by side (exact with ``"gradient_clipping": 0.0`` and the
config's ``AdamW`` with ``"torch_adam": true``). ``--checkpoint-dir`` saves through the engine every
``--save-every`` steps and resumes from the latest checkpoint there. Data, model and options are shared
with the accelerate example (``examples/common.py``).

Rank 0 ends its output with one JSON line::

    {"example": "deepspeed", "world": 4, "device": "cpu", "zero_stage": 2, "layout": "DP(1) x CP(2x2) ...",
     "steps": 20, "first_step": 1, "losses": [...], "reference_losses": [...] | null,
     "resumed_from": null | step, "checkpoint": null | path, "tokens_per_step": 8192, "tokens_per_s": median}

``losses[i]`` is the loss of step ``first_step + i`` (steps count from 1; a resumed run starts after
``resumed_from``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root: examples/ is not installed

import torch
import torch.distributed as dist

from examples.common import (
    add_example_arguments,
    build_model,
    example_data,
    print_result,
    reference_step,
    replica_batch,
)
from mesh_cp.testing import gloo_exit_workaround


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import deepspeed

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_example_arguments(p, steps=20)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return deepspeed.add_config_arguments(p).parse_args(argv)


def reference_optimizer(config: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with the hyperparameters of the config's ``AdamW``/``Adam`` optimizer."""
    opt = config.get("optimizer", {})
    if opt.get("type", "").lower() not in ("adamw", "adam"):
        raise ValueError(f"--reference compares with AdamW; the config's optimizer is {opt.get('type')!r}")
    params = {k: v for k, v in opt.get("params", {}).items() if k in ("lr", "betas", "eps", "weight_decay")}
    return torch.optim.AdamW(model.parameters(), **params)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.deepspeed_config is None:
        raise SystemExit("give --deepspeed_config, for example configs/ds_mesh_cp_zero2.json")
    gloo_exit_workaround()  # before the engine makes the process group
    result = train(args)
    dist.barrier()
    dist.destroy_process_group()
    if result is not None:
        print_result("deepspeed", **result)


def train(args: argparse.Namespace) -> dict | None:
    """Start the engine (and the process group, NCCL on GPUs, bound to ``LOCAL_RANK``'s GPU), then fine-tune
    on ``engine.device``, where DeepSpeed put the model (see the module docstring). The token sequences
    stay on the host; each step copies only this rank's shard to the engine's device. Returns, on rank 0,
    the fields of the result line (the module docstring), else ``None``."""
    import deepspeed
    from tqdm import tqdm

    from mesh_cp.integrations import deepspeed as mesh_ds

    config = deepspeed.load_ds_config(args.deepspeed_config)
    tokenizer, sequences = example_data(args)
    model = build_model(args, len(tokenizer), tokenizer.pad_token_id)
    reference = copy.deepcopy(model) if args.reference else None

    engine, _, _, _ = mesh_ds.initialize(args=args, model=model, model_parameters=model.parameters())
    cp = getattr(engine, "mesh_attention", None)
    if cp is None:
        raise SystemExit(f'{args.deepspeed_config} has no enabled "mesh_attention" block')
    layout = cp.parallel
    device = engine.device
    main_rank = dist.get_rank() == 0
    reference = reference.to(device) if main_rank and reference is not None else None
    ref_optimizer = reference_optimizer(config, reference) if reference is not None else None
    stage = engine.zero_optimization_stage()
    if main_rank:
        print(f"{dist.get_world_size()} processes on {device.type}, ZeRO stage {stage}: {layout}")

    start, resumed = 0, False
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt_dir is not None and (ckpt_dir / "latest").exists():
        _, client_state = engine.load_checkpoint(str(ckpt_dir))
        resumed = True
        start = client_state["step"]
        if reference is not None:
            state = torch.load(ckpt_dir / f"reference_{start}.pt", map_location="cpu", weights_only=False)
            reference.load_state_dict(state["model"])
            ref_optimizer.load_state_dict(state["optimizer"])
        if main_rank:
            print(f"resumed from {ckpt_dir} at step {start}")

    micro = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = micro * layout.dp_size * args.seq_len
    rates: list[float] = []
    losses: list[float] = []
    ref_losses: list[float] = []
    bar = tqdm(range(start, args.steps), disable=not main_rank, desc="fine-tuning", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        batch = cp.shard(replica_batch(sequences, step, layout.dp_rank, layout.dp_size, micro), device=device)
        logits = engine(input_ids=batch.input_ids, position_ids=batch.position_ids, mesh_cp_mask=batch.mask).logits
        loss = cp.loss(logits, batch)
        engine.backward(loss)
        engine.step()
        mean = cp.mean_loss(loss)
        seconds = time.perf_counter() - t0
        rates.append(tokens_per_step / seconds)
        losses.append(mean)
        postfix = {"loss": f"{mean:.4f}", "tok/s": f"{tokens_per_step / seconds:,.0f}", "seq": args.seq_len}
        if reference is not None:
            ref_loss = reference_step(reference, ref_optimizer, sequences, step, layout.dp_size, micro)
            ref_losses.append(ref_loss)
            postfix["reference"] = f"{ref_loss:.4f}"
            bar.write(f"step {step + 1:3d}  mesh_cp loss {mean:.6f}  reference loss {ref_loss:.6f}")
        bar.set_postfix(postfix)
        if ckpt_dir is not None and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(str(ckpt_dir), tag=f"step_{step + 1}", client_state={"step": step + 1})
            if reference is not None:
                state = {"model": reference.state_dict(), "optimizer": ref_optimizer.state_dict()}
                torch.save(state, ckpt_dir / f"reference_{step + 1}.pt")
    if not main_rank:
        return None
    if rates:
        print(f"done: {args.steps} steps, final loss {losses[-1]:.4f}; median {statistics.median(rates):,.0f} tokens/s")
    return {
        "world": dist.get_world_size(),
        "device": device.type,
        "zero_stage": stage,
        "layout": str(layout),
        "steps": args.steps,
        "first_step": start + 1,
        "losses": losses,
        "reference_losses": ref_losses if reference is not None else None,
        "resumed_from": start if resumed else None,
        "checkpoint": str(ckpt_dir) if resumed else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": statistics.median(rates) if rates else None,
    }


if __name__ == "__main__":
    main()
