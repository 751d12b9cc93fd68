"""What masks save: packed rows and windows against the same row as one causal sequence, on a CPU gloo group.

One run spawns ``P`` gloo processes. For each case every rank runs ``--warmup`` + ``--iters`` forward+backward
passes of :func:`mesh_cp.mesh_attn_func` on seeded random shards of one row of ``--seq`` tokens, with the case's
:class:`mesh_cp.AttentionMask`. The parent prints, per case, what the plan computes (blocks computed, of which
masked, and blocks skipped, summed over ranks; query-key pairs as a share of the causal row's; the per-rank compute
imbalance, :func:`mesh_cp.sim.compute_imbalance`) and the median
forward+backward time of the slowest rank, as a share of the causal row's.

Cases: the causal row; packed rows whose document lengths are drawn from a long-tailed mix (most documents
short, a few longer than a shard) of two means; windows smaller than a chunk.

    .venv/bin/python scripts/bench_masks.py --world 4 --tile 2x2 --seq 16384 --iters 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time

import torch

import mesh_cp
from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, make_plan
from mesh_cp.sim import compute_imbalance
from mesh_cp.testing import spawn_gloo

TIMEOUT = datetime.timedelta(minutes=10)


def packed_lengths(seq: int, mean: int, seed: int) -> list[int]:
    """Document lengths filling ``seq`` tokens: log-normal around ``mean`` (most short, a long tail)."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < seq:
        lengths.append(max(1, min(seq - sum(lengths), int(rng.lognormvariate(0, 1.2) * mean / 2.05))))
    return lengths


def cases(seq: int, seed: int) -> dict[str, AttentionMask | None]:
    return {
        "causal row (baseline)": None,
        "packed, mean document 2048": AttentionMask.from_lengths([packed_lengths(seq, 2048, seed)]),
        "packed, mean document 512": AttentionMask.from_lengths([packed_lengths(seq, 512, seed)]),
        "window 1024": AttentionMask(window=1024),
        "window 256": AttentionMask(window=256),
    }


def plan_counts(args: argparse.Namespace, mask: AttentionMask | None) -> dict[str, float]:
    a, b = (int(x) for x in args.tile.split("x"))
    shape = AttentionShape(
        batch=1, seq_local=args.seq // args.world, heads=args.heads, kv_heads=args.heads, head_dim=64, itemsize=4
    )
    plan = make_plan(Tiling(world=args.world, a=a, b=b), shape, causal=True, layout="zigzag", mask=mask)
    blocks = [w for r in range(args.world) for w in plan.blocks(r)]
    return {
        "blocks": len(blocks),
        "masked": sum(w.kind is MaskKind.MASKED for w in blocks),
        "skipped": args.world * args.world - len(blocks),  # a x b blocks per rank, every rank
        "pairs": sum(plan.pairs(r) for r in range(args.world)),
        "imbalance": compute_imbalance(plan),
    }


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    import torch.distributed as dist

    torch.manual_seed(args.seed)
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=args.tile)
    gen = torch.Generator().manual_seed(args.seed)
    full = [torch.randn(1, args.seq, args.heads, 64, generator=gen) for _ in range(4)]
    local = [mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag") for t in full]
    times: dict[str, list[float]] = {}
    for name, mask in cases(args.seq, args.seed).items():
        q, k, v = (t.clone().requires_grad_() for t in local[:3])
        for i in range(args.warmup + args.iters):
            dist.barrier()
            start = time.perf_counter()
            out = mesh_cp.mesh_attn_func(q, k, v, mesh=mesh, causal=True, mask=mask, kernel=args.kernel)
            out.backward(local[3])
            if i >= args.warmup:
                times.setdefault(name, []).append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tile", default="2x2")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--kernel", default="cpu_flash")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    per_rank = spawn_gloo(worker, args.world, args, timeout=TIMEOUT)
    baseline = None
    rows = []
    print(f"P={args.world} tile {args.tile} seq {args.seq} heads {args.heads} dim 64 fp32 kernel {args.kernel}")
    print(f"torch {torch.__version__}, {platform.machine()}, medians of {args.iters} after {args.warmup} warm-up")
    print(
        f"{'case':<30}{'blocks':>8}{'masked':>8}{'skipped':>9}{'pairs':>9}{'imbalance':>11}{'time ms':>10}{'time':>8}"
    )
    for name, mask in cases(args.seq, args.seed).items():
        counts = plan_counts(args, mask)
        seconds = max(statistics.median(r[name]) for r in per_rank)
        if baseline is None:
            baseline = (counts["pairs"], seconds)
        pairs, time_share = counts["pairs"] / baseline[0], seconds / baseline[1]
        rows.append({"case": name, **counts, "pairs share": pairs, "seconds": seconds, "time share": time_share})
        line = f"{name:<30}{counts['blocks']:>8}{counts['masked']:>8}{counts['skipped']:>9}"
        print(line + f"{pairs:>9.1%}{counts['imbalance']:>11.2f}{seconds * 1e3:>10.0f}{time_share:>8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
