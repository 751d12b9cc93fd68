"""Per-rank speed: one rank's work of a ``P``-rank plan on one device, against one kernel call of the same FLOPs.

Training rows. For a ``P``-rank plan (tile :func:`mesh_cp.core.most_square_tile`, zig-zag layout, causal) of
batch 1, ``L`` tokens per rank and ``H:Hkv`` heads, random Q chunks (``a``) and stacked K, V chunks (``b``) stand
on the device for the chunks rank 0 gathers (no communication). Forward and backward run rank 0's kernel calls
with the code :class:`~mesh_cp.runtime.executors.CollectiveExecutor` runs between its collectives
(:func:`~mesh_cp.runtime.executors.forward_blocks`, :func:`~mesh_cp.runtime.executors.backward_blocks`: the unmasked
blocks of a Q chunk as one call, Note [One call per Q chunk]), backward with the rows' lse and delta from that
forward. The baseline is one call of the same kernel,
causal over ``n`` tokens with ``n (n + 1) / 2`` closest to rank 0's pairs (``plan.pairs(0)``), timed the same way.
With ``4 D`` FLOP per query-key pair and head forward and ``2.5`` times that backward (the usual flash
accounting)::

    TFLOP/s = pairs * B * H * 4 D * 3.5 / (t_forward + t_backward)      fraction = rank's / single call's

Masks: ``causal``, and packed rows of documents drawn uniformly from ``long`` (8K-32K tokens), ``mixed``
(1K-8K) and ``short`` (256-2K) over ``S = P L`` (seeded; lengths divided by ``--doc-scale``, by default 1 on
CUDA and 16 on CPU, where ``L`` is 16 times smaller). ``kernel calls`` counts the kernel's forward calls in
rank 0's forward (masked blocks run tile by tile, or run by run on kernels that take ``segments``). ``--balance``
adds each packed row in the order that balances the ranks (``packed long balanced``, ...; Note [Balanced packing]
in ``mesh_cp/core/balance.py``) and a table of every packed row's busiest rank's pairs over the mean; ``--split`` with
it adds each packed row split over the ranks (``packed long split``, ...; Note [Split documents]).

Decode rows: per step, rank 0's part of Tree-Attention decoding of one query over a cache of ``S = P L``
tokens in the lengths form of a static cache (:func:`mesh_cp.runtime.decode.lengths_attention` over its
``L``-token shard: the flash decode kernel of Note [Flash decode] where it runs, else the step of Note [Decode
local step]; then a ``merge_`` in fp32 standing for the combine; its all-gather needs a process group and is not
timed), against the same form over the whole cache in one process (on a GPU, a single-process flash decode); and
the rank's part in the positions form (the local step), for comparison.

Times are the best of ``--repeats`` runs after one warm-up, with ``torch.cuda.synchronize()`` around each on CUDA.

    .venv/bin/python scripts/bench_rank.py --device cpu --lengths 256,512 --json rank.json
    .venv/bin/python scripts/bench_rank.py --device cuda --lengths 2048,8192,32768
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable

import torch

from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, make_plan, most_square_tile
from mesh_cp.core.balance import balance_documents, rank_pairs
from mesh_cp.core.numerics import acc_dtype, attention_delta, document_ids, merge_
from mesh_cp.core.split import split_documents
from mesh_cp.kernels import capabilities_of, resolve_kernel
from mesh_cp.runtime.call import AttentionCall
from mesh_cp.runtime.decode import (
    cache_slots,
    decode_kernel,
    flash_decode_reasons,
    lengths_attention,
    local_attention,
)
from mesh_cp.runtime.executors import backward_blocks, forward_blocks
from mesh_cp.sim.memory import compute_bytes

MIXES = {"long": (8192, 32768), "mixed": (1024, 8192), "short": (256, 2048)}
"""Document lengths (tokens) of the packed mixes, before ``--doc-scale``."""
FWD_BWD = 3.5
"""Forward + backward FLOPs in units of the forward's ``4 D`` per pair and head."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CountingKernel:
    """A block kernel that counts its ``forward`` calls; it declares its inner kernel's capabilities, so an
    :class:`AttentionCall` hands it the same keywords."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.capabilities, self.calls = inner, inner.name, capabilities_of(inner), 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


def peak_allocated(fn: Callable[[], object], device: torch.device) -> tuple[object, int | None]:
    """``fn()`` and the most bytes it allocated beyond what was allocated before it (CUDA; ``None`` elsewhere): what
    :func:`mesh_cp.sim.memory.compute_bytes` models."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, object]:
    """Fewest seconds of ``fn()`` over ``repeats`` runs after one warm-up (robust to other load), and its result."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result, times = fn(), []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), result


def profile_table(fn: Callable[[], object], device: torch.device, rows: int = 12) -> str:
    """The operators of one ``fn()`` (after a warm-up) by their total device time (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def document_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from ``[lo, hi]`` until they fill ``total`` tokens (the last one cut to fit)."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    return lengths


def masks(
    seq_len: int, scale: int, seed: int, balance_world: int | None = None, split: bool = False
) -> dict[str, AttentionMask | None]:
    """``causal`` and the packed mixes; with ``balance_world``, each mix also in the order that balances it over
    that many ranks (most square tile, zig-zag; :func:`mesh_cp.core.balance.balance_documents`), and with ``split``
    too, laid out split over them (Note [Split documents])."""
    out: dict[str, AttentionMask | None] = {"causal": None}
    for i, (name, (lo, hi)) in enumerate(MIXES.items()):
        lengths = document_lengths(seq_len, max(1, lo // scale), max(1, hi // scale), seed + i)
        out[f"packed {name}"] = AttentionMask.from_lengths([lengths])
        if balance_world is not None:
            (order,) = balance_documents(lengths, seq_len=seq_len, world=balance_world)
            out[f"packed {name} balanced"] = AttentionMask.from_lengths([[lengths[j] for j in order]])
            if split:
                out[f"packed {name} split"] = split_documents([lengths], seq_len=seq_len, world=balance_world)[0]
    return out


def imbalance_table(args) -> str:
    """The busiest rank's pairs over the mean of every packed row (``--balance``), as the plan counts them."""
    lines = ["", "", "Busiest rank's pairs / mean (zig-zag, most square tile)", "", "| L | mask | busiest / mean |"]
    lines.append("|---|---|---|")
    for L in args.lengths:
        seq = args.world * L
        for name, mask in masks(seq, args.doc_scale, args.seed, args.world, args.split).items():
            if mask is not None:
                lengths = [sum(b - a for a, b in spans) for spans in mask.document_spans(0, seq)]
                pairs = rank_pairs([lengths], seq_len=seq, world=args.world, split=mask.parts is not None)
                lines.append(f"| {L:,} | {name} | {max(pairs) * len(pairs) / sum(pairs):.3f} |")
    return "\n".join(lines)


def flops(pairs: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of ``pairs`` query-key pairs per head (batch 1)."""
    return pairs * heads * 4 * head_dim * FWD_BWD


def rank_row(args, kernel, L: int, heads: int, kv_heads: int, mask_name: str, mask) -> dict:
    """Time rank 0's blocks forward and backward, and the single call of the same FLOPs."""
    device, dtype, dim = args.device, args.dtype, args.head_dim
    backend = "nccl" if device.type == "cuda" else "gloo"  # the memory model's GPU or CPU kernel share
    a, b = most_square_tile(args.world)
    shape = AttentionShape(batch=1, seq_local=L, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=dtype.itemsize)
    plan = make_plan(Tiling(args.world, a, b), shape, causal=True, layout="zigzag", schedule="collective", mask=mask)
    counting = CountingKernel(kernel)
    doc_ids = None if mask is None else document_ids(mask, 1, plan.seq_len, device)
    call = AttentionCall(mesh=None, plan=plan, kernel=counting, scale=dim**-0.5, doc_ids=doc_ids)
    blocks = plan.blocks(0)
    gen = torch.Generator(device).manual_seed(args.seed)
    q_all = torch.randn((a, 1, L, heads, dim), generator=gen, device=device, dtype=dtype)
    do_all = torch.randn((a, 1, L, heads, dim), generator=gen, device=device, dtype=dtype)
    kv_all = torch.randn((b, 2, 1, L, kv_heads, dim), generator=gen, device=device, dtype=dtype)

    def forward():
        return forward_blocks(call, 0, q_all, kv_all)

    def backward(stats):
        return backward_blocks(call, 0, q_all, do_all, stats, kv_all)

    with torch.no_grad():
        counting.calls = 0
        (o_acc, lse_acc), peak_fwd = peak_allocated(forward, device)
        calls = counting.calls
        t_fwd, _ = timed(forward, args.repeats, device)
        delta = torch.stack([attention_delta(do_all[i], o_acc[i]) for i in range(a)])
        stats = torch.stack((lse_acc, delta), dim=1)  # (a, 2, B, H, L)
        del o_acc, lse_acc
        _, peak_bwd = peak_allocated(lambda: backward(stats), device)
        t_bwd, _ = timed(lambda: backward(stats), args.repeats, device)
        pairs = plan.pairs(0)
        single = single_call(args, kernel, heads, kv_heads, pairs)
        if args.profile:
            print(f"L {L:,} {heads}:{kv_heads} {mask_name}: rank 0 forward + backward")
            print(profile_table(lambda: (forward(), backward(stats)), device))
    seconds = t_fwd + t_bwd
    rate = flops(pairs, heads, dim) / seconds / 1e12
    return {
        "kind": "train",
        "L": L,
        "heads": heads,
        "kv_heads": kv_heads,
        "mask": mask_name,
        "tile": f"{a}x{b}",
        "blocks": len(blocks),
        "masked_blocks": sum(w.kind is MaskKind.MASKED for w in blocks),
        "kernel_calls": calls,
        "plan_kernel_calls": call.kernel_calls(0),
        "units": len(call.units(0)),
        "pairs": pairs,
        "peak_mib": [None if p is None else p / 2**20 for p in (peak_fwd, peak_bwd)],
        "model_mib": [compute_bytes(plan, phase, backend=backend) / 2**20 for phase in ("forward", "backward")],
        "ms_fwd": t_fwd * 1e3,
        "ms_bwd": t_bwd * 1e3,
        "ms": seconds * 1e3,
        "tflops": rate,
        **single,
        "fraction": rate / single["single_tflops"],
    }


def single_call(args, kernel, heads: int, kv_heads: int, pairs: int) -> dict:
    """One causal call of ``kernel`` over ``n`` tokens, ``n (n + 1) / 2`` closest to ``pairs``, forward + backward."""
    device, dtype, dim = args.device, args.dtype, args.head_dim
    n = max(1, round((math.sqrt(8 * pairs + 1) - 1) / 2))
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    q, do = (torch.randn((1, n, heads, dim), generator=gen, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn((1, n, kv_heads, dim), generator=gen, device=device, dtype=dtype) for _ in range(2))
    scale = dim**-0.5
    t_fwd, (out, lse) = timed(lambda: kernel.forward(q, k, v, causal=True, scale=scale), args.repeats, device)
    delta = attention_delta(do, out)
    t_bwd, _ = timed(lambda: kernel.backward(do, q, k, v, lse, delta, causal=True, scale=scale), args.repeats, device)
    seconds = t_fwd + t_bwd
    rate = flops(n * (n + 1) // 2, heads, dim) / seconds / 1e12
    return {"single_tokens": n, "single_ms": seconds * 1e3, "single_tflops": rate}


def decode_row(args, L: int, heads: int, kv_heads: int) -> dict:
    """One decode step: rank 0's part over its ``L``-token shard + merge, against one process over the whole cache,
    both in the lengths form of a static cache (Note [Flash decode]); and rank 0's part in the positions form."""
    device, dtype, dim = args.device, args.dtype, args.head_dim
    context = args.world * L
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    q = torch.randn((1, 1, heads, dim), generator=gen, device=device, dtype=dtype)

    def static_cache(entries: int):  # (1, Hkv, C, D) storage read as (1, C, Hkv, D), its first entries filled
        shape = (1, kv_heads, cache_slots(entries), dim)
        k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).transpose(1, 2) for _ in "kv")
        return k, v, torch.full((1,), entries, dtype=torch.int32, device=device)

    k_shard, v_shard, used = static_cache(L)
    k_all, v_all, used_all = static_cache(context)
    positions = torch.arange(L, device=device)[None]
    q_pos = torch.full((1, 1), context, device=device)
    scale, acc = dim**-0.5, acc_dtype(dtype)

    def merged(step):
        def run():
            out, lse = step()
            o_acc = torch.zeros((1, 1, heads, dim), dtype=acc, device=device)
            lse_acc = torch.full((1, heads, 1), float("-inf"), dtype=acc, device=device)
            merge_(o_acc, lse_acc, out, lse)
            return o_acc

        return run

    local = decode_kernel("auto", device, dtype, dim)
    with torch.no_grad():
        repeats = max(args.repeats, 20)
        t_rank, _ = timed(merged(lambda: lengths_attention("auto", q, k_shard, v_shard, used, scale)), repeats, device)
        t_one, _ = timed(lambda: lengths_attention("auto", q, k_all, v_all, used_all, scale), repeats, device)
        t_local, _ = timed(
            merged(lambda: local_attention(local, q, k_shard[:, :L], v_shard[:, :L], q_pos, positions, scale)),
            repeats,
            device,
        )
    return {
        "kind": "decode",
        "L": L,
        "heads": heads,
        "kv_heads": kv_heads,
        "context": context,
        "kernel": "local step" if flash_decode_reasons(q, k_shard) else "flash decode",
        "rank_ms": t_rank * 1e3,
        "single_ms": t_one * 1e3,
        "ratio": t_rank / t_one,
        "local_step_ms": t_local * 1e3,
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    train = [r for r in rows if r["kind"] == "train"]
    decode = [r for r in rows if r["kind"] == "decode"]
    lines = [
        f"P = {meta['world']} (tile {meta['tile']}), {meta['device']}, {meta['dtype']}, head dim {meta['head_dim']}, "
        f"kernel {meta['kernel']}, threads {meta['threads']}, document lengths / {meta['doc_scale']}, "
        f"best of {meta['repeats']}",
        "",
        "| L | heads | mask | blocks (masked) | kernel calls | fwd ms | bwd ms | TFLOP/s | single call: tokens | "
        "ms | TFLOP/s | fraction |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train:
        lines.append(
            f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['mask']} | {r['blocks']} ({r['masked_blocks']}) | "
            f"{r['kernel_calls']} | {r['ms_fwd']:.2f} | {r['ms_bwd']:.2f} | {r['tflops']:.4g} | "
            f"{r['single_tokens']:,} | {r['single_ms']:.2f} | {r['single_tflops']:.4g} | {r['fraction']:.2f} |"
        )
    measured = [r for r in train if r["peak_mib"][0] is not None]
    if measured:
        lines += ["", "Memory beyond the chunks (MiB): measured peak, and `mesh_cp.sim.memory.compute_bytes`", ""]
        lines += [
            "| L | heads | mask | fwd measured | fwd model | bwd measured | bwd model |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in measured:
            (pf, pb), (mf, mb) = r["peak_mib"], r["model_mib"]
            lines.append(
                f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['mask']} | {pf:.0f} | {mf:.0f} | {pb:.0f} | {mb:.0f} |"
            )
    lines += [
        "",
        "Decode, one query per step, the lengths form (rank: its shard + merge; all-gather not timed; one process: "
        "the whole cache), and the rank's part in the positions form (local step)",
        "",
        "| L | heads | context | kernel | rank ms/step | one process ms/step | rank / one process | local step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        lines.append(
            f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['context']:,} | {r['kernel']} | {r['rank_ms']:.3f} | "
            f"{r['single_ms']:.3f} | {r['ratio']:.3f} | {r['local_step_ms']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", help="tokens per rank L, comma-separated (CPU: 256,512; CUDA: 2048 to 32768)")
    p.add_argument("--world", type=int, default=16, help="P, ranks of the plan")
    p.add_argument("--heads", type=int, help="query heads (CUDA 32, CPU 8); GQA rows use heads / 4 K/V heads")
    p.add_argument("--head-dim", type=int, help="CUDA 128, CPU 64")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="CUDA bf16, CPU fp32")
    p.add_argument("--kernel", default="auto", help="block kernel name or auto")
    p.add_argument("--doc-scale", type=int, help="divide the document lengths by this (CUDA 1, CPU 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--split", action="store_true", help="with --balance: also each packed row split over the ranks")
    p.add_argument("--masks", help="only these rows, comma-separated (causal, packed long, ...; default: all)")
    p.add_argument("--profile", action="store_true", help="print each row's operators by device time")
    p.add_argument("--quick", action="store_true", help="smoke: L = 128, 4 heads, 3 repeats")
    balance = "also time each packed row in balanced order and print every packed row's busiest rank over the mean"
    p.add_argument("--balance", action="store_true", help=balance)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        args.lengths, args.heads, args.repeats = args.lengths or "128", args.heads or 4, 3
    args.lengths = [int(x) for x in (args.lengths or ("2048,4096,8192,16384,32768" if cuda else "256,512")).split(",")]
    args.heads = args.heads or (32 if cuda else 8)
    args.head_dim = args.head_dim or (128 if cuda else 64)
    args.dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    args.doc_scale = args.doc_scale or (1 if cuda else 16)
    args.device = torch.device(args.device)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = resolve_kernel(args.kernel, args.device, args.dtype, args.head_dim)
    # what mesh_attn_func resolves for a masked call (kernel="auto" takes one that takes masks or segments)
    masked_kernel = resolve_kernel(args.kernel, args.device, args.dtype, args.head_dim, needs=("mask|segments",))
    heads = [(args.heads, args.heads), (args.heads, max(1, args.heads // 4))]
    rows = []
    for L in args.lengths:
        for h, hkv in heads:
            balance_world = args.world if args.balance else None
            for name, mask in masks(args.world * L, args.doc_scale, args.seed, balance_world, args.split).items():
                if args.masks and name not in args.masks.split(","):
                    continue
                rows.append(rank_row(args, kernel if mask is None else masked_kernel, L, h, hkv, name, mask))
        for h, hkv in heads:
            rows.append(decode_row(args, L, h, hkv))
    a, b = most_square_tile(args.world)
    meta = {
        "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": str(args.dtype).removeprefix("torch."),
        "world": args.world,
        "tile": f"{a}x{b}",
        "head_dim": args.head_dim,
        "kernel": kernel.name,
        "masked_kernel": masked_kernel.name,
        "doc_scale": args.doc_scale,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    print(markdown(meta, rows) + (imbalance_table(args) if args.balance else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
