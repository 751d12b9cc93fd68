"""Traffic per rank at cluster scale (P = 64 ... 256), traced from the real runtime on a fake process group.

torch's ``fake`` backend (registered by importing ``FakeStore`` from
``torch.testing._internal.distributed.fake_pg``) lets one process be one rank of a world of any
size: collectives and point-to-point ops return at once and move no data, but they go through the
dispatcher with their real tensors, so :class:`mesh_cp.CommCounter` counts exactly the bytes the
rank would send. Each traced rank runs the real ``mesh_attn_func`` forward and backward (on
meaningless values, since nothing arrives) for every tile of ``P`` with the chosen schedule, and the
traced bytes are compared with ``AttentionPlan.bytes_sent``. At P <= 16 the same plan is checked
against real gloo ranks by the test suite (tests/runtime/test_exactness.py) and by
scripts/bench_attention.py, so plan, trace and runtime agree.

The mesh is built directly from ``new_group`` calls: ``CPMesh.create``'s check that every rank asked
for the same tile is a collective whose answer the fake backend cannot deliver.

Example::

    .venv/bin/python scripts/trace_scale.py --worlds 64 128 256 --json results/trace_scale.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mesh_cp
from mesh_cp.core import AttentionShape, Tiling, factorizations, make_plan

PAPER = "Mesh-Attention paper, 256 GPUs: traffic -79.0% average, -85.4% best vs Ring-Attention"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 128, 256], help="CP group sizes P to trace")
    p.add_argument("--ranks", type=int, nargs="+", default=[0], help="ranks to trace in every world")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2], help="K/V head counts (8 = MHA at 8 heads)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension (bytes scale linearly with it)")
    p.add_argument("--seq-local", type=int, default=8, help="tokens per rank (even; bytes scale linearly)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of q, k, v")
    p.add_argument("--schedule", default="overlap", choices=["overlap", "collective"], help="mesh_attn_func schedule")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def fake_mesh(world: int, rank: int, tiling: Tiling) -> mesh_cp.CPMesh:
    """The CP mesh of ``rank`` in a fake world (every group is created, as ``new_group`` requires)."""
    q_groups = {members: dist.new_group(list(members)) for members in tiling.q_groups()}
    kv_groups = {members: dist.new_group(list(members)) for members in tiling.kv_groups()}
    return mesh_cp.CPMesh(
        group=dist.group.WORLD,
        q_group=q_groups[tiling.q_group(rank)],
        kv_group=kv_groups[tiling.kv_group(rank)],
        tiling=tiling,
        rank=rank,
        global_ranks=tuple(range(world)),
    )


def trace_rank(world: int, rank: int, shape: AttentionShape, dtype: torch.dtype, schedule: str) -> list[dict[str, Any]]:
    """Bytes ``rank`` sends per phase and group, traced and planned, for every tile of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        rows = []
        for a, b in factorizations(world):
            tiling = Tiling(world=world, a=a, b=b)
            mesh = fake_mesh(world, rank, tiling)
            q = torch.randn(shape.batch, shape.seq_local, shape.heads, shape.head_dim, dtype=dtype, requires_grad=True)
            k, v = (
                torch.randn(
                    shape.batch, shape.seq_local, shape.kv_heads, shape.head_dim, dtype=dtype, requires_grad=True
                )
                for _ in range(2)
            )
            counters = {"forward": mesh_cp.CommCounter(), "backward": mesh_cp.CommCounter()}
            with counters["forward"]:
                out = mesh_cp.mesh_attn_func(q, k, v, mesh=mesh, causal=True, schedule=schedule)
            with counters["backward"]:
                out.backward(torch.ones_like(out))
            plan = make_plan(tiling, shape, causal=True, layout="zigzag", schedule=schedule)
            rows.append(
                {
                    "tile": str(tiling),
                    "traced": {ph: counters[ph].bytes_by_role(mesh) for ph in counters},
                    "planned": {ph: {g: plan.bytes_sent(ph, g) for g in ("q", "kv")} for ph in counters},
                }
            )
        return rows
    finally:
        dist.destroy_process_group()


def summarize(world: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals per tile, the agreement with the plan, and the reduction against the ring (1 x P)."""
    for row in rows:
        traced = row["traced"]
        row["total"] = sum(sum(by_role.values()) for by_role in traced.values())
        row["matches_plan"] = all(
            {g: traced[ph].get(g, 0) for g in ("q", "kv")} == row["planned"][ph] and set(traced[ph]) <= {"q", "kv"}
            for ph in traced
        )
    ring = next(r for r in rows if r["tile"] == f"1x{world}")
    for row in rows:
        row["vs_ring"] = row["total"] / ring["total"] - 1
    best = min(rows, key=lambda r: r["total"])
    return {"world": world, "rows": rows, "best": best["tile"], "best_vs_ring": best["vs_ring"]}


def print_world(title: str, summary: dict[str, Any]) -> None:
    print(f"\n-- {title} --")
    print(f"{'tile':>8} {'traced fwd+bwd':>16} {'= plan':>7} {'vs ring':>9}")
    for row in summary["rows"]:
        print(
            f"{row['tile']:>8} {row['total']:>16,d} {'yes' if row['matches_plan'] else 'NO':>7} "
            f"{100 * row['vs_ring']:>+8.1f}%"
        )
    print(f"best tile {summary['best']}: {100 * summary['best_vs_ring']:+.1f}% traffic vs ring 1x{summary['world']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    results = []
    for kv_heads in args.kv_heads:
        shape = AttentionShape(
            batch=1,
            seq_local=args.seq_local,
            heads=args.heads,
            kv_heads=kv_heads,
            head_dim=args.head_dim,
            itemsize=torch.tensor([], dtype=dtype).element_size(),
        )
        for world in args.worlds:
            for rank in args.ranks:
                summary = summarize(world, trace_rank(world, rank, shape, dtype, args.schedule))
                summary |= {"rank": rank, "heads": args.heads, "kv_heads": kv_heads, "dtype": args.dtype}
                print_world(f"P={world} rank {rank}, {args.heads} heads / {kv_heads} KV heads, {args.dtype}", summary)
                results.append(summary)
    print(f"\n{PAPER}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"paper": PAPER, "schedule": args.schedule, "results": results}, indent=2)
        )
    return 0 if all(r["matches_plan"] for s in results for r in s["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
