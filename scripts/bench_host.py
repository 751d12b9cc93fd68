"""Host time of one rank's layer: the Python and dispatcher work of its kernel calls, without a GPU.

The rows of ``scripts/bench_rank.py`` (a ``P``-rank plan, most square tile, zig-zag layout, causal; batch 1, ``L``
tokens per rank, ``H:Hkv`` heads; masks ``causal`` and the packed mixes its :func:`masks` builds), run with the
``cuda_flash`` kernel on ``meta`` tensors: every ATen op goes through the dispatcher to its meta function, which
computes shapes and dtypes only, so the wall time is the host's share of the layer, what a GPU waits on when the
host cannot keep ahead of it. Each layer builds a new :class:`~mesh_cp.runtime.call.AttentionCall` of the cached plan
(as every layer of a model does) and runs rank 0's :func:`~mesh_cp.runtime.executors.forward_blocks`, then
:func:`~mesh_cp.runtime.executors.backward_blocks` with it. Times are the best of ``--repeats`` layers after one
warm-up layer, which builds what is built once per plan (blocks, segments, varlen plans, Note [Host work per plan]
in ``mesh_cp/runtime/call.py``). ``kernel calls`` counts the kernel's ``forward`` calls of one phase
(:meth:`~mesh_cp.runtime.call.AttentionCall.kernel_calls`) and ``us / call`` is a phase's time over that count.
``fwd ops`` and ``bwd ops`` count the ATen ops of one layer's phase that are not views (on a GPU: a kernel launch,
an allocation or a copy each), views in brackets.

The meta functions of several ops are Python (``torch/_meta_registrations.py``, ``torch/_refs``: ``where``,
``div``, ``logaddexp``, ``exp``, the flash ops, ...) where their CUDA ops run C++ only, so on meta these ops cost
tens of microseconds (``logaddexp`` over a millisecond) and the times overstate the host work of the LSE merge and
the backward's elementwise ops; the op counts do not depend on that. Compare versions of ``mesh_cp`` on one machine
and torch; ``--profile`` prints, per row, the functions of ``--profile-layers`` layers by cProfile's cumulative
time.

    .venv/bin/python scripts/bench_host.py
    .venv/bin/python scripts/bench_host.py --lengths 2048 --masks "packed short" --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rank import DTYPES, masks  # noqa: E402

from mesh_cp.core import AttentionMask, AttentionShape, Tiling, make_plan, most_square_tile  # noqa: E402
from mesh_cp.core.numerics import acc_dtype, document_ids  # noqa: E402
from mesh_cp.kernels.cuda_flash import CudaFlashKernel  # noqa: E402
from mesh_cp.runtime.call import AttentionCall, by_segments  # noqa: E402
from mesh_cp.runtime.executors import backward_blocks, forward_blocks  # noqa: E402

META = torch.device("meta")


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach the dispatcher, views (which launch nothing on a GPU) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))


def counted(fn: Callable[[], object]) -> tuple[int, int]:
    """``(ops, of which views)`` of one run of ``fn()``."""
    with OpCounter() as counter:
        fn()
    return counter.ops, counter.views


def best(fn: Callable[[], object], repeats: int) -> float:
    """Fewest seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def profile_text(fn: Callable[[], object], layers: int, rows: int) -> str:
    """The top ``rows`` functions of ``layers`` runs of ``fn()`` (after a warm-up) by cumulative time."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(layers):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def host_row(args, L: int, heads: int, kv_heads: int, mask_name: str, mask: AttentionMask | None) -> dict:
    """Time rank 0's forward and backward of one layer on meta tensors."""
    dtype, dim, kernel = args.dtype, args.head_dim, CudaFlashKernel.without_device_check()
    a, b = most_square_tile(args.world)
    shape = AttentionShape(batch=1, seq_local=L, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=dtype.itemsize)
    plan = make_plan(Tiling(args.world, a, b), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
    no_ids = mask is None or by_segments(kernel)
    doc_ids = None if no_ids else document_ids(mask, 1, plan.seq_len, META)
    q_all, do_all = (torch.empty((a, 1, L, heads, dim), device=META, dtype=dtype) for _ in "qo")
    kv_all = torch.empty((b, 2, 1, L, kv_heads, dim), device=META, dtype=dtype)
    stats = torch.empty((a, 2, 1, heads, L), device=META, dtype=acc_dtype(dtype))
    calls: list[AttentionCall] = []

    def forward():
        calls[:] = [AttentionCall(mesh=None, plan=plan, kernel=kernel, scale=dim**-0.5, doc_ids=doc_ids)]
        return forward_blocks(calls[0], 0, q_all, kv_all)

    def backward():
        return backward_blocks(calls[0], 0, q_all, do_all, stats, kv_all)

    def layer():
        forward()
        backward()

    with torch.no_grad():
        forward()
        t_fwd, t_bwd = best(forward, args.repeats), best(backward, args.repeats)
        ops_fwd, ops_bwd = counted(forward), counted(backward)
        if args.profile:
            print(f"L {L:,} {heads}:{kv_heads} {mask_name}: {args.profile_layers} layers, by cumulative time")
            print(profile_text(layer, args.profile_layers, args.profile_rows))
    count = calls[0].kernel_calls(0)
    return {
        "L": L,
        "heads": heads,
        "kv_heads": kv_heads,
        "mask": mask_name,
        "blocks": len(plan.blocks(0)),
        "kernel_calls": count,
        "ms_fwd": t_fwd * 1e3,
        "ms_bwd": t_bwd * 1e3,
        "us_per_call_fwd": t_fwd * 1e6 / count,
        "us_per_call_bwd": t_bwd * 1e6 / count,
        "ops_fwd": ops_fwd[0] - ops_fwd[1],
        "ops_bwd": ops_bwd[0] - ops_bwd[1],
        "views_fwd": ops_fwd[1],
        "views_bwd": ops_bwd[1],
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Host time per layer, rank 0 of P = {meta['world']} (tile {meta['tile']}), {meta['kernel']} on meta tensors, "
        f"{meta['dtype']}, head dim {meta['head_dim']}, document lengths / {meta['doc_scale']}, "
        f"best of {meta['repeats']}, torch {meta['torch']}",
        "",
        "| L | heads | mask | kernel calls | fwd ms | bwd ms | fwd us / call | bwd us / call | fwd ops | bwd ops |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['mask']} | {r['kernel_calls']} | {r['ms_fwd']:.3f} | "
            f"{r['ms_bwd']:.3f} | {r['us_per_call_fwd']:.1f} | {r['us_per_call_bwd']:.1f} | "
            f"{r['ops_fwd']} ({r['views_fwd']}) | {r['ops_bwd']} ({r['views_bwd']}) |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,8192", help="tokens per rank L, comma-separated")
    p.add_argument("--world", type=int, default=16, help="P, ranks of the plan")
    p.add_argument("--heads", type=int, default=32, help="query heads; GQA rows use heads / 4 K/V heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--doc-scale", type=int, default=1, help="divide the document lengths by this")
    p.add_argument("--repeats", type=int, default=20, help="layers timed per phase; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--masks", help="only these rows, comma-separated (causal, packed long, ...; default: all)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--profile", action="store_true", help="print each row's functions by cProfile cumulative time")
    p.add_argument("--profile-layers", type=int, default=10, help="layers profiled per row")
    p.add_argument("--profile-rows", type=int, default=30, help="functions printed per row")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.dtype = DTYPES[args.dtype]
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for L in args.lengths:
        for h, hkv in ((args.heads, args.heads), (args.heads, max(1, args.heads // 4))):
            for name, mask in masks(args.world * L, args.doc_scale, args.seed).items():
                if args.masks and name not in args.masks.split(","):
                    continue
                rows.append(host_row(args, L, h, hkv, name, mask))
    a, b = most_square_tile(args.world)
    meta = {
        "world": args.world,
        "tile": f"{a}x{b}",
        "kernel": CudaFlashKernel.name,
        "dtype": str(args.dtype).removeprefix("torch."),
        "head_dim": args.head_dim,
        "doc_scale": args.doc_scale,
        "repeats": args.repeats,
        "seed": args.seed,
        "torch": torch.__version__,
    }
    print(markdown(meta, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
