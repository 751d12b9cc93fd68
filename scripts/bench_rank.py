"""Per-rank speed: one rank's work of a ``P``-rank plan on one device, against one kernel call of the same FLOPs.

Training rows, one per schedule of ``--schedules`` (default ``collective,overlap``). For a ``P``-rank plan (tile
:func:`mesh_cp.core.most_square_tile`, zig-zag layout, causal) of batch 1, ``L`` tokens per rank and ``H:Hkv``
heads, random Q chunks (``a``) and stacked K, V chunks (``b``) stand on the device for the chunks rank 0 gathers or
receives (no communication); both schedules run on the same chunks.

- ``collective``: rank 0's kernel calls with the code :class:`~mesh_cp.runtime.executors.CollectiveExecutor` runs
  between its collectives (:func:`~mesh_cp.runtime.executors.forward_blocks`,
  :func:`~mesh_cp.runtime.executors.backward_blocks`: the unmasked blocks of a Q chunk as one call, Note [One call
  per Q chunk]), backward with the rows' lse and delta from rank 0's partial rows. The reduce to the rows' owners
  (all-to-all, then merges or sums) is not timed.
- ``overlap`` (the default schedule of ``mesh_attn_func``): rank 0's
  :class:`~mesh_cp.runtime.phases.ForwardPhase` and :class:`~mesh_cp.runtime.phases.BackwardPhase` replayed with
  the communication taken out (:class:`Replay`, Note [Replayed overlapped schedule]): the phase's own loop over the
  schedule's actions, its kernel calls (runs of blocks of one Q offset, Note [Rows of the overlapped schedule]),
  accumulators, and the merges (forward) and sums (backward) of the partials its reduce steps land, which are
  prepared before timing like the chunks of every ring offset. Backward from the saved output of the replayed
  forward; the chunks of the other offsets carry the lse and delta of the collective rows.

The baseline is one call of the same kernel, causal over ``n`` tokens with ``n (n + 1) / 2`` closest to rank 0's
pairs (``plan.pairs(0)``), timed the same way and shared by the schedules' rows. With ``4 D`` FLOP per query-key
pair and head forward and ``2.5`` times that backward (the usual flash accounting)::

    TFLOP/s = pairs * B * H * 4 D * 3.5 / (t_forward + t_backward)      fraction = rank's / single call's

Masks: ``causal``, and packed rows of documents drawn uniformly from ``long`` (8K-32K tokens), ``mixed``
(1K-8K) and ``short`` (256-2K) over ``S = P L`` (seeded; lengths divided by ``--doc-scale``, by default 1 on
CUDA and 16 on CPU, where ``L`` is 16 times smaller). ``kernel calls`` counts the kernel's forward calls in
rank 0's forward in that schedule (masked blocks run tile by tile, or run by run on kernels that take ``segments``);
the JSON's ``plan_kernel_calls`` is what the plan's programs hold (collective: ``call.kernel_calls(0)``; overlapped:
the calls of the programs of its runs) and ``units`` the collective blocks and chunk calls, or the overlapped runs. ``--balance``
adds each packed row in the order that balances the ranks (``packed long balanced``, ...; Note [Balanced packing]
in ``mesh_cp/core/balance.py``) and a table of every packed row's busiest rank's pairs over the mean; ``--split`` with
it adds each packed row split over the ranks (``packed long split``, ...; Note [Split documents]).

Decode rows: per step, rank 0's part of Tree-Attention decoding of one query over a cache of ``S = P L``
tokens in the lengths form of a static cache (:func:`mesh_cp.runtime.decode.lengths_attention` over its
``L``-token shard: the flash decode kernel of Note [Flash decode] where it runs, else the step of Note [Decode
local step]; then a ``merge_`` in fp32 standing for the combine; its all-gather needs a process group and is not
timed), against the same form over the whole cache in one process (on a GPU, a single-process flash decode); and
the rank's part in the positions form (the local step), for comparison.

Memory (CUDA): the peak allocated beyond the chunks, and for the collective rows
:func:`mesh_cp.sim.memory.compute_bytes` (it models that schedule only; an overlapped row's moves put prepared chunks
and allocate nothing, so its peak holds its accumulators, received partials, kernel temporaries and the chunks a
phase stacks for offset 0, not the chunks a real rank receives).

Times are the best of ``--repeats`` runs after one warm-up, with ``torch.cuda.synchronize()`` around each on CUDA.

    .venv/bin/python scripts/bench_rank.py --device cpu --lengths 256,512 --json rank.json
    .venv/bin/python scripts/bench_rank.py --device cuda --lengths 2048,8192,32768 --schedules overlap
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable

import torch
from torch import Tensor

from mesh_cp.core import AttentionMask, AttentionShape, MaskKind, Tiling, make_plan, most_square_tile
from mesh_cp.core.balance import balance_documents, rank_pairs
from mesh_cp.core.numerics import acc_dtype, attention_delta, document_ids, merge_
from mesh_cp.core.schedule import RingStep
from mesh_cp.core.split import split_documents
from mesh_cp.kernels import capabilities_of, resolve_kernel
from mesh_cp.runtime.call import AttentionCall, Saved
from mesh_cp.runtime.decode import (
    cache_slots,
    decode_kernel,
    flash_decode_reasons,
    lengths_attention,
    local_attention,
)
from mesh_cp.runtime.executors import backward_blocks, forward_blocks
from mesh_cp.runtime.phases import BackwardPhase, ForwardPhase
from mesh_cp.sim.memory import compute_bytes

MIXES = {"long": (8192, 32768), "mixed": (1024, 8192), "short": (256, 2048)}
"""Document lengths (tokens) of the packed mixes, before ``--doc-scale``."""
FWD_BWD = 3.5
"""Forward + backward FLOPs in units of the forward's ``4 D`` per pair and head."""
SCHEDULES = ("collective", "overlap")
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


