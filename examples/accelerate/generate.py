"""Generate from a long prompt with the K/V cache sharded over the CP group: prefill with Mesh-Attention, decode
with Tree Attention (``mesh_cp.integrations.hf.generate``).

On CPU (4 gloo processes, a 16,384-token prompt from the standard library's source, 32 new tokens)::

    ACCELERATE_USE_CPU=true .venv/bin/accelerate launch --config_file configs/accelerate_mesh_cp.yaml \\
        examples/accelerate/generate.py --checkpoint /tmp/ckpt/step_30.pt

``--checkpoint`` loads the model of ``examples/accelerate/finetune.py``'s ``--checkpoint-dir`` (same model
options); without it the weights are random (seeded). The prompt is the first ``--prompt-tokens`` tokens of the
held-out end of the corpus; every rank holds ``1 / CP`` of its K/V cache. A progress bar on rank 0 counts the new
tokens; ``--do-sample`` samples (one seed on every rank). ``--check`` also generates on rank 0 alone with stock
SDPA attention and compares the logits of every step and the tokens (a prompt that fits one process).

Rank 0 ends its output with one JSON line::

    {"example": "generate", "world": 4, "device": "cpu", "layout": "...", "prompt_tokens": 16384,
     "new_tokens": [...], "text": "...", "prefill_s": ..., "decode_tokens_per_s": ..., "kv_bytes_per_rank": ...,
     "reference_match": null | true | false, "max_logit_diff": null | float}
"""

from __future__ import annotations

import argparse
import copy
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
    local_corpus,
    print_result,
    train_tokenizer,
)
from mesh_cp.core import most_square_tile
from mesh_cp.integrations import hf
from mesh_cp.integrations.hf.compat import cache_keyword
from mesh_cp.testing import gloo_exit_workaround


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tile", default=None, help="mesh tile AxB of the world (default: the most square)")
    p.add_argument("--prompt-tokens", type=int, default=16384, help="tokens of the prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--checkpoint", default=None, help="a step_N.pt of examples/accelerate/finetune.py to load")
    p.add_argument("--do-sample", action="store_true", help="sample (temperature 1) instead of greedy search")
    p.add_argument("--check", action="store_true", help="compare with generation on rank 0 alone (stock SDPA)")
    add_example_arguments(p, steps=0)
    return p.parse_args(argv)


class ProgressStreamer:
    """A ``generate`` streamer that advances a tqdm bar once per new token (the first call is the prompt)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar, self.prompt_seen = tqdm(total=total, desc="generating", unit="token"), False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(1)
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def prompt_ids(args: argparse.Namespace):
    """The tokenizer and a ``(1, prompt_tokens)`` prompt: the end of the corpus (what the fine-tuning example
    holds out last)."""
    text = local_corpus(int(args.corpus_mb * 1e6))
    tokenizer = train_tokenizer(text, args.vocab)
    ids = torch.tensor(tokenizer(text)["input_ids"][-args.prompt_tokens :], dtype=torch.long)
    if ids.numel() < args.prompt_tokens:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than --prompt-tokens {args.prompt_tokens}")
    return tokenizer, ids.unsqueeze(0)


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator

    args = parse_args(argv)
    gloo_exit_workaround()  # before accelerate makes the process group
    bind_local_device()
    accelerator = Accelerator()
    if not dist.is_initialized():
        raise RuntimeError("run under `accelerate launch` with several processes (see the module docstring)")
    result = run(args, accelerator.device)
    dist.barrier()
    dist.destroy_process_group()
    if result is not None:
        print_result("generate", **result)


def run(args: argparse.Namespace, device: torch.device) -> dict | None:
    world, rank = dist.get_world_size(), dist.get_rank()
    tile = tuple(int(x) for x in args.tile.split("x")) if args.tile else most_square_tile(world)
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
    tokenizer, ids = prompt_ids(args)
    model = build_model(args, len(tokenizer), tokenizer.pad_token_id)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=False)["model"])
    model = model.to(device).eval()
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    hf.attach(model, mesh)
    options = dict(max_new_tokens=args.new_tokens, do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id)
    options |= dict(output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    ids = ids.to(device)
    torch.manual_seed(args.seed)  # the same on every rank: sampling draws the same tokens everywhere
    t0 = time.perf_counter()
    cache = hf.prefill(model, ids, mesh=mesh, max_new_tokens=args.new_tokens)
    prefill_s = time.perf_counter() - t0
    streamer = ProgressStreamer(args.new_tokens) if rank == 0 else None
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, **{cache_keyword(model): cache}, streamer=streamer, **options)
    decode_s = time.perf_counter() - t0
    kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    new = out.sequences[0, ids.shape[1] :].tolist()
    if rank != 0:
        return None
    match, diff = None, None
    if reference is not None:
        torch.manual_seed(args.seed)
        want = reference.generate(input_ids=ids, **options)
        match = want.sequences[0, ids.shape[1] :].tolist() == new
        diff = max((a - b).abs().max().item() for a, b in zip(out.logits, want.logits, strict=True))
    text = tokenizer.decode(new)
    print(f"{world} processes, {mesh}: prompt {ids.shape[1]} tokens, prefill {prefill_s:.1f} s, decode "
          f"{len(new) / decode_s:.1f} tokens/s, K/V cache {kv_bytes / 2**20:.2f} MiB on this rank")  # fmt: skip
    print(f"continuation: {text!r}")
    if match is not None:
        print(f"single-process SDPA: tokens {'identical' if match else 'DIFFER'}, largest logit difference {diff:.2e}")
    return {
        "world": world,
        "device": device.type,
        "layout": str(mesh),
        "prompt_tokens": ids.shape[1],
        "new_tokens": new,
        "text": text,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": len(new) / decode_s,
        "kv_bytes_per_rank": kv_bytes,
        "reference_match": match,
        "max_logit_diff": diff,
    }


if __name__ == "__main__":
    main()
