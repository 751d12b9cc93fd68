"""The ``mesh-cp`` command: predicted traffic, memory and time of every tile, of the best head-parallel x mesh
hybrid and USP split, and what to use.

::

    mesh-cp plan --world 256 --ranks-per-node 8 --seq 1048576 --heads 32 --kv-heads 8 --head-dim 128
    mesh-cp decode --world 16 --heads 32 --kv-heads 8 --head-dim 128      # Tree-Attention decoding vs ring vs gather

No torch import (only :mod:`mesh_cp.core` plans and the :mod:`mesh_cp.sim` cost model); matplotlib
is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from mesh_cp.core import AttentionShape, DecodeShape, Tiling, check_seq_len, head_parallel_unavailable
from mesh_cp.core.options import positive_int as _positive
from mesh_cp.sim import PRESETS, SimResult, Topology, best_of_kind, choose, simulate_candidates
from mesh_cp.sim.decode import decode_table, format_decode_table
from mesh_cp.sim.mixers import mixer_traffic, parse_mixer
from mesh_cp.sim.step_cli import add_step_arguments

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
PLOT_WORLDS = tuple(2**k for k in range(2, 11))  # P = 4 .. 1024


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> bytes; units B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a number with an optional unit; write e.g. '40GiB', '512MiB' or '80GB'"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least one byte")
    return int(value)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        return _positive("value", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None


def format_bytes(nbytes: float) -> str:
    """Bytes as MiB below one GiB, as GiB above."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def load_topology(spec: str, *, head_dim: int, ranks_per_node: int | None) -> Topology:
    """A preset name (``h100``, ``a100``) or a JSON file of :meth:`Topology.to_dict`.

    ``ranks_per_node`` overrides the topology's value when given.
    """
    if spec in PRESETS:
        return Topology.preset(spec, head_dim=head_dim, ranks_per_node=ranks_per_node or 8)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--topology {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a JSON file")
    topology = Topology.from_dict(json.loads(path.read_text()))
    return topology if ranks_per_node is None else dataclasses.replace(topology, ranks_per_node=ranks_per_node)


def _shape(args: argparse.Namespace, world: int) -> AttentionShape:
    check_seq_len(args.seq, world, "zigzag")
    return AttentionShape(
        batch=args.batch,
        seq_local=args.seq // world,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        itemsize=DTYPES[args.dtype],
    )


# ----------------------------------------------------------------------------------------------
# Table

_HEADER = (
    f"{'tile':>9}  {'intra':>10} {'inter':>10}  {'mem ovl':>10} {'mem coll':>10}  "
    f"{'ovl fwd':>8} {'bwd':>8} {'total':>8}  {'coll fwd':>8} {'bwd':>8} {'total':>8}  {'ovl':>6} {'coll':>6}"
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def _row(name: str, overlap: SimResult, collective: SimResult, ring: float, budget: int | None) -> str:
    """One table row: traffic, memory and times of both schedules, and their speed-up over the ring."""
    runs = (overlap, collective)
    mem = [format_bytes(r.memory) + ("!" if budget and r.memory > budget else "") for r in runs]
    times = [f"{_ms(r.forward.time)} {_ms(r.backward.time)} {_ms(r.time)}" for r in runs]
    speedups = [f"{ring / r.time:5.2f}x" for r in runs]
    traffic = collective.traffic
    return (
        f"{name:>9}  {format_bytes(traffic.intra):>10} {format_bytes(traffic.inter):>10}  {mem[0]:>10} {mem[1]:>10}  "
        f"{times[0]}  {times[1]}  {speedups[0]} {speedups[1]}"
    )


def _describe(args: argparse.Namespace, shape: AttentionShape, topology: Topology) -> list[str]:
    nodes = -(-args.world // topology.ranks_per_node)
    return [
        f"P={args.world} ranks ({nodes} node(s) x {topology.ranks_per_node}), seq {args.seq} ({shape.seq_local} per rank), "
        f"batch {shape.batch}, heads {shape.heads} (kv {shape.kv_heads}), head_dim {shape.head_dim}, {args.dtype}, "
        f"{'causal' if args.causal else 'no mask'}, zigzag layout, backward {args.backward}",
        f"topology {args.topology}: intra {topology.intra_bandwidth / 1e9:g} GB/s, inter {topology.inter_bandwidth / 1e9:g} "
        f"GB/s per rank, latency {topology.intra_latency * 1e6:g}/{topology.inter_latency * 1e6:g} us, "
        f"{topology.pairs_per_second:.3g} pairs/s, backward x{topology.backward_factor:g}",
        f"one C (a rank's Q chunk) = {format_bytes(shape.chunk_elems * shape.itemsize)}",
    ]


def _plan_command(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology, head_dim=args.head_dim, ranks_per_node=args.ranks_per_node)
    shape = _shape(args, args.world)
    lines = [*_describe(args, shape, topology), ""]
    options = {"causal": args.causal, "backward": args.backward}
    runs = {
        schedule: simulate_candidates(args.world, shape, topology, schedule=schedule, **options)
        for schedule in ("overlap", "collective")
    }
    ring = runs["overlap"][(1, Tiling(world=args.world, a=1, b=args.world))].time
    lines += [
        f"{'':9}  {'traffic fwd+bwd / rank':^21}  {'peak memory / rank':^21}  {'overlap (ms)':^26}  "
        f"{'collective (ms)':^26}  {'vs ring':^13}",
        _HEADER,
    ]
    for (u, tiling), overlap in runs["overlap"].items():
        if u == 1:
            lines.append(_row(str(tiling), overlap, runs["collective"][(u, tiling)], ring, args.memory_budget))
    reason = head_parallel_unavailable(args.world, args.world, shape)  # Ulysses: u = P, tile 1x1
    if reason is None:
        ulysses = (args.world, Tiling(world=1, a=1, b=1))
        lines.append(_row("ulysses", runs["overlap"][ulysses], runs["collective"][ulysses], ring, args.memory_budget))
    else:
        lines.append(f"{'ulysses':>9}  unavailable: {reason}")
    lines += _hybrid_rows(args, runs, ring)
    u, tiling, why = choose(
        args.world, shape, topology, memory_budget=args.memory_budget, head_parallel=args.head_parallel, **options
    )
    chosen, ring_bytes = (
        runs["collective"][key].traffic.total for key in ((u, tiling), (1, Tiling(world=args.world, a=1, b=args.world)))
    )
    for name, cin, cout, sent in mixer_traffic(args.mixer or (), shape, args.world):
        lines.append(
            f"{'mixer':>9}  {format_bytes(sent):>10}  {name}: head-parallel exchange of {cin} + {cout} channels "
            f"per token, {sent / chosen:.2f}x the chosen attention layout's bytes, {sent / ring_bytes:.2f}x the ring's"
        )
    lines += [
        "",
        "traffic: bytes sent by the rank that sends the most across nodes; memory: peak beyond the inputs"
        + (" ('!': over --memory-budget)" if args.memory_budget else ""),
        "Ux(AxB): all-to-alls over heads in groups of U consecutive ranks, then tile AxB over the P/U ranks that "
        "hold the same heads (Ux(1xM) is USP)",
        "chosen " + why.replace("; ", "\n    "),
    ]
    print("\n".join(lines))
    if args.plot:
        plot_scaling(args, topology, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def _mixer(text: str) -> tuple[str, tuple[int, int]]:
    try:
        return parse_mixer(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _hybrid_rows(args: argparse.Namespace, runs: dict[str, dict], ring: float) -> list[str]:
    """Rows of the fastest head-parallel x mesh hybrid and USP split (overlapped schedule), tagged at the end."""
    lines = []
    for kind, tag in (("hybrid", "best hybrid"), ("usp", "best USP")):
        best = best_of_kind(runs["overlap"], kind)
        if best is None:
            lines.append(f"{tag:>9}  unavailable: no head-parallel degree u > 1 fits P={args.world} and this shape")
            continue
        u, tiling = best
        row = _row(f"{u}x({tiling})", runs["overlap"][best], runs["collective"][best], ring, args.memory_budget)
        lines.append(f"{row}  {tag}")
    return lines


# ----------------------------------------------------------------------------------------------
# Plot


def scaling(args: argparse.Namespace, topology: Topology) -> list[dict]:
    """Ring, best tile, the automatic choice (:func:`mesh_cp.sim.choose`, ``--head-parallel`` when given) and the
    best USP split for P = 4..1024 at the fixed global ``args.seq`` (P with seq % 2P skipped, and P where no
    candidate fits the memory budget or ``--head-parallel`` cannot split P; ``"usp"`` is ``None`` without one)."""
    points = []
    options = {"causal": args.causal, "backward": args.backward, "memory_budget": args.memory_budget}
    for world in PLOT_WORLDS:
        if args.seq % (2 * world):
            continue
        shape = _shape(args, world)
        try:
            _, tile, _ = choose(world, shape, topology, head_parallel=1, **options)
            u, inner, _ = choose(world, shape, topology, head_parallel=args.head_parallel, **options)
        except ValueError:
            continue
        results = simulate_candidates(world, shape, topology, causal=args.causal, backward=args.backward)
        usp = best_of_kind(results, "usp")
        points.append(
            {
                "world": world,
                "tile": str(tile),
                "ring": results[(1, Tiling(world=world, a=1, b=world))],
                "best": results[(1, tile)],
                "hybrid": results[(u, inner)],
                "hybrid_label": str(inner) if u == 1 else f"{u}x({inner})",
                "usp": None if usp is None else results[usp],
            }
        )
    return points


_CURVES = (("ring", "ring 1xP", "o"), ("best", "best tile", "s"), ("hybrid", "auto (with head-parallel)", "^"))
_CURVES += (("usp", "best USP", "v"),)


def plot_scaling(args: argparse.Namespace, topology: Topology, path: Path) -> None:
    """Write a PNG: traffic per rank and predicted speed-up over ring versus P: ring, best tile, the automatic
    choice among head-parallel x mesh hybrids and the best USP split."""
    try:
        import matplotlib
    except ImportError as err:
        raise ValueError("--plot needs matplotlib; install it with: pip install 'mesh-cp[plot]'") from err
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = scaling(args, topology)
    if not points:
        raise ValueError(f"--plot: no P in {PLOT_WORLDS} divides seq {args.seq} by 2P with a tile within the budget")
    worlds = [p["world"] for p in points]
    nan = float("nan")  # log axes: no 0, and no point where a curve has none
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, name, marker in _CURVES:
        for part, line in (("total", "-"), ("inter", "--")):
            gib = [nan if p[key] is None else getattr(p[key].traffic, part) / 2**30 for p in points]
            label = f"{name} {'inter-node' if part == 'inter' else part}"
            left.plot(worlds, [g if g > 0 else nan for g in gib], marker + line, label=label)
    left.set(xscale="log", yscale="log", xlabel="P (CP ranks)", ylabel="GiB sent per rank (fwd+bwd)")
    left.set_title(f"traffic per rank, seq {args.seq}")
    left.legend(fontsize=7)
    right.axhline(1.0, color="grey", linewidth=0.8, label="ring 1xP")
    for key, name, marker in _CURVES[1:]:
        speedups = [nan if p[key] is None else p["ring"].time / p[key].time for p in points]
        right.plot(worlds, speedups, marker + "-", label=f"{name} (overlap)")
        labels = {"best": "tile", "hybrid": "hybrid_label"}
        for world, speedup, p in zip(worlds, speedups, points, strict=True):
            if key in labels:
                offset = (0, 6) if key == "best" else (0, -12)
                right.annotate(
                    p[labels[key]], (world, speedup), textcoords="offset points", xytext=offset, ha="center", fontsize=7
                )
    right.set(xscale="log", xlabel="P (CP ranks)", ylabel="predicted speed-up over ring")
    right.set_title(f"fwd+bwd time, {args.topology}, {args.heads}/{args.kv_heads} heads")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xticks(worlds, [str(w) for w in worlds])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Arguments


def _decode_command(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology, head_dim=args.head_dim, ranks_per_node=args.ranks_per_node)
    tile = None if args.tile is None else Tiling.parse(args.tile, args.world).shape
    shape = DecodeShape(args.batch, args.new_tokens, args.heads, args.kv_heads, args.head_dim, 0, DTYPES[args.dtype])
    contexts = [positive_int(c) for c in args.contexts.split(",") if c.strip()]
    rows = decode_table(shape, args.world, topology, contexts, tile=tile)
    print(
        f"decoding {args.new_tokens} token(s) x batch {args.batch}, {args.heads}:{args.kv_heads} heads x {args.head_dim} "
        f"{args.dtype}, cache sharded over {args.world} ranks ({topology.ranks_per_node} per node); per layer call: "
        f"predicted microseconds and KiB sent per rank (intra + inter)"
    )
    print(format_decode_table(rows))
    return 0


def _add_cluster_and_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``plan`` and ``decode`` share: the CP group on its cluster, the attention's heads, batch, dtype."""
    p.add_argument("--world", type=positive_int, required=True, help="CP group size P")
    p.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        help="GPUs per node (default: 8 for presets, the JSON's value)",
    )
    p.add_argument(
        "--topology",
        default="h100",
        help=f"preset ({', '.join(sorted(PRESETS))}) or a JSON file of Topology.to_dict() (default h100)",
    )
    p.add_argument("--heads", type=positive_int, required=True, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=positive_int, required=True, help="head dimension")
    p.add_argument("--batch", type=positive_int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of q, k, v (default bf16)")


def _add_decode_parser(commands: argparse._SubParsersAction) -> None:
    decode = commands.add_parser(
        "decode",
        help="predict decoding with a sharded K/V cache: Tree Attention against the ring and gathering the cache",
        description="Per layer call, the time and bytes per rank of decoding with the cache sharded over --world "
        "ranks: tree (node-local tile, or --tile), flat tree, ring (the cache passed around), gather (the cache "
        "all-gathered), at each context length.",
    )
    _add_cluster_and_model_arguments(decode)
    decode.add_argument("--new-tokens", type=positive_int, default=1, help="tokens per call (default 1)")
    decode.add_argument("--tile", default=None, help="the tree's AxB tile (default: node-local Q-groups)")
    decode.add_argument(
        "--contexts", default="4096,32768,262144,1048576", help="comma-separated cache lengths in tokens"
    )
    decode.set_defaults(run=_decode_command, command_parser=decode)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh-cp", description="Mesh-Attention context parallelism: plans and predictions (no GPU needed)."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="predict traffic, memory and time of every a x b tile and hybrid, and choose one",
        description="Simulate every tile a x b of --world ranks (overlapped and collective schedules), "
        "DeepSpeed-Ulysses, and the fastest head-parallel x mesh hybrid and USP split on a topology; print one row "
        "each and the choice (tile and head-parallel ranks). Sizes are global.",
    )
    _add_cluster_and_model_arguments(plan)
    plan.add_argument("--seq", type=positive_int, required=True, help="global sequence length (a multiple of 2*world)")
    plan.add_argument(
        "--memory-budget", type=parse_bytes, default=None, help="peak attention memory per rank, e.g. 40GiB"
    )
    plan.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default: causal)"
    )
    plan.add_argument(
        "--backward", choices=("regather", "reuse"), default="regather", help="backward gathers again or reuses"
    )
    plan.add_argument(
        "--head-parallel",
        type=positive_int,
        default=None,
        help="fix the head-parallel degree u of the choice (1: a plain mesh; default: the cost model chooses u)",
    )
    plan.add_argument(
        "--mixer",
        type=_mixer,
        action="append",
        metavar="NAME=CIN,COUT",
        help="a hybrid model's mixer layer (Mamba, linear attention, short convolution): the channels one rank's core "
        "reads and writes at this --world (scripts/mixer_traffic.py prints them for a transformers config); adds a "
        "row of its exchange's bytes against the attention's (repeatable)",
    )
    plan.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of traffic and speed-up vs P=4..1024")
    plan.set_defaults(run=_plan_command, command_parser=plan)
    add_step_arguments(plan)  # --model: the whole training step's memory (mesh_cp.sim.step_cli)
    _add_decode_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mesh-cp``; returns the exit status (argument errors exit with 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "kv_heads", 0) is None:
        args.kv_heads = args.heads
    try:
        return args.run(args)
    except (ValueError, NotImplementedError) as err:
        args.command_parser.error(str(err))  # usage of the subcommand, exit status 2


if __name__ == "__main__":
    sys.exit(main())
