"""The peak-memory model of an attention plan: bytes one rank holds at the peak of a phase.

Pure Python (no torch), over the same :class:`~mesh_cp.core.AttentionPlan` the executors run. The
kernel's share is calibrated on the CPU flash kernel for ``backend="gloo"`` and on PyTorch's CUDA flash kernel in bf16
for ``backend="nccl"`` (NCCL runs on GPUs); ``backend`` also says how the process group stages collectives (gloo
copies an all-gather through a flat buffer of its output, NCCL gathers in place).
"""

from __future__ import annotations

from typing import Literal

from mesh_cp.core.blocks import BlockWork, ChunkCall, MaskKind
from mesh_cp.core.options import Phase, check_option
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.core.segments import key_count

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl")


def peak_bytes(plan: AttentionPlan, phase: Phase, rank: int = 0, *, backend: Backend = "gloo") -> int:
    """Bytes mesh rank ``rank`` allocates at the peak of ``phase`` of ``plan``, beyond its inputs and saved tensors.

    The mesh's peak, on ``plan.mesh_shape``: what the schedule holds — gathered Q/KV chunks (all of them for
    ``backward="reuse"``, which keeps them from forward to backward), fp32 accumulators of partial outputs and
    gradients, transfer buffers — plus one block's kernel outputs and temporaries. The overlapped schedule frees
    a chunk after its last use, so its peak follows its path; the collective schedule holds every gathered chunk
    and the reduce buffers together, and on ``backend="gloo"`` a flat copy of each all-gather's output while it
    runs. With ``head_parallel > 1``, plus the head-layout copies the head exchange holds at its peak: forward
    all it moves (q, k, v, held while the mesh computes, and out and lse, exchanged while they are still held);
    backward what it moves *in* (dO and the lse's gradient): dq, dk, dv are exchanged after the mesh has freed its
    buffers and stay below the mesh's peak (measured within the tolerance of tests/runtime/test_memory.py).
    """
    check_option("phase", phase)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not modelled; choose one of {list(BACKENDS)}")
    if plan.schedule == "collective":
        mesh = _collective_peak(plan, phase, rank, staged=backend == "gloo")
    else:
        mesh = _overlap_peak(plan, phase, rank, gpu=backend == "nccl")
    return mesh + sum(t.piece_bytes * t.group_size for t in plan.all_to_alls(phase) if t.what in HELD)


HELD = ("q,k,v", "out", "lse", "dout", "dlse")
"""The head exchange's tensors whose head-layout copies count in the peak (:func:`peak_bytes`)."""


