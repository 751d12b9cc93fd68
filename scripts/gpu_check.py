"""One-command GPU acceptance check of mesh_cp: a PASS/FAIL/SKIP table, non-zero exit on any FAIL.

    python scripts/gpu_check.py                          # everything, on the GPUs of this machine
    python scripts/gpu_check.py --sections kernels,hf    # some sections only (or --skip examples)
    python scripts/gpu_check.py --cases "cuda_flash bf16" # only the cases whose name matches
    python scripts/gpu_check.py --out gpu_check.md       # also write the versions and table as markdown
    python scripts/gpu_check.py --cpu-selftest           # the same checks on CPU (CI runs this)

Every case is isolated: an exception is that case's FAIL and the rest still run. Multi-process sections
run in spawned process groups; a process that dies or hangs in a case makes that case a FAIL (with the
signal, or the timeout) and the group is started again for the cases after it.

kernels   every block kernel of mesh_cp.kernels that runs on this device (flash_attn4, flash_attn3, cuda_cudnn, flash_attn,
          cuda_flash, cuda_sdpa, reference; cpu_flash on CPU) and ``"auto"`` with the kernel it chose, forward and
          backward against fp64 (out, lse, dq, dk, dv): causal and full, MHA 4:4 and GQA 8:2, head dims
          64, 128 and 72, 250 tokens (50 on CPU: lengths no block size divides), a case whose loss also depends
          on the lse with rows of dO zero or tiny (1e-7). Rule, per quantity: the error is at most 2x the
          error of plain PyTorch attention in that dtype (``scaled_dot_product_attention``; written out
          where the lse gets a gradient) plus a floor relative to max(1, largest reference value): eps/8
          for fp16/bf16 (flash-attn's rule), 1e-5 for fp32 (TF32 off). A kernel that is not registered,
          whose library is missing, or that states it cannot run the dtype or a case's head dim here
          (``mesh_cp.kernels.not_supported_reasons``) is SKIP with the reason.
mesh-nccl the mesh at P = number of GPUs over NCCL, one process per GPU (``torch.cuda.set_device`` first),
          with a lazily initialised default group and with one bound to the device (``device_id=``):
          every tile of P, both schedules, bf16/fp16/fp32, causal (zig-zag) and full (contiguous), MHA
          and GQA, a loss on out and lse, against fp64 by the rule above; ranks asking for different
          tiles must be refused.
mesh-gloo the same with 4 gloo ranks sharing GPU 0 (CUDA tensors, gloo collectives): P = 4 (1x4, 2x2,
          4x1) and P = 2 (pairs {0,1} and {2,3}), bf16 and fp32. The collective schedule runs first, so
          a backend that fails point to point (the overlapped schedule's ring steps) still shows the rest.
hf        a tiny Llama (MHA and GQA) with ``hf.attach``, against the single-process SDPA model on the
          same device: fp32 within 1e-4; bf16 weights, and fp32 weights under bf16 autocast, within 2x the
          SDPA model's error against the model in fp64; ``hf.generate`` (prefill under the mesh, Tree-Attention
          decoding over the sharded cache) of 3 left-padded prompts against single-process ``generate``: fp32
          logits of every step within 1e-4 and the same greedy tokens; with bf16 weights (on CUDA the flash
          decode kernel), each step's logits against the single-process model over the tokens it chose, within
          2x the bf16 model's error against fp64. At P = 4 on NCCL with 4 GPUs; otherwise
          at P = #GPUs on NCCL and at P = 4 on gloo ranks sharing GPU 0.
examples  the accelerate, DeepSpeed and Megatron examples under ``python -m torch.distributed.run`` with
          tiny settings on min(#GPUs, 4) processes (CP = all of them): the loss of every step against
          the example's ``--reference`` (accelerate, DeepSpeed), or a falling finite loss (Megatron);
          SKIP where a framework is not installed.

``--cpu-selftest`` runs the sections on CPU where they make sense (kernels: cpu_flash, reference and
auto; the mesh on 4 gloo ranks at P = 4 and 2 and the hf checks at P = 4, in one spawned group; NCCL
and the examples SKIP), so the checker's own logic is tested without a GPU
(``tests/scripts/test_gpu_check.py``). ``--inject-fault KERNEL[:MODE[:DTYPE]]`` plants a bug in a
kernel to show that the check catches it: ``wrong`` adds 0.1 to the last row of every block's output,
``raise`` raises in forward, ``abort`` ends the spawned rank's process in forward.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository root, for examples.common

from _gpu_check_worker import (  # noqa: E402
    DTYPE_NAMES,
    DTYPES,
    FAIL,
    FAULT_MODES,
    PASS,
    SKIP,
    AttentionInputs,
    Job,
    Row,
    Skip,
    Verdict,
    describe_error,
    judge,
    kernel_reasons,
    lookup_kernel,
    merge_verdicts,
    rank_entry,
    run_case,
)

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("kernels", "mesh-nccl", "mesh-gloo", "hf", "examples")
# The kernels the check expects on CUDA, whether or not they are registered yet (unregistered: SKIP).
CUDA_KERNELS = ("flash_attn4", "flash_attn3", "cuda_cudnn", "flash_attn", "cuda_flash", "cuda_sdpa")
CPU_KERNELS = ("cpu_flash",)
# (label, heads, kv_heads, head_dim) of the kernel cases.
KERNEL_SHAPES = (("4:4 d64", 4, 4, 64), ("8:2 d64", 8, 2, 64), ("4:4 d128", 4, 4, 128), ("8:2 d72", 8, 2, 72))
EXAMPLE_LOSS_TOL = 1e-3


@dataclasses.dataclass
class Options:
    """What to run and where, from the command line."""

    sections: tuple[str, ...]
    cpu: bool
    gpus: int
    faults: dict[str, tuple[str, str | None]]
    case_filter: str | None
    job_timeout_s: float
    example_timeout_s: float
    log_dir: str | None = None
    device: torch.device = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", 0)


# ----------------------------------------------------------------------------------------------------
# Versions
# ----------------------------------------------------------------------------------------------------


def package_version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "not installed"


def versions(opts: Options) -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()), ("torch", torch.__version__), ("CUDA", str(torch.version.cuda))]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability(0)
        rows += [
            ("GPU", f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.0f} GiB"),
            ("capability", f"sm_{major}{minor}"),
            ("NCCL", ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "-"),
        ]
    else:
        rows += [("GPU", "none")]
    rows += [
        ("mesh_cp", f"{package_version('mesh-cp')} ({git_commit()})"),
        ("transformers", package_version("transformers")),
        ("accelerate", package_version("accelerate")),
        ("flash-attn", package_version("flash-attn", "flash_attn")),
        ("deepspeed", package_version("deepspeed")),
        ("megatron-core", package_version("megatron-core", "megatron_core")),
        ("mode", "CPU self-test" if opts.cpu else "GPU"),
    ]
    return rows


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "no git"
    return out.stdout.strip() or "no git"


# ----------------------------------------------------------------------------------------------------
# Section: kernels (in this process)
# ----------------------------------------------------------------------------------------------------


def kernel_verdict(kernel, x: AttentionInputs) -> Verdict:
    """One kernel call forward and backward (``delta = rowsum(dO * O) - dlse``) against fp64."""
    out, lse = kernel.forward(x.q, x.k, x.v, causal=x.causal, scale=x.scale)
    if out.shape != x.q.shape or out.dtype != x.q.dtype:
        return Verdict(
            False, f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(x.q.shape)} {x.q.dtype}", math.inf
        )
    delta = (x.do.float() * out.float()).sum(-1).transpose(1, 2)
    if x.dlse is not None:
        delta = delta - x.dlse.float()
    extra = {}
    if x.dlse is not None and takes_lse_grad(kernel):
        extra["lse_grad"] = True  # the kernel may assume delta = rowsum(dO * O) unless told otherwise
    dq, dk, dv = kernel.backward(x.do, x.q, x.k, x.v, lse, delta.contiguous(), causal=x.causal, scale=x.scale, **extra)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    return judge(got, x.gold(), x.plain(), x.q.dtype)


def takes_lse_grad(kernel) -> bool:
    """Whether the kernel's backward has the ``lse_grad`` flag (BlockKernel.backward)."""
    backward = getattr(kernel, "inner", kernel).backward
    return "lse_grad" in inspect.signature(backward).parameters


