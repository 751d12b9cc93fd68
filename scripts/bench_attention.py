"""Benchmark Mesh-Attention (an ``a x b`` tile) against Ring-Attention (``1 x P``) on a CPU gloo group.

One run spawns ``P`` gloo processes. Every rank builds two meshes on the world group, the requested
tile and the ring, and for each runs ``--warmup`` + ``--iters`` forward+backward passes of
:func:`mesh_cp.mesh_attn_func` on seeded random local shards, then one more pass under
:class:`mesh_cp.CommCounter` to count the bytes it sends. The parent prints, per mesh:

* the median forward+backward time of every rank (max and mean over ranks);
* the bytes one rank sends in forward and backward, measured, against the plan
  (``plan.bytes_sent``) and against the traffic formula (``plan.traffic_units * C * itemsize``)
  plus the lse/delta statistics (``plan.stats_bytes_sent``); any difference prints ``MISMATCH``;
* the mesh/ring byte ratio.

Then, in the parent alone (all cores, no rank competing for them), it times the compute overhead
of blocking: the fused kernel on the full sequence against the sum of the kernel calls of every
rank's blocks (the calls the collective schedule makes, without communication).

Example::

    .venv/bin/python scripts/bench_attention.py --world 4 --tile 2x2 --seq 8192 --iters 3

The exit status is 1 when a byte count does not match, 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import mesh_cp
from mesh_cp.core import AttentionPlan, AttentionShape, Tiling, check_seq_len, make_plan, most_square_tile
from mesh_cp.core.numerics import attention_delta
from mesh_cp.kernels import KERNEL_NAMES, get_kernel
from mesh_cp.testing import spawn_gloo

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PHASES: tuple[str, ...] = ("forward", "backward")
ROLES: tuple[str, ...] = ("q", "kv", "cp", "other")
# P processes share few cores, so one rank may wait in a collective for a whole iteration of the
# slowest rank; the gloo timeout must cover that.
TIMEOUT = datetime.timedelta(minutes=10)


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting; picklable, so it travels to the spawned ranks as is."""

    world: int
    tile: tuple[int, int]
    seq: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    iters: int
    warmup: int
    kernel: str
    backward: str
    schedule: str
    seed: int

    @property
    def layout(self) -> str:
        """Zig-zag for causal (balanced work), contiguous for full attention."""
        return "zigzag" if self.causal else "contiguous"

    @property
    def seq_local(self) -> int:
        return self.seq // self.world

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def ring(self) -> tuple[int, int]:
        return (1, self.world)

    def meshes(self) -> tuple[tuple[int, int], ...]:
        """Tiles to run: the requested one, then the ring (once if they are the same)."""
        return (self.tile,) if self.tile == self.ring else (self.tile, self.ring)

    def shape(self) -> AttentionShape:
        return AttentionShape(
            batch=self.batch,
            seq_local=self.seq_local,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            itemsize=self.torch_dtype.itemsize,
        )

    def plan(self, tile: tuple[int, int]) -> AttentionPlan:
        """The plan ``mesh_attn_func`` builds on every rank for ``tile``."""
        tiling = Tiling(world=self.world, a=tile[0], b=tile[1])
        return make_plan(
            tiling,
            self.shape(),
            causal=self.causal,
            layout=self.layout,
            backward=self.backward,
            schedule=self.schedule,
        )