class NoMesh:
    """The mesh a replayed phase reads: rank 0, and no groups (only ``post`` would use them)."""

    mesh_rank, q_group, kv_group = 0, None, None


class Replay:
    """A phase of the overlapped schedule on rank 0 with its communication taken out (mixed in before
    :class:`~mesh_cp.runtime.phases.ForwardPhase` or :class:`~mesh_cp.runtime.phases.BackwardPhase`).

    Note [Replayed overlapped schedule]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The phase runs its own loop over the schedule's actions (``run``), so its host work, kernel calls, row
    accumulators and merges are timed as a real rank runs them. Only the ring steps change: ``post`` posts
    nothing; a move puts the chunks of the offset it brings, prepared on the device before timing, where the
    receive would have written them (a view, no copy, when the phase does not keep its chunks); a reduce step
    allocates its receive buffer as a real one does but lands the partial prepared for that step instead, so the
    merges (forward) and sums (backward) of received partials run. A landed partial the phase holds as an
    accumulator is written by later calls, as a received buffer is; its values drift over repeats but stay finite.
    """

    ready: dict[str, list[Tensor]]
    """Per ring, per chunk the phase holds at an offset: ``(n, ...)``, the chunk of every offset."""
    partials: dict[str, list[Tensor]]
    """Per ring, the partial that reduce step ``s`` receives (``n - 1`` of them)."""

    def post(self, step: RingStep, sends: list[Tensor], recvs: list[Tensor]) -> tuple[list, list[Tensor]]:
        """No works; a reduce step's last tensor is its prepared partial (what ``land`` takes)."""
        landed = [self.partials[step.ring][step.index]] if step.kind == "reduce" else recvs
        return [], sends + landed

    def move(self, step: RingStep) -> tuple[list, list[Tensor]]:
        for held, ready in zip(self.chunks[step.ring], self.ready[step.ring], strict=True):
            held.put(step.index, ready[step.index])
        return [], []


class ForwardReplay(Replay, ForwardPhase):
    """Rank 0's forward of the overlapped schedule without communication (Note [Replayed overlapped schedule])."""

    def __init__(self, call: AttentionCall, ready: dict[str, list[Tensor]], partials: dict[str, list[Tensor]]):
        self.ready, self.partials = ready, partials
        k, v = ready["kv"][0][0]
        super().__init__(call, ready["q"][0][0], k, v)