def selected(opts: Options, case: str) -> bool:
    """Whether ``--cases`` (if given) selects this case."""
    return opts.case_filter is None or re.search(opts.case_filter, case) is not None


def in_process_faults(opts: Options) -> dict[str, tuple[str, str | None]]:
    """The planted faults for checks in this process: ``abort`` would end the checker itself."""
    return {name: fault for name, fault in opts.faults.items() if fault[0] != "abort"}


def kernel_rows(opts: Options) -> list[Row]:
    """Every kernel that runs on this device, per dtype: one row per shape (causal and full inside) and
    one with a gradient on the lse."""
    from mesh_cp.kernels import KERNEL_NAMES

    device = opts.device
    if opts.cpu:
        torch.set_num_threads(1)  # the spawned ranks run one thread each too; cores are few
        dtypes, batch, seq = (torch.float32, torch.bfloat16, torch.float16), 1, 50
        names = [*CPU_KERNELS, "reference", "auto", *CUDA_KERNELS]
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dtypes, batch, seq = (torch.bfloat16, torch.float16, torch.float32), 2, 250
        names = [*CUDA_KERNELS, "reference", "auto"]
    names += [n for n in KERNEL_NAMES if n not in names and not (n.startswith("cpu") and not opts.cpu)]
    rows: list[Row] = []
    for name in names:
        found: dict[torch.dtype, object] = {}
        for dtype in dtypes:
            try:
                found[dtype] = lookup_kernel(name, device, dtype, 64, in_process_faults(opts))
            except Skip as reason:
                found[dtype] = reason
            except Exception as err:  # noqa: BLE001 - a kernel that cannot even be built is its FAIL
                found[dtype] = err
        reasons = {str(k) for k in found.values() if isinstance(k, Skip)}
        if len(reasons) == 1 and all(isinstance(k, Skip) for k in found.values()):
            if selected(opts, name):
                rows.append(Row("kernels", name, SKIP, reasons.pop()))
            continue
        for dtype, kernel in found.items():
            rows += kernel_dtype_rows(name, kernel, dtype, device, batch, seq, opts)
    return rows


