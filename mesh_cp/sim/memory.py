"""The peak-memory model of an attention plan: bytes one rank holds at the peak of a phase.

Pure Python (no torch), over the same :class:`~mesh_cp.core.AttentionPlan` the executors run. The
kernel's share is calibrated on the CPU flash kernel for ``backend="gloo"`` and on PyTorch's CUDA flash kernel in bf16
for ``backend="nccl"`` (NCCL runs on GPUs); ``backend`` also says how the process group stages collectives (gloo
copies an all-gather through a flat buffer of its output, NCCL gathers in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mesh_cp.core.options import Phase, check_option
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.core.program import Call, KernelMode, Program, overlap_programs, rank_program, run_program
from mesh_cp.core.segments import key_count

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl")


def peak_bytes(
    plan: AttentionPlan, phase: Phase, rank: int = 0, *, backend: Backend = "gloo", kernel: str | None = None
) -> int:
    """Bytes mesh rank ``rank`` allocates at the peak of ``phase`` of ``plan``, beyond its inputs and saved tensors.

    The mesh's peak, on ``plan.mesh_shape``: what the schedule holds — gathered Q/KV chunks (all of them for
    ``backward="reuse"``, which keeps them from forward to backward), fp32 accumulators of partial outputs and
    gradients (the kernels' own outputs for the rows of ``plan.partials="input"``), transfer buffers — plus one
    block's kernel outputs and temporaries. The overlapped schedule frees
    a chunk after its last use, so its peak follows its path; the collective schedule holds every gathered chunk
    and the reduce buffers together, and on ``backend="gloo"`` a flat copy of each all-gather's output while it
    runs. With ``head_parallel > 1``, plus the head-layout copies the head exchange holds at its peak: forward
    all it moves (q, k, v, held while the mesh computes, and out and lse, exchanged while they are still held);
    backward what it moves *in* (dO and the lse's gradient), and dq, dk, dv exchanged out after the mesh has freed its
    buffers: four copies of them (theirs, their rows in exchange order, the packed send and the receive buffer)
    where they exceed the mesh's peak (measured within the tolerance of tests/runtime/test_memory.py).

    The calls are read from the rank's program for ``kernel`` (:data:`FOOTPRINTS`; ``None``: the backend's
    :data:`DEFAULT_KERNEL`): the keys it lays once per phase and each call's share (Note [Rank programs] in
    :mod:`mesh_cp.core.program`).
    """
    check_option("phase", phase)
    fp = footprint(kernel, backend)
    if plan.schedule == "collective":
        mesh = _collective_peak(plan, phase, rank, staged=backend == "gloo", fp=fp)
    else:
        mesh = _overlap_peak(plan, phase, rank, fp)
    held = sum(t.piece_bytes * t.group_size for t in plan.all_to_alls(phase) if t.what in HELD)
    # The exchange out of dq, dk, dv: the mesh's gradients, their rows in exchange order, the packed send buffer
    # and the received one (heads.grads_from_heads), after the mesh has freed its buffers.
    out = sum(4 * t.piece_bytes * t.group_size for t in plan.all_to_alls(phase) if t.what == "dq,dk,dv")
    return max(mesh, out) + held


HELD = ("q,k,v", "out", "lse", "dout", "dlse")
"""The head exchange's tensors whose head-layout copies count in the peak (:func:`peak_bytes`)."""


@dataclass(frozen=True)
class KernelFootprint:
    """What a kernel holds around its calls, as the memory model reads it: the :class:`KernelMode` its programs are
    built for (Note [Rank programs] in :mod:`mesh_cp.core.program`), and what it allocates per call."""

    mode: KernelMode
    native_gqa: bool = False
    """K and V keep their heads (else they are repeated to every query head inside the call)."""
    gathers: bool = False
    """Its varlen calls gather the rows of their sequences (flash-attn 2's varlen API); with :attr:`KernelMode.gaps`
    only laid segments are gathered."""
    backward_rows: float = 0.0
    """Temporaries of a backward call in query chunk-rows of the input dtype (six for PyTorch's CUDA flash kernel in
    bf16, measured with scripts/bench_rank.py on an H100: the fp32 ``rowsum(dO * O)`` construction and dq
    accumulation)."""


def _mode(keywords: set[str], gaps: bool = False) -> KernelMode:
    return KernelMode(frozenset(keywords), None, gaps)


