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

With ``--hybrid`` every head-parallel x mesh layout (``head_parallel=u``, Note [Head-parallel x mesh]) is traced too,
its all-to-all bytes compared with the plan's ``bytes_sent(phase, "heads")`` and its mesh's with the Q and KV groups'. ``CommCounter``
also splits every rank's bytes by the node of the receiving rank (``--ranks-per-node`` consecutive ranks per node);
over the traced ranks, the busiest one's inter-node bytes are reported per layout, and per kind (ring, plain mesh,
USP = head-parallel with a ``1 x m`` ring, any hybrid) the layout whose busiest rank sends the fewest.

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
from mesh_cp.core import (
    AttentionShape,
    Tiling,
    factorizations,
    head_group_ranks,
    make_plan,
    mesh_group_ranks,
    valid_head_parallel,
)

PAPER = "Mesh-Attention paper, 256 GPUs: traffic -79.0% average, -85.4% best vs Ring-Attention"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 128, 256], help="CP group sizes P to trace")
    p.add_argument(
        "--ranks", type=int, nargs="+", default=[0], help="ranks to trace in every world (those >= P are skipped)"
    )
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2], help="K/V head counts (8 = MHA at 8 heads)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension (bytes scale linearly with it)")
    p.add_argument("--seq-local", type=int, default=8, help="tokens per rank (even; bytes scale linearly)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of q, k, v")
    p.add_argument("--schedule", default="overlap", choices=["overlap", "collective"], help="mesh_attn_func schedule")
    p.add_argument(
        "--hybrid", action="store_true", help="also trace every head-parallel x mesh layout (head_parallel=u)"
    )
    p.add_argument("--ranks-per-node", type=int, default=8, help="consecutive ranks per node, for inter-node bytes")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def fake_mesh(world: int, rank: int, u: int, tiling: Tiling) -> mesh_cp.CPMesh:
    """The CP mesh of ``rank`` in a fake world of ``world`` ranks: ``u`` consecutive ranks per head group, the ranks
    ``i, i + u, ...`` per mesh group, tiled ``tiling`` (Note [Head-parallel x mesh]; ``u = 1``: one mesh group of
    every rank). Every head group and every mesh group's Q- and KV-groups are created, as ``new_group`` requires of
    every rank, and a twin of the world for the call checks."""
    head_groups = {g: dist.new_group(list(head_group_ranks(world, u, g * u))) for g in range(tiling.world)}
    mine = {}
    for i in range(u):
        members = mesh_group_ranks(world, u, i)
        q_groups = {m: dist.new_group([members[r] for r in m]) for m in tiling.q_groups()}
        kv_groups = {m: dist.new_group([members[r] for r in m]) for m in tiling.kv_groups()}
        if i == rank % u:  # this rank is mesh rank rank // u of mesh group i
            mine = {"q_group": q_groups[tiling.q_group(rank // u)], "kv_group": kv_groups[tiling.kv_group(rank // u)]}
    return mesh_cp.CPMesh(
        group=dist.group.WORLD,
        tiling=tiling,
        rank=rank,
        global_ranks=tuple(range(world)),
        check_group=dist.new_group(list(range(world))),
        head_parallel=u,
        head_group=head_groups[rank // u] if u > 1 else None,
        **mine,
    )


def layouts(world: int, shape: AttentionShape, hybrid: bool) -> list[tuple[int, Tiling]]:
    """``(u, tiling)`` of every plain tile of ``world``, and with ``hybrid`` of every head-parallel split ``u > 1``
    the shape allows with every tile of its ``world / u`` mesh ranks."""
    out = [(1, Tiling(world=world, a=a, b=b)) for a, b in factorizations(world)]
    for u in valid_head_parallel(world, shape) if hybrid else ():
        out += [(u, Tiling(world=world // u, a=a, b=b)) for a, b in factorizations(world // u)] if u > 1 else []
    return out


def label(u: int, tiling: Tiling) -> str:
    return str(tiling) if u == 1 else f"u{u}:{tiling}"


def trace_rank(
    world: int, rank: int, shape: AttentionShape, dtype: torch.dtype, schedule: str, *, hybrid: bool, per_node: int
) -> list[dict[str, Any]]:
    """Bytes ``rank`` sends per phase and group (traced and planned) and per link class (traced, ``per_node``
    consecutive ranks per node), for every tile of ``world`` and, with ``hybrid``, every head-parallel layout."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        rows = []
        for u, tiling in layouts(world, shape, hybrid):
            mesh = fake_mesh(world, rank, u, tiling)
            q = torch.randn(shape.batch, shape.seq_local, shape.heads, shape.head_dim, dtype=dtype, requires_grad=True)
            kv_shape = (shape.batch, shape.seq_local, shape.kv_heads, shape.head_dim)
            k, v = (torch.randn(kv_shape, dtype=dtype, requires_grad=True) for _ in range(2))
            counters = {"forward": mesh_cp.CommCounter(), "backward": mesh_cp.CommCounter()}
            with counters["forward"]:
                out = mesh_cp.mesh_attn_func(q, k, v, mesh=mesh, causal=True, schedule=schedule)
            with counters["backward"]:
                out.backward(torch.ones_like(out))
            plan = make_plan(tiling, shape, causal=True, layout="zigzag", schedule=schedule, head_parallel=u)
            groups = ("heads", "q", "kv") if u > 1 else ("q", "kv")
            planned = {ph: {g: plan.bytes_sent(ph, g) for g in groups} for ph in counters}
            links = [c.bytes_by_link(lambda r: r // per_node) for c in counters.values()]
            rows.append(
                {
                    "tile": label(u, tiling),
                    "heads": u,
                    "a": tiling.a,
                    "traced": {ph: counters[ph].bytes_by_role(mesh) for ph in counters},
                    "planned": planned,
                    "inter": sum(x["inter"] for x in links),
                    "intra": sum(x["intra"] for x in links),
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
            {g: traced[ph].get(g, 0) for g in row["planned"][ph]} == row["planned"][ph]
            and set(traced[ph]) <= set(row["planned"][ph])
            for ph in traced
        )
    ring = next(r for r in rows if r["tile"] == f"1x{world}")
    for row in rows:
        row["vs_ring"] = row["total"] / ring["total"] - 1
    best = min(rows, key=lambda r: r["total"])
    return {"world": world, "rows": rows, "best": best["tile"], "best_vs_ring": best["vs_ring"]}


def combine(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the traced ranks of one world and shape: per layout the most bytes and the most inter-node bytes any
    traced rank sends, and per kind (ring, plain mesh, USP = head-parallel with a 1 x m ring, any hybrid) the layout
    whose busiest rank sends the fewest inter-node bytes (then the fewest bytes)."""
    worst: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for row in summary["rows"]:
            empty = {"tile": row["tile"], "heads": row["heads"], "a": row["a"], "inter": 0, "total": 0}
            seen = worst.setdefault(row["tile"], empty)
            seen["inter"], seen["total"] = max(seen["inter"], row["inter"]), max(seen["total"], row["total"])
    rows = list(worst.values())
    kinds = {
        "ring": [r for r in rows if r["tile"] == f"1x{summaries[0]['world']}"],
        "mesh": [r for r in rows if r["heads"] == 1],
        "usp": [r for r in rows if r["heads"] > 1 and r["a"] == 1],
        "hybrid": [r for r in rows if r["heads"] > 1],
    }
    first = summaries[0]
    return {
        "world": first["world"],
        "kv_heads": first["kv_heads"],
        "ranks": [s["rank"] for s in summaries],
        "layouts": rows,
        "least_inter": {kind: min(rs, key=lambda r: (r["inter"], r["total"])) for kind, rs in kinds.items() if rs},
    }


def print_combined(combined: dict[str, Any]) -> None:
    print(f"\n-- P={combined['world']}, {combined['kv_heads']} KV heads: busiest of ranks {combined['ranks']} --")
    for kind, best in combined["least_inter"].items():
        print(
            f"fewest inter-node bytes, {kind:>6}: {best['tile']:>10} {best['inter']:>14,d} (total {best['total']:,d})"
        )


def print_world(title: str, summary: dict[str, Any]) -> None:
    print(f"\n-- {title} --")
    print(f"{'tile':>10} {'traced fwd+bwd':>16} {'inter-node':>14} {'= plan':>7} {'vs ring':>9}")
    for row in summary["rows"]:
        print(
            f"{row['tile']:>10} {row['total']:>16,d} {row['inter']:>14,d} {'yes' if row['matches_plan'] else 'NO':>7} "
            f"{100 * row['vs_ring']:>+8.1f}%"
        )
    print(f"best tile {summary['best']}: {100 * summary['best_vs_ring']:+.1f}% traffic vs ring 1x{summary['world']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    results, combined = [], []
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
            summaries = []
            for rank in (r for r in args.ranks if r < world):
                options = {"hybrid": args.hybrid, "per_node": args.ranks_per_node}
                summary = summarize(world, trace_rank(world, rank, shape, dtype, args.schedule, **options))
                summary |= {"rank": rank, "heads": args.heads, "kv_heads": kv_heads, "dtype": args.dtype}
                print_world(f"P={world} rank {rank}, {args.heads} heads / {kv_heads} KV heads, {args.dtype}", summary)
                summaries.append(summary)
            combined.append(combine(summaries))
            print_combined(combined[-1])
            results += summaries
    print(f"\n{PAPER}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"paper": PAPER, "schedule": args.schedule, "results": results, "combined": combined}, indent=2)
        )
    return 0 if all(r["matches_plan"] for s in results for r in s["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