DECODE_SHAPES = (("MHA 8:8 d128", 8, 8, 128, 512, (0, 7, 512)), ("GQA 8:2 d64", 8, 2, 64, 256, (255, 1, 100)))
"""Flash decode cases: label, heads, K/V heads, head dim, slots per row, each row's filled slots."""


def flash_decode_rows(opts: Options) -> list[Row]:
    """The flash decode kernel (Note [Flash decode] in ``mesh_cp/runtime/decode.py``) over a static cache read in
    place, one query per row, against fp64 over each row's filled slots (a row of none and a full row included), with
    the positions form's local step in the same dtype as the plain reference of flash-attn's rule."""
    from mesh_cp.runtime.decode import flash_decode_reasons, lengths_attention, local_attention

    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for label, heads, kv_heads, dim, slots, lengths in DECODE_SHAPES:
            case = f"flash decode {DTYPE_NAMES[dtype]} {label}"
            if not selected(opts, case):
                continue

            def check(heads=heads, kv_heads=kv_heads, dim=dim, slots=slots, lengths=lengths, dtype=dtype) -> Verdict:
                gen = torch.Generator(opts.device).manual_seed(dim + heads)
                q = torch.randn(len(lengths), 1, heads, dim, generator=gen, device=opts.device, dtype=dtype)
                shape = (len(lengths), kv_heads, slots, dim)
                k, v = (torch.randn(shape, generator=gen, device=opts.device, dtype=dtype) for _ in "kv")
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # the (B, Hkv, C, D) cache read in place
                used = torch.tensor(lengths, dtype=torch.int32, device=opts.device)
                why = flash_decode_reasons(q, k)
                if why:
                    raise Skip("; ".join(why))
                with torch.no_grad():
                    out, lse = lengths_attention("cuda_flash", q, k, v, used, dim**-0.5)
                    positions = torch.where(torch.arange(slots, device=opts.device) < used[:, None], 0, -1)
                    zeros = torch.zeros(len(lengths), 1, dtype=torch.long, device=opts.device)
                    plain = local_attention(None, q, k, v, zeros, positions, dim**-0.5)
                    gold = local_attention(None, q.double(), k.double(), v.double(), zeros, positions, dim**-0.5)
                finite = torch.isfinite(gold[1])
                if not torch.equal(finite, torch.isfinite(lse)):
                    return Verdict(False, "lse is not -inf exactly where a row has no entry", math.inf)
                got = {"out": out, "lse": lse[finite]}
                return judge(got, {"out": gold[0], "lse": gold[1][finite]}, {"out": plain[0], "lse": plain[1][finite]},
                             dtype)  # fmt: skip

            rows.append(run_case("kernels", case, check, opts.device))
    return rows


