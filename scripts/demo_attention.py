"""Long-context causal attention over a CP mesh of gloo ranks, checked and compared with the ring.

    python scripts/demo_attention.py                       # 4 ranks, 2x2 mesh, 16384 tokens
    python scripts/demo_attention.py --world 6 --tile 2x3 --seq 6144

Every rank holds a zig-zag shard of the sequence, runs mesh_attn_func forward and backward, and
counts the bytes it sends. Rank 0 then gathers output and gradients and checks them against the
fused single-process kernel on the whole sequence; the traffic is put next to the 1 x P ring's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import mesh_cp
from mesh_cp.core import AttentionShape, Tiling, make_plan, most_square_tile
from mesh_cp.testing import spawn_gloo

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="CP ranks to spawn (gloo)")
    parser.add_argument("--tile", default=None, help="AxB with A*B = world (default: the most square)")
    parser.add_argument("--seq", type=int, default=16384, help="global sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tol", type=float, default=1e-4, help="max abs error allowed against the reference")
    args = parser.parse_args(argv)
    if args.tile is None:
        args.tile = most_square_tile(args.world)
    args.tiling = Tiling.parse(args.tile, args.world)
    return args


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=args.tiling.shape)
    print(f"[rank {rank}] {mesh}", flush=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.seq, args.heads, args.head_dim, generator=gen)
    k, v = (torch.randn(args.batch, args.seq, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
    do = torch.randn(args.batch, args.seq, args.heads, args.head_dim, generator=gen)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag")

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    dist.barrier()
    start = time.perf_counter()
    with mesh_cp.CommCounter() as fwd_counter:
        out = mesh_cp.mesh_attn_func(*local, mesh=mesh, causal=True)
    with mesh_cp.CommCounter() as bwd_counter:
        out.backward(shard(do))
    dist.barrier()
    elapsed = time.perf_counter() - start

    def unshard(t: torch.Tensor) -> torch.Tensor:
        return mesh_cp.unshard_sequence(t.detach(), mesh=mesh, dim=1, layout="zigzag")

    gathered = [unshard(out), *(unshard(leaf.grad) for leaf in local)]
    result = {"sent": (fwd_counter.bytes_sent(), bwd_counter.bytes_sent()), "seconds": elapsed}
    if rank == 0:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in leaves), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        ref.backward(do)
        result["reference_seconds"] = time.perf_counter() - start
        expected = [ref.detach(), *(leaf.grad for leaf in leaves)]
        result["errors"] = {
            name: (got - want).abs().max().item()
            for name, got, want in zip(("out", "dq", "dk", "dv"), gathered, expected, strict=True)
        }
    dist.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    a, b = args.tiling.shape
    print(
        f"Mesh-Attention demo: causal attention over {args.seq} tokens, {args.world} gloo ranks, tile {a}x{b}, "
        f"batch {args.batch}, {args.heads} q heads / {args.kv_heads} kv heads, head_dim {args.head_dim}, fp32",
        flush=True,
    )
    results = spawn_gloo(rank_main, args.world, args, threads_per_rank=max(1, torch.get_num_threads() // args.world))

    errors = results[0]["errors"]
    ok = all(err <= args.tol for err in errors.values())
    print("\nexactness against single-process SDPA on the whole sequence (max abs error):")
    print("  " + "  ".join(f"{name} {err:.2e}" for name, err in errors.items()) + f"  -> {'OK' if ok else 'FAILED'}")
    print(
        f"time: distributed forward+backward {max(r['seconds'] for r in results):.2f} s (slowest rank), "
        f"single process {results[0]['reference_seconds']:.2f} s"
    )

    shape = AttentionShape(
        batch=args.batch,
        seq_local=args.seq // args.world,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        itemsize=torch.float32.itemsize,
    )
    mesh_plan = make_plan(args.tiling, shape, causal=True, layout="zigzag")
    ring_plan = make_plan(Tiling(world=args.world, a=1, b=args.world), shape, causal=True, layout="zigzag")
    print("\nbytes sent per rank (forward + backward):")
    for rank, res in enumerate(results):
        fwd, bwd = res["sent"]
        print(f"  rank {rank}: {a}x{b} mesh {fwd / MiB:8.2f} + {bwd / MiB:8.2f} MiB")
    planned = mesh_plan.bytes_sent("forward") + mesh_plan.bytes_sent("backward")
    ring = ring_plan.bytes_sent("forward") + ring_plan.bytes_sent("backward")
    measured_ok = all(sum(res["sent"]) == planned for res in results)
    print(
        f"  plan for the {a}x{b} mesh: {planned / MiB:.2f} MiB per rank ({'measured equals plan' if measured_ok else 'MISMATCH'})"
    )
    print(f"  plan for the 1x{args.world} ring: {ring / MiB:.2f} MiB per rank")
    print(f"  the mesh sends {100 * planned / ring:.1f}% of the ring's bytes ({100 * (planned - ring) / ring:+.1f}%)")
    if planned > ring:
        r = args.kv_heads / args.heads
        print(
            f"  (with kv_heads/heads = {r:g} the traffic-optimal a is about sqrt(r * P) = {(r * args.world) ** 0.5:.2f}: "
            f"K,V are small next to Q and O, so for this shape the ring moves less)"
        )
    return 0 if ok and measured_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