FOOTPRINTS: dict[str, KernelFootprint] = {
    "reference": KernelFootprint(_mode({"mask", "segments", "softcap"})),
    "cpu_flash": KernelFootprint(_mode({"mask"})),
    "cuda_sdpa": KernelFootprint(_mode({"mask"}), backward_rows=6),
    "cuda_flash": KernelFootprint(_mode({"segments"}, gaps=True), native_gqa=True, gathers=True, backward_rows=6),
    "flash_attn": KernelFootprint(
        _mode({"segments", "softcap"}, gaps=True), native_gqa=True, gathers=True, backward_rows=6
    ),
    "cuda_cudnn": KernelFootprint(_mode(set()), native_gqa=True, backward_rows=6),
    "flash_attn3": KernelFootprint(_mode(set()), native_gqa=True, backward_rows=6),
    "flash_attn4": KernelFootprint(_mode({"segments", "softcap"}, gaps=True), native_gqa=True, backward_rows=6),
}
"""The footprint of every kernel of :mod:`mesh_cp.kernels` by name (tests/core/test_memory_calibration.py checks that
the modes match the kernels' capabilities)."""

DEFAULT_KERNEL = {"gloo": "cpu_flash", "nccl": "cuda_flash"}
"""The kernel a backend's peak is modelled with when none is named."""


def footprint(kernel: str | None, backend: Backend) -> KernelFootprint:
    """The :class:`KernelFootprint` of kernel ``kernel`` (``None``: the backend's :data:`DEFAULT_KERNEL`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not modelled; choose one of {list(BACKENDS)}")
    name = DEFAULT_KERNEL[backend] if kernel is None else kernel
    if name not in FOOTPRINTS:
        raise ValueError(f"kernel {name!r} has no memory footprint; choose one of {sorted(FOOTPRINTS)}")
    return FOOTPRINTS[name]


def _call_bytes(plan: AttentionPlan, c: Call, phase: Phase, fp: KernelFootprint) -> int:
    """Outputs and temporaries of one kernel call of a program. Forward: its output and the merge's weighted copy;
    backward: dq, dk, dv, the kernel's own out and :attr:`KernelFootprint.backward_rows`; K, V repeated to every head
    without native GQA; a varlen call that gathers adds its gathered rows (a laid key as often as it is laid, and in
    backward the fp32 sum of their dk, dv, Note [Laid keys] in :mod:`mesh_cp.kernels.varlen`)."""
    s = plan.mesh_shape
    q_bytes, kv_bytes = plan.chunk_bytes()
    rq = (c.q_rows[1] - c.q_rows[0]) / s.seq_local
    rk = (c.keys[1] - c.keys[0]) / s.seq_local
    gqa = rk if s.kv_heads != s.heads and not fp.native_gqa else 0.0
    keys = 0
    segments = c.extra.get("segments")
    if segments is not None and fp.gathers:
        laid = any(len(seg) == 5 for row in segments for seg in row)
        if laid or not fp.mode.gaps:
            gathered = sum(key_count(seg) for row in segments for seg in row) / len(segments) / s.seq_local
            keys = int(gathered * kv_bytes + 2 * rq * q_bytes)  # the gathered rows and the output's
            if laid and phase == "backward":  # the fp32 sum of the laid keys' dk, dv
                keys += int(rk * kv_bytes // s.itemsize * s.acc_itemsize)
    if phase == "forward":
        expanded = gqa * q_bytes // (1 if c.laid else 2)  # K, V repeated to every head
        merge = 0 if c.first else s.chunk_elems * s.acc_itemsize  # a first write is a copy, not a merge
        return keys + int(rq * (q_bytes + merge) + expanded)
    return keys + int((2 * rq + 2 * rk + 1.5 * gqa + fp.backward_rows * rq) * q_bytes)


def _program_bytes(plan: AttentionPlan, prog: Program, phase: Phase, fp: KernelFootprint) -> int:
    """The keys a program lays for its phase (none when they are one run of one chunk: a view) and its largest
    call's share."""
    return _laid_bytes(plan, prog) + _largest_call(plan, prog, phase, fp)


def _largest_call(plan: AttentionPlan, prog: Program, phase: Phase, fp: KernelFootprint) -> int:
    return max((_call_bytes(plan, c, phase, fp) for c in prog.calls), default=0)