def failed_row(section: str, case: str, err: Exception) -> Row:
    return Row(section, case, FAIL, describe_error(err), 0.0, math.inf)


def kernel_dtype_rows(name, kernel, dtype, device, batch, seq, opts) -> list[Row]:
    dname = DTYPE_NAMES[dtype]
    if not selected(opts, f"{name} {dname}"):
        pass
    elif isinstance(kernel, Skip):
        return [Row("kernels", f"{name} {dname}", SKIP, str(kernel))]
    elif isinstance(kernel, Exception):
        return [failed_row("kernels", f"{name} {dname}", kernel)]
    if isinstance(kernel, Exception):
        return []
    rows = []
    cases = [(label, h, kv, d, False) for label, h, kv, d in KERNEL_SHAPES]
    cases.append(("8:2 d64 lse grad", 8, 2, 64, True))
    if device.type == "cuda":  # the delta column past the kernels' head-dim limits: backward by parts
        cases += [("8:2 d192 lse grad", 8, 2, 192, True), ("8:2 d256 lse grad", 8, 2, 256, True)]
    for label, heads, kv_heads, dim, lse_grad in cases:
        why = None if name == "auto" else kernel_reasons(name, device, dtype, dim)
        if why and selected(opts, f"{name} {dname} {label}"):
            rows.append(Row("kernels", f"{name} {dname} {label}", SKIP, why))
        if why:
            continue

        def case(heads=heads, kv_heads=kv_heads, dim=dim, lse_grad=lse_grad) -> Verdict:
            # "auto" may choose by head dim: resolve it for this case's inputs.
            k = lookup_kernel(name, device, dtype, dim, in_process_faults(opts)) if name == "auto" else kernel
            verdicts = []
            for causal in (True, False):
                x = AttentionInputs.make(
                    batch=batch,
                    seq=seq,
                    heads=heads,
                    kv_heads=kv_heads,
                    dim=dim,
                    dtype=dtype,
                    device=device,
                    causal=causal,
                    lse_grad=lse_grad,
                    sparse_do=lse_grad,
                    seed=dim + heads,
                )
                verdicts.append(("causal" if causal else "full", kernel_verdict(k, x)))
            verdict = merge_verdicts(verdicts)
            if name == "auto":
                verdict.detail = f"chose {k.name}; {verdict.detail}"
            return verdict

        if selected(opts, f"{name} {dname} {label}"):
            rows.append(run_case("kernels", f"{name} {dname} {label}", case, device))
    return rows


# ----------------------------------------------------------------------------------------------------
# Sections run by spawned process groups
# ----------------------------------------------------------------------------------------------------


def spawned_jobs(opts: Options) -> list[Job]:
    """The process groups to spawn for the selected sections (on CPU, one gloo group does them all)."""
    common = dict(faults=opts.faults, case_filter=opts.case_filter)
    jobs: list[Job] = []
    want = set(opts.sections)
    if opts.cpu:
        checks = [c for s, c in (("mesh-gloo", "mesh:mesh-gloo"), ("hf", "hf:hf")) if s in want]
        if checks:
            jobs.append(Job("gloo cpu", "mesh-gloo", "gloo", 4, "cpu", checks, **common))
        return jobs
    gpu = dict(chunk=32, head_dim=64, timeout_s=60.0, **common)
    if "mesh-nccl" in want:
        for eager in (False, True):
            label = f"nccl {'eager' if eager else 'lazy'}"
            jobs.append(
                Job(label, "mesh-nccl", "nccl", opts.gpus, "cuda", ["mesh:mesh-nccl"], eager=eager,
                    dtypes=["bf16", "fp16", "fp32"], **gpu)
            )  # fmt: skip
    if "mesh-gloo" in want:
        # auto (cuDNN or flash-attn 3 on Hopper: a chunk's row groups as calls) and cuda_flash (one varlen call)
        jobs.append(
            Job("gloo 4 on cuda:0", "mesh-gloo", "gloo", 4, "cuda:0", ["mesh:mesh-gloo"],
                mesh_kernels=["auto", "cuda_flash"], **gpu)
        )  # fmt: skip
    if "hf" in want:
        if opts.gpus >= 4:
            jobs.append(Job("nccl 4 GPUs", "hf", "nccl", 4, "cuda", ["hf:hf"], **gpu))
        else:
            # P = 1 on NCCL as well: the model on the GPU (bf16, autocast) even where gloo cannot do P = 4.
            jobs.append(Job(f"nccl {opts.gpus} GPU", "hf", "nccl", opts.gpus, "cuda", ["hf:hf"], **gpu))
            jobs.append(Job("gloo 4 on cuda:0", "hf", "gloo", 4, "cuda:0", ["hf:hf"], **gpu))
    return jobs