class BackwardReplay(Replay, BackwardPhase):
    """Rank 0's backward of the overlapped schedule without communication (Note [Replayed overlapped schedule])."""

    def __init__(
        self, call: AttentionCall, do: Tensor, saved: Saved, ready: dict[str, list[Tensor]], partials: dict
    ) -> None:
        self.ready, self.partials = ready, partials
        super().__init__(call, do, None, saved)


def offsets(members: tuple[int, ...], rank: int = 0) -> list[int]:
    """Positions in ``members`` (a group, as gathered) of the chunks at ring offsets ``0, 1, ...`` on ``rank``:
    offset ``i`` is the chunk that started ``i`` ring positions before it."""
    me, n = members.index(rank), len(members)
    return [(me - i) % n for i in range(n)]


def replay_inputs(call: AttentionCall, data: dict[str, Tensor], gen: torch.Generator) -> dict:
    """The chunks of every ring offset of rank 0 and the partials its reduce steps receive, from the gathered
    chunks ``data`` (``q``, ``do``, ``kv``, ``stats``: the collective rows' layout), on their device. Received
    forward partials hold random rows with the lse of the rows they stand for; backward ones random gradients."""
    plan = call.plan
    qi, ki = offsets(plan.tiling.q_group(0)), offsets(plan.tiling.kv_group(0))
    q, do, kv, stats = data["q"][qi], data["do"][qi], data["kv"][ki], data["stats"][qi]
    acc, (a, b) = stats.dtype, (len(qi), len(ki))

    def randn(shape):
        return torch.randn(shape, generator=gen, device=q.device, dtype=acc)

    rows = [torch.cat((randn(q.shape[1:]).flatten(), stats[(s + 2) % a, 0].flatten())) for s in range(a - 1)]
    q_side = torch.stack((q, do), dim=1) if plan.backward == "regather" else do
    return {
        "q": q,
        "do": do,
        "kv": kv,
        "forward": ({"q": [q], "kv": [kv]}, {"q": rows}),
        "backward": (
            {"q": [q_side, stats], "kv": [kv] if plan.backward == "regather" else []},
            {"q": [randn(q.shape[1:]) for _ in range(a - 1)], "kv": [randn(kv.shape[1:]) for _ in range(b - 1)]},
        ),
    }


def replay_forward(call: AttentionCall, inputs: dict) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Rank 0's forward of the overlapped schedule: ``(out, lse, gathered)`` as
    :meth:`~mesh_cp.runtime.executors.OverlapExecutor.forward` returns them."""
    phase = ForwardReplay(call, *inputs["forward"])
    phase.run()
    return (*phase.result(inputs["q"].dtype), phase.gathered())


def replay_backward(call: AttentionCall, inputs: dict, saved: Saved) -> tuple[Tensor, Tensor]:
    """Rank 0's backward of the overlapped schedule given its forward's ``saved``: ``dq`` and the pair ``dk, dv`` in
    the input dtype."""
    phase = BackwardReplay(call, inputs["do"][0], saved, *inputs["backward"])
    phase.run()
    return phase.result("q", saved.q.dtype), phase.result("kv", saved.k.dtype)


def saved_of(inputs: dict, out: Tensor, lse: Tensor, gathered: tuple[Tensor, ...]) -> Saved:
    """What rank 0's forward keeps for backward, from its output."""
    k, v = inputs["kv"][0]
    out = out.to(inputs["q"].dtype, copy=True)  # not a view of a row buffer a later run writes
    return Saved(q=inputs["q"][0], k=k, v=v, out=out, lse=lse, gathered=gathered)


def overlap_kernel_calls(call: AttentionCall, phase: str = "forward") -> int:
    """Kernel calls of rank 0's ``phase`` in the overlapped schedule: the calls of the programs of its runs."""
    return sum(len(call.run(0, phase, t)[1].calls) for t in call.plan.overlap_calls(0, phase))


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