def _units(plan: AttentionPlan) -> dict[str, int]:
    s = plan.mesh_shape
    q_bytes, kv_bytes = plan.chunk_bytes()
    acc = s.chunk_elems * s.acc_itemsize
    return {
        "q": q_bytes,
        "kv": kv_bytes,
        "acc": acc,
        # the collective schedule's row partial of o or dq: fp32, or the kernel's own output (Note [Partials as
        # computed] in mesh_cp.core.row_partials)
        "row": q_bytes if plan.partials == "input" else acc,
        "kv_acc": kv_bytes // s.itemsize * s.acc_itemsize,
        "stats": s.stats_elems * s.acc_itemsize,
    }


def _collective_peak(plan: AttentionPlan, phase: Phase, rank: int, staged: bool, fp: KernelFootprint) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    compute = _compute_stage(plan, phase, rank, fp)  # accumulators, the laid keys and the largest call
    prog = rank_program(plan, rank, fp.mode)
    laid = _laid_bytes(plan, prog)
    # the gathered K, V are freed once laid when every call reads the layout and backward does not reuse them
    freed = b * u["kv"] if laid and plan.backward == "regather" and all(c.laid for c in prog.calls) else 0
    if phase == "forward":
        rows = a * (u["row"] + u["stats"])
        gathered = a * u["q"] + b * u["kv"]
        # gloo stages an all-gather through a flat copy of its output (NCCL gathers in place)
        stages = [
            a * u["q"] * (2 if a > 1 and staged else 1),  # the all-gather of Q
            # K and V gathered into the parts of one buffer, one at a time (with one member: stacked)
            gathered + ((b * u["kv"] // 2 if staged else 0) if b > 1 else u["kv"]),
            gathered + laid,  # the keys laid
            gathered - freed + compute,  # block compute
            # the partials sent and received (merged into the first); gloo stages a list of them through flat copies
            gathered - freed + 2 * rows + (2 * a * u["row"] if staged and plan.partials == "input" else 0)
            if a > 1
            else 0,
        ]
        return max(stages)
    regather = plan.backward == "regather"
    gathered = (a * 2 * u["q"] + b * u["kv"]) if regather else a * u["q"]
    stats = (2 * a + 3) * u["stats"]
    grads = 2 * (a * u["row"] + b * u["kv_acc"]) + u["row"] + u["kv_acc"]
    return gathered + stats + max(grads - freed, compute - freed, laid + a * u["row"])


def _laid_bytes(plan: AttentionPlan, prog: Program, whole: bool = False) -> int:
    """Bytes of the keys a program lays for its phase (``whole``: of the phase's layout; none when it is one run of one
    chunk: a view)."""
    rows = (0 if prog.view else prog.layout_rows) if whole else prog.laid_rows
    return int(rows / plan.mesh_shape.seq_local * plan.chunk_bytes()[1])


def compute_bytes(
    plan: AttentionPlan, phase: Phase, rank: int = 0, *, backend: Backend = "gloo", kernel: str | None = None
) -> int:
    """What the collective schedule allocates around its kernel calls on mesh rank ``rank``, beyond the gathered
    chunks and the rows' statistics: the row (forward) or gradient (backward) accumulators (fp32, or for
    ``plan.partials="input"`` the kernel's outputs) and the largest call's share (the block-compute stage of
    :func:`peak_bytes`, which a one-device benchmark measures alone)."""
    check_option("phase", phase)
    fp = footprint(kernel, backend)
    if plan.schedule != "collective":
        raise ValueError(f"compute_bytes models the collective schedule; this plan's is {plan.schedule!r}")
    return _compute_stage(plan, phase, rank, fp)


def _compute_stage(plan: AttentionPlan, phase: Phase, rank: int, fp: KernelFootprint) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    kernel = _program_bytes(plan, rank_program(plan, rank, fp.mode), phase, fp)
    if phase == "forward":
        return a * (u["row"] + u["stats"]) + kernel
    return a * u["row"] + b * u["kv_acc"] + kernel


def _pieces_bytes(plan: AttentionPlan, rank: int, phase: Phase, fp: KernelFootprint, partial: dict) -> dict[int, int]:
    """Per action of the overlapped schedule, the bytes its partials held as pieces add (Note [Partials as pieces] in
    :mod:`mesh_cp.runtime.partials`): a call whose rows meet a piece combines them into new tensors while both are
    held, and a partial sent from pieces gets its buffer while they are held. ``partial`` the bytes of a whole one per
    ring."""
    seq, sched = plan.mesh_shape.seq_local, plan.overlap(phase)
    held: dict[tuple[str, int], list[tuple[int, int]]] = {}  # pieces' rows per (ring, offset); absent: a buffer
    made: set[tuple[str, int]] = set()  # offsets whose partial is a buffer
    extra: dict[int, int] = {}
    runs = {start: run_program(plan, rank, phase, start, fp.mode)[1] for start in plan.overlap_calls(rank, phase)}
    for t, act in enumerate(sched.actions):
        if act.op == "compute" and t in runs:
            writes = [(("q", c.slot), c.q_rows) for c in runs[t].calls]
            if phase == "backward":
                writes += [(("kv", col), rows) for c in runs[t].calls for col, _, rows, _ in c.pieces]
            for key, (start, stop) in writes:
                if key in made:
                    continue
                spans = held.setdefault(key, [])
                meet = sum(max(0, min(stop, s1) - max(start, s0)) for s0, s1 in spans)
                # one combine at a time; in backward only a dq that is sent on, as measured on CPU (tests/runtime/
                # test_memory.py): dk, dv and the rank's own dq combine below the peak of the calls around them
                if phase == "forward" or (key[0] == "q" and key[1] != 0):
                    extra[t] = max(extra.get(t, 0), partial[key[0]] * meet // seq)
                spans.append((start, stop))
        elif act.op == "launch" and act.step.kind == "reduce":
            key = (act.step.ring, act.step.index + 1)
            if held.pop(key, None) is not None:
                extra[t] = extra.get(t, 0) + partial[act.step.ring]
            made.discard(key)
        elif act.op == "wait" and act.step.kind == "reduce":
            key = (act.step.ring, (act.step.index + 2) % (plan.tiling.a if act.step.ring == "q" else plan.tiling.b))
            held.pop(key, None)
            made.add(key)
    return extra


def _overlap_peak(plan: AttentionPlan, phase: Phase, rank: int, fp: KernelFootprint) -> int:
    u, a, b = _units(plan), plan.tiling.a, plan.tiling.b
    sched = plan.overlap(phase)
    keep = plan.backward == "reuse"
    if phase == "forward":
        # Partial rows are sent as the buffer they are in: only the receive buffer is extra while in flight.
        partial = {"q": u["acc"] + u["stats"]}
        alive = {"q": sched.partials_alive("q", sent_at="wait")}
        inflight_bytes = dict(partial)
        fixed = 0
        q_unit, kv_unit, own_input = u["q"], u["kv"], not keep
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
        kv_unit, own_input = (0 if keep else u["kv"]), True
    # Offset 0 holds the rank's own chunks as they are (q, k, v, dO, the lse and delta: parts never stacked), nothing
    # beyond them, unless forward keeps its chunks in stores.
    programs = overlap_programs(plan, rank, phase, fp.mode)
    last_use = {"q": sched.last_use("q"), "kv": programs.kv_last_use}  # calls on the layout read the layout
    last = {ring: last_use[ring].get(0, -1) for ring in ("q", "kv")}
    units = {}  # what the run of every compute action holds (Note [Rows of the overlapped schedule])
    for start, (end, prog) in programs.runs.items():
        for t in range(start, end):
            units[t] = _largest_call(plan, prog, phase, fp)
    # the phase's layout, from the run that lays its first keys to the last run that reads it (Note [Keys laid once
    # per phase] in mesh_cp.core.program)
    span, layout = programs.layout_span, 0
    if span is not None:
        layout = _laid_bytes(plan, next(prog for _, prog in programs.runs.values()), whole=True)
    pieces = _pieces_bytes(plan, rank, phase, fp, partial)
    inflight: dict[str, int] = {}
    peak = 0
    for t, (act, (nq, nkv)) in enumerate(zip(sched.actions, sched.chunks_alive(last_use), strict=True)):
        if act.op == "launch" and act.step.kind == "reduce":
            inflight[act.step.ring] = inflight_bytes[act.step.ring]
        own = (q_unit if last["q"] >= t else 0) + (kv_unit if last["kv"] >= t else 0) if own_input else 0
        held = nq * q_unit + nkv * kv_unit - own
        partials = sum(alive[ring][t] * partial[ring] for ring in partial)
        kernel = units[t] if act.op == "compute" else 0
        kernel += layout if span is not None and span[0] <= t <= span[1] else 0
        now = fixed + held + partials + sum(inflight.values()) + kernel + pieces.get(t, 0)
        peak = max(peak, now)
        if act.op == "wait" and act.step.kind == "reduce":
            inflight.pop(act.step.ring, None)
    return peak