def tile_name(tile: tuple[int, int]) -> str:
    return f"{tile[0]}x{tile[1]}"


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str | None]:
    """Parse the command line into a validated :class:`BenchConfig` and the optional JSON path."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--world", type=int, default=4, help="number of gloo ranks P")
    p.add_argument(
        "--tile", default=None, help="mesh tile AxB with A*B = P; None means the most square one (larger a on a tie)"
    )
    p.add_argument("--seq", type=int, default=8192, help="global sequence length S")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads; None means --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="causal attention (zig-zag layout) or full attention (contiguous layout)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before the timed ones")
    p.add_argument("--kernel", choices=KERNEL_NAMES, default="cpu_flash")
    p.add_argument("--backward", choices=("regather", "reuse"), default="regather")
    p.add_argument("--schedule", choices=("overlap", "collective"), default="overlap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)

    if args.world < 1:
        p.error(f"--world must be >= 1, got {args.world}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    try:
        tile = most_square_tile(args.world) if args.tile is None else Tiling.parse(args.tile, args.world).shape
        cfg = BenchConfig(
            world=args.world,
            tile=tile,
            seq=args.seq,
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
            head_dim=args.head_dim,
            causal=args.causal,
            dtype=args.dtype,
            iters=args.iters,
            warmup=args.warmup,
            kernel=args.kernel,
            backward=args.backward,
            schedule=args.schedule,
            seed=args.seed,
        )
        check_seq_len(cfg.seq, cfg.world, cfg.layout)
        for tile in cfg.meshes():
            cfg.plan(tile)  # validates heads / kv_heads / sizes
    except ValueError as exc:
        p.error(str(exc))
    return cfg, args.json


# ----------------------------------------------------------------------------------------------
# Distributed part (runs in the spawned ranks)


def local_inputs(cfg: BenchConfig, rank: int) -> tuple[torch.Tensor, ...]:
    """Seeded random ``q, k, v`` (leaves requiring grad) and ``do`` of this rank's local shape."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank)
    q_shape = (cfg.batch, cfg.seq_local, cfg.heads, cfg.head_dim)
    kv_shape = (cfg.batch, cfg.seq_local, cfg.kv_heads, cfg.head_dim)
    q, k, v = (
        torch.randn(s, generator=gen).to(cfg.torch_dtype).requires_grad_() for s in (q_shape, kv_shape, kv_shape)
    )
    do = torch.randn(q_shape, generator=gen).to(cfg.torch_dtype)
    return q, k, v, do


def bench_mesh(mesh, cfg: BenchConfig) -> dict[str, Any]:
    """Time forward+backward on ``mesh`` and count the bytes of one more iteration, on this rank."""
    import torch.distributed as dist

    q, k, v, do = local_inputs(cfg, mesh.rank)

    def forward() -> torch.Tensor:
        return mesh_cp.mesh_attn_func(
            q,
            k,
            v,
            mesh=mesh,
            causal=cfg.causal,
            layout=cfg.layout,
            kernel=cfg.kernel,
            backward=cfg.backward,
            schedule=cfg.schedule,
        )

    def clear_grads() -> None:
        q.grad = k.grad = v.grad = None

    fwd_times, total_times = [], []
    for it in range(cfg.warmup + cfg.iters):
        dist.barrier()
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        out.backward(do)
        t2 = time.perf_counter()
        clear_grads()
        if it >= cfg.warmup:
            fwd_times.append(t1 - t0)
            total_times.append(t2 - t0)

    # One counted iteration, outside the timed ones (the dispatch mode slows every op down).
    counters = {phase: mesh_cp.CommCounter() for phase in PHASES}
    dist.barrier()
    with counters["forward"]:
        out = forward()
    with counters["backward"]:
        out.backward(do)
    clear_grads()

    return {
        "fwd_s": fwd_times,
        "total_s": total_times,
        "bytes": {phase: c.bytes_sent() for phase, c in counters.items()},
        "bytes_by_role": {phase: c.bytes_by_role(mesh) for phase, c in counters.items()},
    }


def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """Everything one rank does: build each mesh on the world group and benchmark it."""
    import torch.distributed as dist

    results = {}
    for tile in cfg.meshes():
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        results[tile_name(tile)] = bench_mesh(mesh, cfg)
    return results


# ----------------------------------------------------------------------------------------------
# Single-process kernel timing (compute overhead of blocking)