def _kernel_bytes(plan: AttentionPlan, w: BlockWork | ChunkCall | None, phase: Phase, gpu: bool = False) -> int:
    """Outputs and temporaries of one kernel call. CPU flash kernel (``gpu=False``): forward its output and the
    merge's weighted copy; backward dq, dk, dv and the kernel's own out; GQA adds the K, V repeated to every head.
    CUDA fused kernels in bf16 (``gpu=True``, measured with scripts/bench_rank.py on an H100, docs/performance.md):
    no repeated K, V (native GQA), a masked block's varlen call adds its gathered rows (a split block's laid keys as
    often as they are laid, and in backward the fp32 sum of their dk, dv, Note [Laid keys]), and the backward adds
    six chunks of its rows (the fp32 temporaries of ``rowsum(dO * O)``'s construction and of the dq accumulation). A
    :class:`ChunkCall` adds its keys laid end to end (Note [One call per Q chunk]): those of its largest row group,
    as a kernel without ``segments`` holds them (with ``segments`` all groups' keys are held together, at most about
    1.5 times more for a zig-zag chunk); on CPU its forward holds those keys repeated to every head beside them
    (GQA), twice a block's share."""
    if w is None:
        return 0
    s = plan.mesh_shape
    q_bytes = s.chunk_elems * s.itemsize
    rq = (w.q_rows[1] - w.q_rows[0]) / s.seq_local
    if isinstance(w, ChunkCall):
        # the per-group calls hold one group's keys at a time; one call with segments holds all of them
        rk = max(g.key_count for g in w.groups) / s.seq_local
        keys = int(rk * plan.chunk_bytes()[1])
    else:
        rk, keys = (w.kv_rows[1] - w.kv_rows[0]) / s.seq_local, 0
    gqa = rk if s.kv_heads != s.heads and not gpu else 0.0
    if gpu and isinstance(w, BlockWork) and w.kind is MaskKind.MASKED:
        laid = _laid_keys(plan, w)
        gathered = rk if laid is None else laid / s.seq_local
        keys = int(gathered * plan.chunk_bytes()[1] + 2 * rq * q_bytes)  # a varlen call's gathered rows and output's
        if laid is not None and phase == "backward":  # the fp32 sum of the laid keys' dk, dv
            keys += int(rk * plan.chunk_bytes()[1] // s.itemsize * s.acc_itemsize)
    if phase == "forward":
        expanded = gqa * q_bytes // (1 if isinstance(w, ChunkCall) else 2)  # K, V repeated to every head
        return keys + int(rq * (q_bytes + s.chunk_elems * s.acc_itemsize) + expanded)
    return keys + int((2 * rq + 2 * rk + 1.5 * gqa + (6 * rq if gpu else 0)) * q_bytes)


def _laid_keys(plan: AttentionPlan, w: BlockWork) -> float | None:
    """Key rows per batch row that a masked block's varlen call gathers when its segments lay keys end to end (split
    documents, Note [Block segments]): a key part two query parts see is gathered twice. ``None`` for a block whose
    segments are plain (its key rows, at most) or that runs as its runs."""
    segments = plan.block_segments(w)
    if segments is None or all(len(seg) == 6 for row in segments for seg in row):
        return None
    return sum(key_count(seg) for row in segments for seg in row) / len(segments)


def _units(plan: AttentionPlan) -> dict[str, int]:
    s = plan.mesh_shape
    q_bytes, kv_bytes = plan.chunk_bytes()
    acc = s.chunk_elems * s.acc_itemsize
    return {
        "q": q_bytes,
        "kv": kv_bytes,
        "acc": acc,
        "kv_acc": kv_bytes // s.itemsize * s.acc_itemsize,
        "stats": s.stats_elems * s.acc_itemsize,
    }


def _collective_peak(plan: AttentionPlan, phase: Phase, rank: int, staged: bool) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    compute = _compute_stage(plan, phase, rank, gpu=not staged)  # accumulators and the largest call
    if phase == "forward":
        rows = a * (u["acc"] + u["stats"])
        gathered = a * u["q"] + b * u["kv"]
        # gloo stages an all-gather through a flat copy of its output (NCCL gathers in place)
        stages = [
            a * u["q"] * (2 if a > 1 else 1),  # the all-gather of Q
            gathered + u["kv"] + (b * u["kv"] if b > 1 else 0),  # the all-gather of the stacked K, V
            gathered + compute,  # block compute
            gathered + 3 * rows + u["acc"] + u["stats"] if a > 1 else 0,  # packed, received, merged row
        ]
        return max(stages)
    regather = plan.backward == "regather"
    gathered = (a * 2 * u["q"] + b * u["kv"]) if regather else a * u["q"]
    stats = (2 * a + 3) * u["stats"]
    grads = 2 * (a * u["acc"] + b * u["kv_acc"]) + u["acc"] + u["kv_acc"]
    return gathered + stats + max(grads, compute)


def compute_bytes(plan: AttentionPlan, phase: Phase, rank: int = 0, *, backend: Backend = "gloo") -> int:
    """What the collective schedule allocates around its kernel calls on mesh rank ``rank``, beyond the gathered
    chunks and the rows' statistics: the fp32 row (forward) or gradient (backward) accumulators and the largest
    call's share (the block-compute stage of :func:`peak_bytes`, which a one-device benchmark measures alone)."""
    check_option("phase", phase)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not modelled; choose one of {list(BACKENDS)}")
    if plan.schedule != "collective":
        raise ValueError(f"compute_bytes models the collective schedule; this plan's is {plan.schedule!r}")
    return _compute_stage(plan, phase, rank, gpu=backend == "nccl")


def _compute_stage(plan: AttentionPlan, phase: Phase, rank: int, gpu: bool) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    kernel = max(_kernel_bytes(plan, w, phase, gpu) for w in plan.calls(rank))
    if phase == "forward":
        return a * (u["acc"] + u["stats"]) + kernel
    return a * u["acc"] + b * u["kv_acc"] + kernel


def _overlap_peak(plan: AttentionPlan, phase: Phase, rank: int, gpu: bool) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    sched = plan.overlap(phase)
    keep = plan.backward == "reuse"
    if phase == "forward":
        # Partial rows are packed into a copy when sent: the copy and the receive buffer are in flight.
        partial = {"q": u["acc"] + u["stats"]}
        alive = {"q": sched.partials_alive("q", sent_at="launch")}
        inflight_bytes = {"q": 2 * (u["acc"] + u["stats"])}
        fixed = 0
        q_unit, kv_unit, q0_input = u["q"], u["kv"], not keep
        if keep:  # the chunk stores are allocated whole
            fixed += a * u["q"] + b * u["kv"]
            q_unit = kv_unit = 0
    else:
        # Partial gradients are sent as they are: only the receive buffer is extra while in flight.
        partial = {"q": u["acc"], "kv": u["kv_acc"]}
        alive = {ring: sched.partials_alive(ring, sent_at="wait") for ring in partial}
        inflight_bytes = dict(partial)
        fixed = u["stats"]  # delta
        q_unit = (u["q"] if keep else 2 * u["q"]) + 2 * u["stats"]  # (dO) or (q, dO), with lse and delta
        kv_unit, q0_input = (0, True) if keep else (u["kv"], False)  # reuse: offset 0's dO is the input
    last_q = sched.last_use("q")
    units = {}  # the kernel call of every compute action: a row's on GPU kernels (Note [Rows of the overlapped schedule])
    for start, (end, call) in plan.overlap_calls(rank, phase).items():
        for t in range(start, end):
            units[t] = call if call is not None and gpu else plan.block_at(rank, *sched.actions[t].block)
    inflight: dict[str, int] = {}
    peak = 0
    for t, (act, (nq, nkv)) in enumerate(zip(sched.actions, sched.chunks_alive(), strict=True)):
        if act.op == "launch" and act.step.kind == "reduce":
            inflight[act.step.ring] = inflight_bytes[act.step.ring]
        held = nq * q_unit + nkv * kv_unit - (u["q"] if q0_input and last_q.get(0, -1) >= t else 0)
        partials = sum(alive[ring][t] * partial[ring] for ring in partial)
        kernel = _kernel_bytes(plan, units[t], phase, gpu) if act.op == "compute" else 0
        now = fixed + held + partials + sum(inflight.values()) + kernel
        peak = max(peak, now)
        if act.op == "wait" and act.step.kind == "reduce":
            inflight.pop(act.step.ring, None)
    return peak