MAX_RESTARTS = 16


def spawn_once(job: Job, timeout_s: float) -> tuple[str | None, int | None, list[list[dict]]]:
    """Run the job's ranks once: the error that ended them (``None`` when all ended well), the rank whose
    process failed first (``None`` if unknown or on a timeout), and every rank's records (the case list,
    a line before each case, each case's row)."""
    import torch.multiprocessing as mp

    error, culprit = None, None
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = mp.start_processes(rank_entry, args=(job, tmp), nprocs=job.world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f} s"
                    for proc in ctx.processes:
                        if proc.is_alive():
                            proc.kill()
                    break
        except Exception as err:  # noqa: BLE001 - a rank that died (signal, exit code, uncaught error)
            error = " ".join(str(err).split())[-400:]
            culprit = getattr(err, "error_index", None)
        records = []
        for rank in range(job.world):
            path = Path(tmp) / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            records.append([json.loads(line) for line in lines if line.endswith("}")])  # not a line cut short
    return error, culprit, records


def run_job(job: Job, timeout_s: float) -> list[Row]:
    """Spawn the job's ranks and merge their rows over ranks.

    A process that dies in a case makes that case a FAIL with the reason (on a timeout, every case then
    running); the group is then started again for the cases that did not finish on every rank (those
    the other processes were in when they were stopped, and those after)."""
    fields = {f.name for f in dataclasses.fields(Row)}
    results: list[dict[int, Row]] = [{} for _ in range(job.world)]
    planned: list[tuple[str, str]] = []
    failed_in: set[int] = set()
    todo, extra = None, []
    for _ in range(MAX_RESTARTS + 1):
        t0 = time.perf_counter()
        error, culprit, records = spawn_once(dataclasses.replace(job, only=todo), timeout_s)
        running: dict[int, int] = {}  # rank -> index of the case it was in when it ended
        for rank, recs in enumerate(records):
            for rec in recs:
                if "cases" in rec:
                    planned = [tuple(c) for c in rec["cases"]]
                elif rec.get("started"):
                    running[rank] = rec["index"]
                else:
                    results[rank][rec["index"]] = Row(**{k: v for k, v in rec.items() if k in fields})
                    running.pop(rank, None)
        if error is None:
            break
        if culprit in running:
            blamed = {running[culprit]}
        elif culprit is None and error.startswith("timed out"):
            blamed = set(running.values())
        else:  # it failed outside any case: starting or ending the group
            extra.append(Row(job.section, f"{job.label}: processes", FAIL, error, time.perf_counter() - t0, math.inf))
            break
        for index in blamed:
            detail = f"the processes ended in this case: {error}"
            for rank in range(job.world):
                results[rank][index] = Row(*planned[index], FAIL, detail, time.perf_counter() - t0, math.inf)
        failed_in |= blamed
        todo = tuple(i for i in range(len(planned)) if i not in failed_in and not all(i in r for r in results))
        if not todo:
            break
    else:
        extra.append(
            Row(job.section, f"{job.label}: processes", FAIL, f"more than {MAX_RESTARTS} restarts", 0, math.inf)
        )
    order = [-1, *range(len(planned))]
    merged = merge_ranks([[r[i] for i in order if i in r] for r in results])
    done = {(row.section, row.case) for row in merged}
    never = [
        Row(*key, FAIL, "not run (its group could not be started again)", 0.0, math.inf)
        for key in planned
        if key not in done
    ]
    return merged + never + extra