def _random(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def time_kernel_call(kernel, q, k, v, do, *, causal: bool, scale: float) -> tuple[float, float]:
    """Seconds of one ``kernel.forward`` and one ``kernel.backward`` (delta is computed untimed).

    ``lse`` and ``delta`` reach the backward as views of one stacked ``(2, B, H, rows)`` buffer (the
    schedule passes views of its gathered ``(a, 2, B, H, L)`` statistics).
    """
    t0 = time.perf_counter()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    t1 = time.perf_counter()
    stats = torch.stack((lse.to(torch.float32), attention_delta(do, out)))
    t2 = time.perf_counter()
    kernel.backward(do, q, k, v, stats[0], stats[1], causal=causal, scale=scale)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def time_blocking(cfg: BenchConfig, threads: int) -> dict[str, Any]:
    """Full-sequence kernel vs. the sum of every rank's block kernels, single process, ``threads`` threads.

    The blocks are replayed from ``plan.blocks(g)`` of the requested tile for every rank ``g``, on
    slices of tensors of the local chunk size, exactly as the schedule slices its gathered chunks.
    Every tile covers the same ``P x P`` blocks, so the sum is the same for the ring; the per-rank
    sums (the critical path of kernel time) are reported for both.
    """
    torch.set_num_threads(threads)
    kernel = get_kernel(cfg.kernel)
    scale = cfg.head_dim**-0.5
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    dt = cfg.torch_dtype
    b, s, h, hkv, d, L = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.seq_local
    full = [_random(shape, gen, dt) for shape in ((b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d))]
    local = [_random(shape, gen, dt) for shape in ((b, L, h, d), (b, L, hkv, d), (b, L, hkv, d), (b, L, h, d))]
    plan = cfg.plan(cfg.tile)
    ring_plan = cfg.plan(cfg.ring)

    def run_full() -> tuple[float, float]:
        return time_kernel_call(kernel, *full, causal=cfg.causal, scale=scale)

    def run_blocks() -> dict[tuple[int, int], tuple[float, float]]:
        q, k, v, do = local
        times = {}
        for g in range(cfg.world):
            for w in plan.blocks(g):
                (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
                times[(w.x, w.y)] = time_kernel_call(
                    kernel, q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], do[:, q0:q1], causal=w.causal, scale=scale
                )
        return times

    for _ in range(cfg.warmup):
        run_full()
        run_blocks()
    full_runs = [run_full() for _ in range(cfg.iters)]
    block_runs = [run_blocks() for _ in range(cfg.iters)]

    def per_rank(p: AttentionPlan, run: dict[tuple[int, int], tuple[float, float]]) -> list[float]:
        return [sum(sum(run[(w.x, w.y)]) for w in p.blocks(g)) for g in range(cfg.world)]

    ring_keys = {(w.x, w.y) for g in range(cfg.world) for w in ring_plan.blocks(g)}
    assert ring_keys == set(block_runs[0]), "the tile and the ring should cover the same blocks"
    full_pairs = cfg.batch * cfg.heads * (s * (s + 1) // 2 if cfg.causal else s * s)
    return {
        "threads": threads,
        "full_fwd_s": statistics.median(f for f, _ in full_runs),
        "full_bwd_s": statistics.median(bw for _, bw in full_runs),
        "full_s": statistics.median(f + bw for f, bw in full_runs),
        "blocks_fwd_s": statistics.median(sum(f for f, _ in run.values()) for run in block_runs),
        "blocks_bwd_s": statistics.median(sum(bw for _, bw in run.values()) for run in block_runs),
        "blocks_s": statistics.median(sum(f + bw for f, bw in run.values()) for run in block_runs),
        "block_calls": len(block_runs[0]),
        "per_rank_s": {
            tile_name(t): [
                statistics.median(col) for col in zip(*(per_rank(p, run) for run in block_runs), strict=True)
            ]
            for t, p in ((cfg.tile, plan), (cfg.ring, ring_plan))
        },
        "full_pairs": full_pairs,
        "block_pairs": cfg.batch * cfg.heads * sum(plan.pairs(g) for g in range(cfg.world)),
    }


# ----------------------------------------------------------------------------------------------
# Report


def fmt_bytes(n: float) -> str:
    """Exact bytes with separators, and MiB."""
    exact = f"{int(n):,}" if float(n).is_integer() else f"{n:,.2f}"
    return f"{exact} ({n / 2**20:.2f} MiB)"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f} ms"


def summarize_mesh(cfg: BenchConfig, tile: tuple[int, int], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Times and byte checks of one mesh, from every rank's results and the plan."""
    plan = cfg.plan(tile)
    shape = plan.shape
    C, item = shape.chunk_elems, shape.itemsize
    formula_exact = shape.itemsize == shape.acc_itemsize  # else o/dq/dk/dv travel wider than itemsize
    medians = [statistics.median(r["total_s"]) for r in per_rank]
    fwd_medians = [statistics.median(r["fwd_s"]) for r in per_rank]
    phases = {}
    for phase in PHASES:
        measured = [r["bytes"][phase] for r in per_rank]
        formula = plan.traffic_units(phase) * C * item
        stats = plan.stats_bytes_sent(phase)
        planned = plan.bytes_sent(phase)
        by_role_plan = {"q": plan.bytes_sent(phase, "q"), "kv": plan.bytes_sent(phase, "kv"), "cp": 0, "other": 0}
        by_role_measured = [{role: r["bytes_by_role"][phase].get(role, 0) for role in ROLES} for r in per_rank]
        phases[phase] = {
            "measured_per_rank": measured,
            "plan": planned,
            "formula": formula,
            "stats": stats,
            "by_role_measured_per_rank": by_role_measured,
            "by_role_plan": by_role_plan,
            "ok_plan": all(m == planned for m in measured) and all(br == by_role_plan for br in by_role_measured),
            "ok_formula": all(math.isclose(m, formula + stats, rel_tol=0, abs_tol=0.5) for m in measured),
        }
    total = {key: phases["forward"][key] + phases["backward"][key] for key in ("plan", "formula", "stats")}
    total["measured_per_rank"] = [
        f + b
        for f, b in zip(phases["forward"]["measured_per_rank"], phases["backward"]["measured_per_rank"], strict=True)
    ]
    total["ok_plan"] = phases["forward"]["ok_plan"] and phases["backward"]["ok_plan"]
    total["ok_formula"] = phases["forward"]["ok_formula"] and phases["backward"]["ok_formula"]
    phases["total"] = total
    return {
        "tile": tile_name(tile),
        "time_median_per_rank_s": medians,
        "fwd_median_per_rank_s": fwd_medians,
        "time_max_s": max(medians),
        "time_mean_s": statistics.fmean(medians),
        "fwd_max_s": max(fwd_medians),
        "bytes": phases,
        "formula_exact": formula_exact,
        "traffic_units": {phase: plan.traffic_units(phase) for phase in PHASES},
        "C": C,
    }


def print_config(cfg: BenchConfig, kernel_threads: int) -> None:
    shape = cfg.shape()
    print("=" * 100)
    print("mesh_cp attention benchmark: Mesh-Attention tile vs Ring-Attention, gloo on CPU")
    print("=" * 100)
    print(
        f"P={cfg.world}  tile={tile_name(cfg.tile)}  ring={tile_name(cfg.ring)}  S={cfg.seq} (S/P={cfg.seq_local})  "
        f"B={cfg.batch}  heads={cfg.heads}  kv_heads={cfg.kv_heads}  head_dim={cfg.head_dim}  dtype={cfg.dtype}"
    )
    print(
        f"causal={cfg.causal} (layout {cfg.layout})  kernel={cfg.kernel}  backward={cfg.backward}  schedule={cfg.schedule}  "
        f"iters={cfg.iters}  warmup={cfg.warmup}  seed={cfg.seed}"
    )
    print(
        f"C = B*(S/P)*heads*head_dim = {shape.chunk_elems:,} elements, itemsize {shape.itemsize} B, accumulators {shape.acc_itemsize} B"
    )
    print(
        f"torch {torch.__version__}  python {platform.python_version()}  os.cpu_count()={os.cpu_count()}  "
        f"usable cores={kernel_threads}  threads: 1 per rank x {cfg.world} ranks (distributed), "
        f"{kernel_threads} (single-process kernel timing)"
    )
    print(
        f"machine before start: CPU idle {cpu_idle_percent()} over 1 s, load average {load_average()} "
        f"(other processes on the machine skew the times)"
    )


def print_times(cfg: BenchConfig, summaries: list[dict[str, Any]]) -> None:
    print()
    print(f"-- forward+backward of mesh_attn_func, median over {cfg.iters} iters per rank (barrier before each) --")
    print(f"{'mesh':6} {'max over ranks':>16} {'mean over ranks':>16} {'min over ranks':>16} {'fwd only, max':>16}")
    for s in summaries:
        print(
            f"{s['tile']:6} {fmt_ms(s['time_max_s']):>16} {fmt_ms(s['time_mean_s']):>16} "
            f"{fmt_ms(min(s['time_median_per_rank_s'])):>16} {fmt_ms(s['fwd_max_s']):>16}"
        )
    if len(summaries) == 2:
        print(f"time mesh/ring (max over ranks): {100 * summaries[0]['time_max_s'] / summaries[1]['time_max_s']:.1f}%")
    print(f"(all {cfg.world} ranks share the machine's cores, so these times include waiting for a core)")


def _measured_str(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}..{hi:,} (differs across ranks!)"


def print_bytes(cfg: BenchConfig, summaries: list[dict[str, Any]]) -> bool:
    """Print the byte table and checks; return whether everything matched."""
    all_ok = True
    print()
    print("-- bytes sent per rank, one forward+backward iteration (CommCounter) --")
    print("   formula = traffic_units * C * itemsize (lse/delta left out), stats = plan.stats_bytes_sent")
    header = f"{'mesh':6} {'phase':9} {'measured':>14} {'plan':>14} {'units':>6} {'formula':>14} {'stats':>10} {'formula+stats':>14}  {'==plan':7} {'==formula+stats'}"
    print(header)
    for s in summaries:
        for phase in (*PHASES, "total"):
            row = s["bytes"][phase]
            units = (
                s["traffic_units"]["forward"] + s["traffic_units"]["backward"]
                if phase == "total"
                else s["traffic_units"][phase]
            )
            ok_plan = "yes" if row["ok_plan"] else "NO"
            if row["ok_formula"]:
                ok_formula = "yes"
            elif s["formula_exact"]:
                ok_formula = "NO"
            else:
                ok_formula = f"n/a ({cfg.dtype}: o/dq/dk/dv travel in fp32)"
            print(
                f"{s['tile']:6} {phase:9} {_measured_str(row['measured_per_rank']):>14} {row['plan']:>14,} {units:>6g} "
                f"{row['formula']:>14,.0f} {row['stats']:>10,} {row['formula'] + row['stats']:>14,.0f}  {ok_plan:7} {ok_formula}"
            )
            if not row["ok_plan"] or (s["formula_exact"] and not row["ok_formula"]):
                all_ok = False
        for phase in PHASES:
            row = s["bytes"][phase]
            measured = row["by_role_measured_per_rank"]
            parts = []
            for role in ROLES:
                vals = [m[role] for m in measured]
                parts.append(f"{role} {_measured_str(vals)}/{row['by_role_plan'][role]:,}")
            print(f"{'':6} {phase:9} by group (measured/plan): " + "  ".join(parts))
    for s in summaries:
        for phase in (*PHASES, "total"):
            row = s["bytes"][phase]
            if not row["ok_plan"]:
                print(
                    f"*** MISMATCH *** {s['tile']} {phase}: measured {row['measured_per_rank']} != plan {row['plan']}"
                )
            if s["formula_exact"] and not row["ok_formula"]:
                print(
                    f"*** MISMATCH *** {s['tile']} {phase}: measured {row['measured_per_rank']} != "
                    f"formula+stats {row['formula'] + row['stats']:,.0f}"
                )
    if len(summaries) == 2:
        mesh_total = max(summaries[0]["bytes"]["total"]["measured_per_rank"])
        ring_total = max(summaries[1]["bytes"]["total"]["measured_per_rank"])
        plan_ratio = summaries[0]["bytes"]["total"]["plan"] / summaries[1]["bytes"]["total"]["plan"]
        print(
            f"bytes mesh/ring (fwd+bwd, per rank, measured): {fmt_bytes(mesh_total)} / {fmt_bytes(ring_total)} = "
            f"{100 * mesh_total / ring_total:.1f}%  (plan: {100 * plan_ratio:.1f}%)"
        )
    print("byte checks: " + ("all match" if all_ok else "*** MISMATCH (see above) ***"))
    return all_ok


def print_blocking(cfg: BenchConfig, k: dict[str, Any]) -> None:
    print()
    print(
        f"-- compute overhead of blocking: kernel calls only, single process, {k['threads']} threads, "
        f"median over {cfg.iters} iters --"
    )
    print(
        f"full sequence  ({cfg.batch}, {cfg.seq}, {cfg.heads}, {cfg.head_dim}) causal={cfg.causal}: "
        f"fwd+bwd {fmt_ms(k['full_s'])}  (fwd {fmt_ms(k['full_fwd_s'])}, bwd {fmt_ms(k['full_bwd_s'])})  "
        f"pairs {k['full_pairs']:,}"
    )
    print(
        f"sum of blocks  {k['block_calls']} calls of chunk size {cfg.seq_local}, tile {tile_name(cfg.tile)}: "
        f"fwd+bwd {fmt_ms(k['blocks_s'])}  (fwd {fmt_ms(k['blocks_fwd_s'])}, bwd {fmt_ms(k['blocks_bwd_s'])})  "
        f"pairs {k['block_pairs']:,}"
    )
    for name, per_rank in k["per_rank_s"].items():
        print(
            f"  per-rank block kernel time, {name:5}: max {fmt_ms(max(per_rank))}  min {fmt_ms(min(per_rank))}  "
            f"(sum/P {fmt_ms(sum(per_rank) / cfg.world)})"
        )
    print(
        f"blocking overhead: {100 * (k['blocks_s'] / k['full_s'] - 1):+.1f}%  (sum of block kernel time / full kernel time = {k['blocks_s'] / k['full_s']:.3f})"
    )


def load_average() -> str:
    """The system load average, or ``"n/a"`` where the platform has none."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_idle_percent(seconds: float = 1.0) -> str:
    """Idle share of all CPUs over ``seconds``, from ``/proc/stat`` (``"n/a"`` off Linux)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, total (without guest time)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return "n/a"
    return f"{100 * (idle1 - idle0) / max(total1 - total0, 1):.0f}%"


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    cores = usable_cores()
    print_config(cfg, cores)
    sys.stdout.flush()

    t0 = time.perf_counter()
    per_rank = spawn_gloo(bench_rank, cfg.world, cfg, threads_per_rank=1, timeout=TIMEOUT)
    dist_wall = time.perf_counter() - t0
    summaries = [summarize_mesh(cfg, tile, [r[tile_name(tile)] for r in per_rank]) for tile in cfg.meshes()]
    print_times(cfg, summaries)
    ok = print_bytes(cfg, summaries)
    print(f"(distributed part: {dist_wall:.1f} s wall including spawn; load average now {load_average()})")
    sys.stdout.flush()

    kernels = time_blocking(cfg, cores)
    print_blocking(cfg, kernels)
    print(f"load average at end (1/5/15 min): {load_average()}")

    if json_path:
        report = {
            "config": {**asdict(cfg), "layout": cfg.layout, "seq_local": cfg.seq_local},
            "environment": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpu_count": os.cpu_count(),
                "usable_cores": cores,
                "threads_per_rank": 1,
                "kernel_threads": cores,
                "load_average_end": load_average(),
            },
            "meshes": summaries,
            "blocking": kernels,
            "bytes_ok": ok,
        }
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
