"""Per-rank time of a hybrid model's mixer layer under mesh_cp against its bound: the layer forward + backward over the
whole sequence in one process, divided by P (what a rank would take if the work split perfectly and moved nothing).

Each of P gloo processes (one thread each, P <= the cores) runs the layer head-parallel on its shard
(Note [Head-parallel mixers]); the reference runs in the same processes, one thread, before. Prints one row per
layer kind: the single-process time, the slowest rank's time, and bound / time.

    .venv/bin/python scripts/bench_mixers.py --world 2 --seq 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mesh_cp  # noqa: E402
from mesh_cp.testing import spawn_gloo  # noqa: E402

WIDTH = 256


def configs() -> dict:
    import transformers as tf

    common = {
        "vocab_size": 64,
        "hidden_size": WIDTH,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    return {
        "Gated DeltaNet (qwen3_next)": tf.Qwen3NextConfig(
            **common,
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            num_experts=0,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        ),
        "Mamba 2 (bamba)": tf.BambaConfig(
            **common,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=2,
            mamba_d_state=64,
            mamba_chunk_size=64,
        ),
    }


def _mixer(model):
    return next(m for m in model.modules() if type(m).__name__ in ("Qwen3NextGatedDeltaNet", "BambaMixer"))


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def worker(rank: int, world: int, seq: int, repeats: int) -> dict:
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    out = {}
    for name, config in configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        whole = torch.randn(1, seq, WIDTH, requires_grad=True)
        layer = _mixer(model)

        def single():
            layer(whole).sum().backward()

        reference = _time(single, repeats)
        attached = hf.attach(copy.deepcopy(model), mesh)
        mixer = _mixer(attached)
        local = mesh_cp.shard_sequence(whole.detach(), mesh=mesh, dim=1, layout="zigzag").requires_grad_()

        def sharded():
            mixer(local).sum().backward()

        dist.barrier()
        mine = _time(sharded, repeats)
        slowest = torch.tensor(mine)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = {"single": reference, "rank": slowest.item(), "bound_fraction": reference / world / slowest.item()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = spawn_gloo(worker, args.world, args.seq, args.repeats)[0]
    print(
        f"P = {args.world}, sequence {args.seq}, width {WIDTH}, fp32, one thread per rank, forward + backward, medians"
    )
    print("| mixer layer | one process, whole sequence | slowest rank | bound (one process / P) / rank |")
    print("|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['single'] * 1e3:.0f} ms | {r['rank'] * 1e3:.0f} ms | {r['bound_fraction']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