def merge_ranks(per_rank: list[list[Row]]) -> list[Row]:
    """One row per case: FAIL if any rank failed (that rank's detail), else the worst rank's numbers;
    a case some ranks never reported is a FAIL."""
    order: list[tuple[str, str]] = []
    seen: dict[tuple[str, str], dict[int, Row]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            key = (row.section, row.case)
            if key not in seen:
                order.append(key)
                seen[key] = {}
            seen[key][rank] = row
    merged = []
    for key in order:
        by_rank = seen[key]
        seconds = max(r.seconds for r in by_rank.values())
        missing = [r for r in range(len(per_rank)) if r not in by_rank]
        failed = {r: row for r, row in by_rank.items() if row.status == FAIL}
        if failed:
            rank, row = next(iter(failed.items()))
            where = "every rank" if len(failed) == len(per_rank) else f"rank {rank}"
            merged.append(Row(*key, FAIL, f"{where}: {row.detail}", seconds, math.inf))
        elif missing:
            merged.append(Row(*key, FAIL, f"no result from rank(s) {missing}", seconds, math.inf))
        elif all(row.status == SKIP for row in by_rank.values()):
            merged.append(Row(*key, SKIP, by_rank[0].detail, seconds))
        else:
            rank, row = max(by_rank.items(), key=lambda rr: rr[1].ratio)
            detail = row.detail if len(by_rank) == 1 else f"{row.detail} (worst: rank {rank})"
            if row.ratio == 0:
                detail = row.detail
            merged.append(Row(*key, PASS, detail, seconds, row.ratio))
    return merged


def skipped_jobs_rows(opts: Options) -> list[Row]:
    rows = []
    if "mesh-nccl" in opts.sections and opts.cpu:
        rows.append(Row("mesh-nccl", "NCCL", SKIP, "NCCL needs CUDA GPUs (CPU self-test)"))
    if "mesh-nccl" in opts.sections and not opts.cpu and not torch.distributed.is_nccl_available():
        rows.append(Row("mesh-nccl", "NCCL", FAIL, "this torch has no NCCL", 0.0, math.inf))
    return rows


# ----------------------------------------------------------------------------------------------------
# Section: the examples under torchrun
# ----------------------------------------------------------------------------------------------------


def example_rows(opts: Options) -> list[Row]:
    """Each example under torchrun on ``n = min(GPUs, 4)`` processes, one per GPU (accelerate and Megatron
    bind local rank r to GPU r, so n processes cannot share fewer GPUs), CP = n."""
    if opts.cpu:
        reason = "run on GPUs only (the CPU tests run every example under its launcher)"
        names = [n for n in ("accelerate", "deepspeed", "megatron") if selected(opts, n)]
        return [Row("examples", name, SKIP, reason) for name in names]
    n = min(opts.gpus, 4)
    gpus = f"{n} GPU{'s' if n > 1 else ''}"
    tiny = ["--seq-len", str(64 * n), "--hidden", "32", "--corpus-mb", "0.2", "--vocab", "512", "--steps", "3"]

    def accelerate_case() -> Verdict:
        script = ["examples/accelerate/finetune.py", *tiny, "--reference"]
        return reference_example(script, n, ["accelerate", "transformers"], opts)

    def deepspeed_case() -> Verdict:
        config = json.loads((ROOT / "configs" / "ds_mesh_cp_zero2.json").read_text())
        config["mesh_attention"] |= {"cp_size": n, "tile": f"1x{n}"}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(config, f)
        try:
            script = ["examples/deepspeed/finetune.py", "--deepspeed_config", f.name, *tiny, "--reference"]
            return reference_example(script, n, ["deepspeed", "transformers"], opts)
        finally:
            os.unlink(f.name)

    def megatron_case() -> Verdict:
        with tempfile.TemporaryDirectory(prefix="gpu_check_megatron_") as data:
            script = ["examples/megatron/pretrain_gpt.py", "--config", "configs/megatron_cpu_test.yaml"]
            script += ["--tp", "1", "--cp", str(n), "--tile", f"1x{n}", "--seq-len", str(64 * n), "--steps", "4"]
            out = torchrun(script + ["--data-dir", data], n, ["megatron.core", "transformers"], opts)
        result = example_result(out)
        losses = {result["first_step"] + i: loss for i, loss in enumerate(result["losses"])}
        if sorted(losses) != [1, 2, 3, 4]:
            return Verdict(False, f"expected steps 1-4 in its result line, found {sorted(losses)}", math.inf)
        ok = all(math.isfinite(v) for v in losses.values()) and losses[4] < losses[1]
        return Verdict(ok, f"loss {losses[1]:.4f} -> {losses[4]:.4f} in 4 steps{'' if ok else ' (did not fall)'}")

    cases = [
        (f"accelerate finetune.py --reference ({gpus})", accelerate_case),
        (f"deepspeed finetune.py ZeRO 2 --reference ({gpus})", deepspeed_case),
        (f"megatron pretrain_gpt.py ({gpus})", megatron_case),
    ]
    return [run_case("examples", name, fn) for name, fn in cases if selected(opts, name)]


def torchrun(script: list[str], n: int, modules: list[str], opts: Options) -> str:
    """``python -m torch.distributed.run --nproc-per-node n SCRIPT...``; its output, or an error with its tail."""
    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    missing += [m for m in modules if "." in m and not missing and importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"{', '.join(missing)} not installed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", "29547"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cmd + script, capture_output=True, text=True, timeout=opts.example_timeout_s, env=env, cwd=ROOT
    )
    out = proc.stdout + proc.stderr
    if opts.log_dir:
        Path(opts.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(opts.log_dir) / f"{Path(script[0]).parent.name}_{Path(script[0]).stem}.log").write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}: {first_error(out) or tail(out)}")
    return out