def train_rows(args, kernel, L: int, heads: int, kv_heads: int, mask_name: str, mask) -> list[dict]:
    """Rank 0's forward and backward in each schedule of ``args.schedules`` on the same chunks, and the single call of
    the same FLOPs (timed once, shared by the rows)."""
    device, dtype, dim = args.device, args.dtype, args.head_dim
    a, b = most_square_tile(args.world)
    shape = AttentionShape(batch=1, seq_local=L, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=dtype.itemsize)
    counting = CountingKernel(kernel)
    doc_ids = None if mask is None else document_ids(mask, 1, shape.seq_local * args.world, device)
    calls = {}
    for schedule in ("collective", *args.schedules):
        plan = make_plan(Tiling(args.world, a, b), shape, causal=True, layout="zigzag", schedule=schedule, mask=mask)
        calls[schedule] = AttentionCall(mesh=NoMesh(), plan=plan, kernel=counting, scale=dim**-0.5, doc_ids=doc_ids)
    gen = torch.Generator(device).manual_seed(args.seed)
    data = {
        "q": torch.randn((a, 1, L, heads, dim), generator=gen, device=device, dtype=dtype),
        "do": torch.randn((a, 1, L, heads, dim), generator=gen, device=device, dtype=dtype),
        "kv": torch.randn((b, 2, 1, L, kv_heads, dim), generator=gen, device=device, dtype=dtype),
    }
    plan = calls["collective"].plan
    with torch.no_grad():
        # the rows' lse and delta from rank 0's partials: what backward reads (collective) or the ring brings (overlap)
        o_acc, lse_acc = forward_blocks(calls["collective"], 0, data["q"], data["kv"])
        delta = torch.stack([attention_delta(data["do"][i], o_acc[i]) for i in range(a)])
        data["stats"] = torch.stack((lse_acc, delta), dim=1)  # (a, 2, B, H, L)
        del o_acc, lse_acc, delta
        pairs = plan.pairs(0)
        single = single_call(args, kernel, heads, kv_heads, pairs)
        rows = []
        for schedule in args.schedules:
            if args.profile:
                print(f"L {L:,} {heads}:{kv_heads} {mask_name} {schedule}: rank 0 forward + backward")
            times = (collective_times if schedule == "collective" else overlap_times)(args, calls[schedule], data)
            seconds = (times["ms_fwd"] + times["ms_bwd"]) / 1e3
            rate = flops(pairs, heads, dim) / seconds / 1e12
            blocks = plan.blocks(0)
            rows.append(
                {
                    "kind": "train",
                    "schedule": schedule,
                    "L": L,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "mask": mask_name,
                    "tile": f"{a}x{b}",
                    "blocks": len(blocks),
                    "masked_blocks": sum(w.kind is MaskKind.MASKED for w in blocks),
                    **times,
                    "pairs": pairs,
                    "ms": seconds * 1e3,
                    "tflops": rate,
                    **single,
                    "fraction": rate / single["single_tflops"],
                }
            )
    return rows


def measure(args, call: AttentionCall, forward: Callable[[], object], backward: Callable[[], object]) -> dict:
    """Kernel calls of one ``forward()``, peak memory and best times of ``forward()`` and ``backward()``."""
    device, counting = args.device, call.kernel
    counting.calls = 0
    _, peak_fwd = peak_allocated(forward, device)
    calls = counting.calls
    t_fwd, _ = timed(forward, args.repeats, device)
    _, peak_bwd = peak_allocated(backward, device)
    t_bwd, _ = timed(backward, args.repeats, device)
    if args.profile:
        print(profile_table(lambda: (forward(), backward()), device))
    return {
        "kernel_calls": calls,
        "peak_mib": [None if p is None else p / 2**20 for p in (peak_fwd, peak_bwd)],
        "ms_fwd": t_fwd * 1e3,
        "ms_bwd": t_bwd * 1e3,
    }