def first_error(text: str) -> str | None:
    """The first ``SomethingError: message`` line a rank printed (torchrun's own summary comes after)."""
    for line in text.splitlines():
        match = re.search(r"\b(\w+(Error|Exception)): (.*)", line)
        if match and "ChildFailedError" not in line:
            return f"{match[1]}: {match[3]}"[:300]
    return None


def example_result(out: str) -> dict:
    """The example's final JSON line (``examples.common.print_result``); a FAIL with the output's tail if none."""
    from examples.common import read_result

    try:
        return read_result(out)
    except ValueError:
        raise RuntimeError(f"no result line in its output: {tail(out)}") from None


def reference_example(script: list[str], n: int, modules: list[str], opts: Options) -> Verdict:
    result = example_result(torchrun(script, n, modules, opts))
    steps = list(zip(result["losses"], result["reference_losses"] or [], strict=False))
    if len(steps) < 3:
        return Verdict(False, f"expected 3 steps with a reference loss, found {len(steps)}: {result}", math.inf)
    gap = max(abs(a - b) for a, b in steps)
    ok = math.isfinite(gap) and gap <= EXAMPLE_LOSS_TOL
    detail = f"{len(steps)} steps, loss {steps[0][0]:.4f} -> {steps[-1][0]:.4f}, max |loss - reference| {gap:.1e}"
    return Verdict(ok, f"{detail} (tol {EXAMPLE_LOSS_TOL:g})", gap / EXAMPLE_LOSS_TOL)


def tail(text: str, chars: int = 300) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-4:])[-chars:]


# ----------------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> list[list[str]]:
    return [[r.section, r.case, r.status, r.detail, f"{r.seconds:.2f}"] for r in rows]


def print_table(info: list[tuple[str, str]], rows: list[Row], total_s: float) -> None:
    header = ["section", "case", "status", "detail", "s"]
    cells = format_table(rows)
    widths = [max([len(header[i])] + [len(c[i]) for c in cells]) for i in range(4)]
    widths[3] = min(widths[3], 130)
    print()
    for key, value in info:
        print(f"{key:>14}: {value}")
    print()
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)) + "  " + header[4]
    print(line)
    print("-" * len(line))
    for c in cells:
        detail = c[3] if len(c[3]) <= widths[3] else c[3][: widths[3] - 3] + "..."
        print(
            "  ".join(
                [c[0].ljust(widths[0]), c[1].ljust(widths[1]), c[2].ljust(widths[2]), detail.ljust(widths[3]), c[4]]
            )
        )
    print(summary(rows, total_s))