def collective_times(args, call: AttentionCall, data: dict[str, Tensor]) -> dict:
    """The collective schedule's compute on rank 0: its calls on the gathered chunks (no collectives)."""
    q_all, do_all, kv_all, stats = data["q"], data["do"], data["kv"], data["stats"]
    backend = "nccl" if args.device.type == "cuda" else "gloo"  # the memory model's GPU or CPU kernel share
    times = measure(
        args,
        call,
        lambda: forward_blocks(call, 0, q_all, kv_all),
        lambda: backward_blocks(call, 0, q_all, do_all, stats, kv_all),
    )
    return {
        **times,
        "plan_kernel_calls": call.kernel_calls(0),
        "units": len(call.units(0)),
        "model_mib": [compute_bytes(call.plan, phase, backend=backend) / 2**20 for phase in ("forward", "backward")],
    }


def overlap_times(args, call: AttentionCall, data: dict[str, Tensor]) -> dict:
    """The overlapped schedule on rank 0, replayed without communication (Note [Replayed overlapped schedule]);
    backward from the saved output of one forward."""
    inputs = replay_inputs(call, data, torch.Generator(args.device).manual_seed(args.seed + 3))
    saved = saved_of(inputs, *replay_forward(call, inputs))
    times = measure(args, call, lambda: replay_forward(call, inputs), lambda: replay_backward(call, inputs, saved))
    return {
        **times,
        "plan_kernel_calls": overlap_kernel_calls(call),
        "units": len(call.plan.overlap_calls(0, "forward")),
        "model_mib": [None, None],  # mesh_cp.sim.memory.compute_bytes models the collective schedule only
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


def mib(value: float | None) -> str:
    """A model's MiB, or ``-`` where none models the row."""
    return "-" if value is None else f"{value:.0f}"


def markdown(meta: dict, rows: list[dict]) -> str:
    train = [r for r in rows if r["kind"] == "train"]
    decode = [r for r in rows if r["kind"] == "decode"]
    lines = [
        f"P = {meta['world']} (tile {meta['tile']}), {meta['device']}, {meta['dtype']}, head dim {meta['head_dim']}, "
        f"kernel {meta['kernel']}, threads {meta['threads']}, document lengths / {meta['doc_scale']}, "
        f"best of {meta['repeats']}",
        "",
        "| L | heads | mask | schedule | blocks (masked) | kernel calls | fwd ms | bwd ms | TFLOP/s | "
        "single call: tokens | ms | TFLOP/s | fraction |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train:
        lines.append(
            f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['mask']} | {r['schedule']} | {r['blocks']} "
            f"({r['masked_blocks']}) | {r['kernel_calls']} | {r['ms_fwd']:.2f} | {r['ms_bwd']:.2f} | {r['tflops']:.4g} | "
            f"{r['single_tokens']:,} | {r['single_ms']:.2f} | {r['single_tflops']:.4g} | {r['fraction']:.2f} |"
        )
    measured = [r for r in train if r["peak_mib"][0] is not None]
    if measured:
        lines += ["", "Memory beyond the chunks (MiB): measured peak, and `mesh_cp.sim.memory.compute_bytes`", ""]
        lines += [
            "| L | heads | mask | schedule | fwd measured | fwd model | bwd measured | bwd model |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in measured:
            (pf, pb), (mf, mb) = r["peak_mib"], (mib(m) for m in r["model_mib"])
            lines.append(
                f"| {r['L']:,} | {r['heads']}:{r['kv_heads']} | {r['mask']} | {r['schedule']} | {pf:.0f} | {mf} | "
                f"{pb:.0f} | {mb} |"
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
    p.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated: collective, overlap (default: both)"
    )
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
    args.schedules = tuple(args.schedules.split(","))
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if bad or not args.schedules:
        p.error(f"--schedules {','.join(bad)}: each must be one of {', '.join(SCHEDULES)}")
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
                rows += train_rows(args, kernel if mask is None else masked_kernel, L, h, hkv, name, mask)
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
        "schedules": list(args.schedules),
    }
    print(markdown(meta, rows) + (imbalance_table(args) if args.balance else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