def summary(rows: list[Row], total_s: float) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, SKIP)}
    return f"{counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP in {total_s:.1f} s"


def markdown(info: list[tuple[str, str]], rows: list[Row], total_s: float) -> str:
    out = ["# mesh_cp GPU check", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in info]
    out += ["", "| section | case | status | detail | s |", "|---|---|---|---|---|"]
    for c in format_table(rows):
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in c) + " |")
    out += ["", summary(rows, total_s), ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--skip", default="", help="comma-separated sections not to run")
    p.add_argument("--cpu-selftest", action="store_true", help="run the checks on CPU (no GPU needed)")
    p.add_argument("--out", default=None, help="also write the versions and the table here, as markdown")
    p.add_argument("--json", default=None, help="also write the rows here, as JSON")
    p.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="KERNEL[:MODE[:DTYPE]]",
        help="plant a bug in this kernel, to test the checker: MODE wrong (0.1 added to its output, the "
        "default), raise (forward raises) or abort (forward ends a spawned rank's process); only for DTYPE "
        "(fp16, bf16, fp32) when given; repeatable",
    )
    p.add_argument("--cases", default=None, metavar="REGEX", help="run only the cases whose name matches")
    p.add_argument("--job-timeout", type=float, default=None, help="seconds per spawned group (CPU 240, GPU 600)")
    p.add_argument("--example-timeout", type=float, default=600.0, help="seconds per example run")
    p.add_argument("--log-dir", default=None, help="write each example's whole output here")
    args = p.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    skipped = [s for s in args.skip.split(",") if s]
    unknown = sorted(set(chosen + skipped) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    args.chosen = tuple(s for s in SECTIONS if s in chosen and s not in skipped)
    args.faults = {}
    for spec in args.inject_fault:
        name, _, rest = spec.partition(":")
        mode, _, dtype = rest.partition(":")
        if mode not in ("", *FAULT_MODES) or dtype not in ("", *DTYPES):
            p.error(f"--inject-fault {spec!r}: KERNEL[:MODE[:DTYPE]], MODE in {FAULT_MODES}, DTYPE in {tuple(DTYPES)}")
        args.faults[name] = (mode or "wrong", dtype or None)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = torch.cuda.device_count()
    if not args.cpu_selftest and gpus == 0:
        print("no CUDA GPU visible: run on a GPU machine, or use --cpu-selftest", file=sys.stderr)
        return 2
    opts = Options(
        sections=args.chosen,
        cpu=args.cpu_selftest,
        gpus=gpus,
        faults=args.faults,
        case_filter=args.cases,
        job_timeout_s=args.job_timeout or (240.0 if args.cpu_selftest else 600.0),
        example_timeout_s=args.example_timeout,
        log_dir=args.log_dir,
    )
    start = time.perf_counter()
    info = versions(opts)
    for key, value in info:
        print(f"{key:>14}: {value}", flush=True)
    rows: list[Row] = []
    steps: list[tuple[str, Callable[[], list[Row]]]] = []
    if "kernels" in opts.sections:
        steps.append(("kernels", lambda: kernel_rows(opts) + flash_decode_rows(opts)))
    steps.append(("skipped", lambda: skipped_jobs_rows(opts)))
    for job in spawned_jobs(opts):
        steps.append((job.label, lambda job=job: run_job(job, opts.job_timeout_s)))
    if "examples" in opts.sections:
        steps.append(("examples", lambda: example_rows(opts)))
    for label, step in steps:
        t0 = time.perf_counter()
        try:
            new = step()
        except Exception as err:  # noqa: BLE001 - a broken section is a FAIL row, the others still run
            new = [failed_row(label, "section", err)]
        rows += new
        if new:
            print(f"... {label}: {summary(new, time.perf_counter() - t0)}", flush=True)
    # Sections appear in the order of SECTIONS whatever order their jobs ran in.
    rows.sort(key=lambda r: SECTIONS.index(r.section) if r.section in SECTIONS else len(SECTIONS))
    total = time.perf_counter() - start
    print_table(info, rows, total)
    if args.out:
        Path(args.out).write_text(markdown(info, rows, total))
    if args.json:
        payload = {"versions": dict(info), "rows": [dataclasses.asdict(r) for r in rows], "seconds": total}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
