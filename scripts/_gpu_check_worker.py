"""The parts of ``scripts/gpu_check.py`` that run inside every rank, and what they share with it.

Rows, the case runner, the error rule, the fp64 reference, and the per-rank checks (the mesh and the
Hugging Face model over a CP group) live here so that spawned processes import this module by name
and never the driver's command line. Nothing here is part of mesh_cp: it calls only its public API.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib
import importlib.util
import json
import math
import os
import re
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass
class Row:
    """One line of the table."""

    section: str
    case: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    ratio: float = 0.0
    """Largest error / allowed error of the case (0 when it has no numbers); picks the worst rank."""


class Skip(Exception):
    """Raised by a case that cannot run here; the message is the reason."""


@dataclass
class Verdict:
    """What a case found: pass or fail, the numbers, and its worst error / allowed ratio."""

    ok: bool
    detail: str
    ratio: float = 0.0


def run_case(section: str, case: str, fn: Callable[[], Verdict], device: torch.device | None = None) -> Row:
    """Run one case in isolation: a :class:`Skip` is SKIP, any other exception is this case's FAIL."""
    start = time.perf_counter()
    try:
        verdict = fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous CUDA error belongs to this case
        status, detail, ratio = (PASS if verdict.ok else FAIL), verdict.detail, verdict.ratio
    except Skip as reason:
        status, detail, ratio = SKIP, str(reason), 0.0
    except Exception as err:  # noqa: BLE001 - every error of a case is that case's FAIL
        status, detail, ratio = FAIL, describe_error(err), math.inf
    return Row(section, case, status, detail, time.perf_counter() - start, ratio)


def describe_error(err: BaseException) -> str:
    """``Type: message`` on one line, with the innermost frame of this project's code."""
    message = " ".join(str(err).split())
    if len(message) > 300:
        message = message[:297] + "..."
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if "mesh_cp" in frame.filename or "integrations" in frame.filename:
            where = f" [{Path(frame.filename).name}:{frame.lineno}]"
            break
    return f"{type(err).__name__}: {message}{where}"


# ----------------------------------------------------------------------------------------------------
# The error rule
# ----------------------------------------------------------------------------------------------------

# Floor of the allowed error, relative to max(1, largest reference value): an eighth of the machine
# epsilon for fp16/bf16 (the rule is 2x plain attention's error; the floor only matters where that
# error is by chance tiny), 1e-5 for fp32 (where plain attention's error is rounding noise).
FLOOR = {torch.float16: torch.finfo(torch.float16).eps / 8, torch.bfloat16: torch.finfo(torch.bfloat16).eps / 8}
FLOOR_FP32 = 1e-5


def floor_of(dtype: torch.dtype) -> float:
    return FLOOR.get(dtype, FLOOR_FP32)


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def judge(got: dict[str, Tensor], gold: dict[str, Tensor], plain: dict[str, Tensor], dtype: torch.dtype) -> Verdict:
    """flash-attn's rule, per quantity: ``|got - gold| <= 2 |plain - gold| + floor * max(1, |gold|)``.

    ``gold`` is the fp64 reference of the same (rounded) inputs, ``plain`` plain PyTorch attention in
    ``dtype``. The detail lists ``name err/allowed`` for every quantity.
    """
    parts, worst = [], 0.0
    for name, want in gold.items():
        err = max_err(got[name], want)
        scale = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
        allowed = 2 * max_err(plain[name], want) + floor_of(dtype) * scale
        ratio = err / allowed if math.isfinite(err) else math.inf
        worst = max(worst, ratio)
        parts.append(f"{name} {err:.1e}/{allowed:.1e}")
    return Verdict(worst <= 1.0, " ".join(parts), worst)


def merge_verdicts(verdicts: list[tuple[str, Verdict]]) -> Verdict:
    """One verdict for several sub-checks: fails if any fails; the detail is the worst one's."""
    label, worst = max(verdicts, key=lambda lv: lv[1].ratio)
    failed = sum(not v.ok for _, v in verdicts)
    detail = f"worst {label}: {worst.detail}" if len(verdicts) > 1 else worst.detail
    if failed:
        detail = f"{detail} ({failed} of {len(verdicts)} failed)"
    return Verdict(not failed, detail, worst.ratio)


# ----------------------------------------------------------------------------------------------------
# Attention written out (the fp64 reference, and plain attention in a low dtype)
# ----------------------------------------------------------------------------------------------------


def attention_math(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T * scale) v`` in ``q.dtype``, differentiable: ``q (B, S, H, D)``, ``k, v (B, S, Hkv, D)``
    -> ``out (B, S, H, D)``, ``lse (B, H, S)``. Causal is top-left aligned; ``mask (S, S)`` (``True``: attends)
    removes more pairs (every query must keep one). Independent of mesh_cp's code."""
    rep = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vh
    return out.transpose(1, 2), lse


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tensor:
    """Plain ``torch.nn.functional.scaled_dot_product_attention`` in the flash-attn layout."""
    rep = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal, scale=scale
    )
    return out.transpose(1, 2)


def packed_visibility(lengths: list[int], window: int) -> Tensor:
    """``(S, S)``: query ``i`` attends key ``j`` in the same document, ``j <= i``, ``i - j < window``."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(doc))
    distance = pos[:, None] - pos[None, :]
    return (doc[:, None] == doc[None, :]) & (distance >= 0) & (distance < window)


def grads_of(leaves: list[Tensor]) -> dict[str, Tensor]:
    q, k, v = leaves
    return {"dq": q.grad, "dk": k.grad, "dv": v.grad}


@dataclass
class AttentionInputs:
    """Seeded inputs of one attention check, identical on every rank, already rounded to ``dtype``."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    dlse: Tensor | None
    causal: bool
    scale: float
    mask: Tensor | None = None
    """``(S, S)`` pairs that attend beyond ``causal`` (packed documents, a window), or ``None``."""

    @classmethod
    def make(
        cls,
        *,
        batch: int,
        seq: int,
        heads: int,
        kv_heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        causal: bool,
        lse_grad: bool,
        sparse_do: bool = False,
        seed: int = 0,
    ) -> AttentionInputs:
        """With ``lse_grad`` the loss also depends on the lse. With ``sparse_do`` too, rows of ``dO`` are
        zero (every 4th) or tiny (1e-7, the next row): a fused backward must still carry the lse's
        gradient there, without overflow."""
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(batch, seq, heads, dim, generator=gen)
        k, v = (torch.randn(batch, seq, kv_heads, dim, generator=gen) for _ in range(2))
        do = torch.randn(batch, seq, heads, dim, generator=gen)
        dlse = None
        if lse_grad:
            dlse = torch.randn(batch, heads, seq, generator=gen).to(device)
            if sparse_do:
                do[:, 0::4] = 0
                do[:, 1::4] *= 1e-7
        q, k, v, do = (t.to(device=device, dtype=dtype) for t in (q, k, v, do))
        return cls(q, k, v, do, dlse, causal, dim**-0.5)

    def loss(self, out: Tensor, lse: Tensor | None, do: Tensor | None = None, dlse: Tensor | None = None) -> Tensor:
        do = self.do if do is None else do
        dlse = self.dlse if dlse is None else dlse
        total = (out.double() * do.double()).sum()
        if self.dlse is not None:
            total = total + (lse.double() * dlse.double()).sum()
        return total

    def gold(self) -> dict[str, Tensor]:
        """fp64 out, lse and gradients of the rounded inputs."""
        leaves = [t.detach().double().requires_grad_() for t in (self.q, self.k, self.v)]
        out, lse = attention_math(*leaves, causal=self.causal, scale=self.scale, mask=self.mask)
        self.loss(out, lse).backward()
        return {"out": out.detach(), "lse": lse.detach(), **grads_of(leaves)}

    def plain(self) -> dict[str, Tensor]:
        """Plain PyTorch attention in the inputs' dtype: ``scaled_dot_product_attention`` for out and the
        gradients of ``<dO, out>``; with an lse gradient (SDPA returns no lse) the attention written out
        in that dtype. The lse is the log-sum-exp of the scores of the rounded inputs computed in fp32 (the
        kernels return an fp32 lse, so its error is judged against fp32 arithmetic, not the input dtype's)."""
        leaves = [t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v)]
        if self.dlse is None and self.mask is None:
            out = sdpa(*leaves, causal=self.causal, scale=self.scale)
            self.loss(out, None).backward()
        else:
            out, lse = attention_math(*leaves, causal=self.causal, scale=self.scale, mask=self.mask)
            self.loss(out, lse).backward()
        with torch.no_grad():
            wide = torch.float64 if self.q.dtype == torch.float64 else torch.float32
            rounded = (t.detach().to(wide) for t in leaves)
            _, lse = attention_math(*rounded, causal=self.causal, scale=self.scale, mask=self.mask)
        return {"out": out.detach(), "lse": lse.detach(), **grads_of(leaves)}


# ----------------------------------------------------------------------------------------------------
# Kernels: lookup that never crashes the table, and the injected fault of the self-test
# ----------------------------------------------------------------------------------------------------

# Kernels that take fp16/bf16 only, and the library each optional kernel imports.
HALF_ONLY = {"flash_attn", "cuda_flash", "cuda_cudnn", "flash_attn3", "flash_attn4"}
LIBRARIES = {"flash_attn": "flash_attn", "flash_attn3": "flash_attn_interface"}


def needs_cuda(name: str) -> bool:
    return name.startswith(("cuda", "flash"))


FAULT_MODES = ("wrong", "raise", "abort")


class FaultyKernel:
    """A kernel with a planted bug, to show that the check reports it: ``wrong`` adds 0.1 to the last
    query row of every block's output; ``raise`` raises in forward; ``abort`` ends the process
    (``os.abort``) in forward. With ``dtype`` only calls in that dtype are affected."""

    def __init__(self, inner, mode: str, dtype: str | None = None) -> None:
        self.inner, self.mode, self.name = inner, mode, inner.name
        self.dtype = DTYPES[dtype] if dtype else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if self.dtype is not None and q.dtype != self.dtype:
            return self.inner.forward(q, k, v, causal=causal, scale=scale)
        if self.mode == "abort":
            os.abort()
        if self.mode == "raise":
            raise RuntimeError(f"fault injected into kernel {self.name!r} (--inject-fault)")
        out, lse = self.inner.forward(q, k, v, causal=causal, scale=scale)
        out = out.clone()
        out[:, -1] += 0.1
        return out, lse

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)  # same signature as the inner kernel's


def with_fault(kernel, faults: dict[str, tuple[str, str | None]]):
    """``kernel``, or it with the fault planted in it (``faults``: kernel name -> (mode, dtype or None))."""
    if kernel.name not in faults:
        return kernel
    return FaultyKernel(kernel, *faults[kernel.name])


def resolve_auto(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The kernel ``kernel="auto"`` runs for these inputs (mesh_cp.kernels.resolve_kernel)."""
    import inspect

    from mesh_cp.kernels import resolve_kernel

    if "head_dim" in inspect.signature(resolve_kernel).parameters:
        return resolve_kernel("auto", device, dtype, head_dim=head_dim)
    return resolve_kernel("auto", device, dtype)


def kernel_reasons(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the registered kernel ``name`` cannot run such inputs here, as it states it
    (``mesh_cp.kernels.not_supported_reasons``; older mesh_cp versions without it: ``None``)."""
    from mesh_cp import kernels

    reasons = getattr(kernels, "not_supported_reasons", None)
    if reasons is None or name not in kernels.KERNEL_NAMES:
        return None
    return "; ".join(reasons(name, device, dtype, head_dim)) or None


def lookup_kernel(
    name: str, device: torch.device, dtype: torch.dtype, head_dim: int, faults: dict[str, tuple[str, str | None]]
):
    """The kernel object for ``name`` (or ``"auto"``), or :class:`Skip` with why it cannot run here."""
    from mesh_cp import kernels

    if name == "auto":
        return with_fault(resolve_auto(device, dtype, head_dim), faults)
    if name not in kernels.KERNEL_NAMES:
        raise Skip(f"not registered in mesh_cp.kernels (KERNEL_NAMES: {', '.join(kernels.KERNEL_NAMES)})")
    if needs_cuda(name) and device.type != "cuda":
        raise Skip("needs a CUDA device")
    if name.startswith("cpu") and device.type != "cpu":
        raise Skip("CPU kernel")
    library = LIBRARIES.get(name)
    if library and importlib.util.find_spec(library) is None:
        raise Skip(f"{library} is not installed")
    if name in HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        raise Skip(f"takes fp16/bf16 only, not {DTYPE_NAMES[dtype]}")
    why = kernel_reasons(name, device, dtype, head_dim)
    if why:
        raise Skip(why)
    try:
        kernel = kernels.get_kernel(name)
    except ImportError as err:
        raise Skip(f"its library does not import: {err}") from err
    except RuntimeError as err:
        if "install" in str(err):  # the kernels' own wording for a missing library
            raise Skip(str(err)) from err
        raise
    return with_fault(kernel, faults)


# ----------------------------------------------------------------------------------------------------
# Jobs: one spawned process group and the per-rank checks it runs
# ----------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One spawned process group: its backend, how it starts, and the checks every rank runs."""

    label: str
    section: str
    """Section of the job's own rows (its start, its end)."""
    backend: str
    world: int
    device: str
    """``"cpu"``, ``"cuda"`` (rank r on GPU r) or ``"cuda:0"`` (every rank on GPU 0)."""
    checks: list[str]
    """Names in :data:`RANK_CHECKS`, with the section of their rows: ``"mesh:SECTION"``, ``"hf:SECTION"``."""
    eager: bool = False
    """``init_process_group(..., device_id=...)``: the default group is bound to the device at once."""
    dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp32"])
    hf_modes: list[str] = field(default_factory=lambda: ["fp32", "bf16", "autocast"])
    chunk: int = 8
    """Tokens per zig-zag half-chunk of the mesh checks (global length ``2 P chunk``)."""
    head_dim: int = 32
    faults: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    mesh_kernels: list[str] = field(default_factory=lambda: ["auto"])
    """Block kernels of the mesh checks (``"auto"`` and names): each mesh case runs with every one of them."""
    hf_schedule: str = "overlap"
    """Schedule of the Hugging Face cases (``hf.attach(..., schedule=)``)."""
    timeout_s: float = 60.0
    """Process-group timeout: a collective that waits longer raises instead of hanging."""
    only: tuple[int, ...] | None = None
    """Indices of the cases to run (a group started again after a process died in a case); all if None."""
    case_filter: str | None = None
    """Run only the cases whose name this regular expression finds (``--cases``)."""


@dataclass
class Case:
    """One case of a rank check, not run yet: every rank lists the same cases in the same order."""

    section: str
    name: str
    fn: Callable[[], Verdict]


def rank_entry(rank: int, job: Job, tmp: str) -> None:
    """Spawned process ``rank``: start the group (itself a case), list the checks' cases and run those
    in ``job.only`` (all by default), writing a line before each case and its row after it (a process that
    dies in a case leaves the first line without the second)."""
    import torch.distributed as dist

    from mesh_cp.testing import gloo_exit_workaround

    gloo_exit_workaround()  # before init_process_group
    torch.set_num_threads(1 if job.device == "cpu" else 4)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    path = Path(tmp) / f"rank{rank}.jsonl"

    def emit(index: int, row: Row | None = None, **extra) -> None:
        record = {"index": index, **extra, **(dataclasses.asdict(row) if row else {})}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    device = torch.device("cpu")
    if job.device == "cuda":
        device = torch.device("cuda", rank)
    elif job.device.startswith("cuda:"):
        device = torch.device(job.device)

    def start() -> Verdict:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {"device_id": device} if job.eager else {}
        dist.init_process_group(
            job.backend,
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=job.world,
            timeout=datetime.timedelta(seconds=job.timeout_s),
            **kwargs,
        )
        return Verdict(True, f"{job.backend} on {device}{', device-bound' if job.eager else ''}")

    row = run_case(job.section, f"{job.label}: start group", start)
    if row.status != PASS or job.only is None:
        emit(-1, row)
    if row.status != PASS:
        return
    try:
        cases = []
        for check in job.checks:
            name, section = check.split(":")
            cases += RANK_CHECKS[name](job, section, rank, device)
        if job.case_filter:
            cases = [c for c in cases if re.search(job.case_filter, c.name)]
        emit(-1, cases=[[c.section, c.name] for c in cases])
        for index, case in enumerate(cases):
            if job.only is not None and index not in job.only:
                continue
            emit(index, started=True, section=case.section, case=case.name)
            emit(index, run_case(case.section, case.name, case.fn, device))
    finally:
        dist.destroy_process_group()


def most_square(p: int) -> tuple[int, int]:
    a = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return (p // a, a)


def mesh_checks(job: Job, section: str, rank: int, device: torch.device) -> list[Case]:
    """The mesh over the whole group (every tile of P), and at world 4 also over the pairs {0,1}, {2,3}:
    a refused tile mismatch, then forward and backward (a loss on out and lse) against the fp64
    reference. The collective schedule comes first, so that a backend failing point to point (the
    overlapped schedule's ring steps) still shows how the collectives did."""
    import torch.distributed as dist

    import mesh_cp

    groups = [(job.world, dist.group.WORLD)]
    if job.world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append((2, pairs[rank // 2]))
    meshes: dict[tuple[int, tuple[int, int], int], object] = {}

    def mesh_of(p: int, tile: tuple[int, int], group, u: int = 1) -> object:
        """The mesh (``u`` head-parallel ranks), created on first use (a case may run first in a restarted group)."""
        if (p, tile, u) not in meshes:
            meshes[(p, tile, u)] = mesh_cp.CPMesh.create(group, tile=tile, head_parallel=u)
        return meshes[(p, tile, u)]

    cases: list[Case] = []
    tiled: list[tuple[int, tuple[int, int], object, int]] = []
    for p, group in groups:
        # Every tile of P, and with 2 head-parallel ranks (Note [Head-parallel x mesh]) every tile of P / 2.
        layouts = [(1, (a, p // a)) for a in range(1, p + 1) if p % a == 0]
        layouts += [(2, (a, p // 2 // a)) for a in range(1, p // 2 + 1) if p % 2 == 0 and p // 2 % a == 0]
        for u, tile in layouts:
            tiled.append((p, tile, group, u))
            label = f"{tile[0]}x{tile[1]}" + (f" head_parallel={u}" if u > 1 else "")

            def create(p=p, tile=tile, group=group, u=u) -> Verdict:
                return Verdict(True, str(mesh_of(p, tile, group, u)))

            cases.append(Case(section, f"{job.label} P={p} {label} CPMesh.create", create))
        if p > 1:

            def mismatch(group=group, p=p) -> Verdict:
                mine = (1, p) if dist.get_rank(group) == 0 else (p, 1)
                try:
                    mesh_cp.CPMesh.create(group, tile=mine)
                except ValueError as err:
                    ok = "different meshes" in str(err)
                    return Verdict(ok, "ValueError on every rank" if ok else f"unexpected message: {err}")
                return Verdict(False, "rank 0 asked for 1xP and the others for Px1: not refused")

            cases.append(Case(section, f"{job.label} P={p} tiles differ across ranks: refused", mismatch))
    for schedule in ("collective", "overlap"):
        for p, tile, group, u in tiled:
            for dtype_name in job.dtypes:

                def attention(p=p, tile=tile, group=group, u=u, dtype=DTYPES[dtype_name], schedule=schedule) -> Verdict:
                    return mesh_attention_verdict(mesh_of(p, tile, group, u), job, device, dtype, p, schedule)

                label = f"{tile[0]}x{tile[1]}" + (f" head_parallel={u}" if u > 1 else "")
                cases.append(Case(section, f"{job.label} P={p} {label} {dtype_name} {schedule}", attention))
    cases.append(Case(section, f"{job.label} fused passes", lambda: fused_verdict(device)))
    return cases


def fused_verdict(device: torch.device) -> Verdict:
    """After the attention cases: the LSE merge ran compiled, as it does on CUDA (Note [Fused passes] in
    mesh_cp/kernels/fused.py), not fallen back to the eager function; SKIP where it runs eagerly."""
    from mesh_cp.kernels import fused

    if not fused.compiles(device):
        raise Skip(f"the merge runs eagerly on {device.type} (Note [Fused passes]; MESH_CP_FUSED=1 compiles it)")
    merge = fused.merge_
    if merge.failed is not None:
        return Verdict(False, f"fell back to the eager merge: {merge.failed}")
    return Verdict(merge.compiled is not None, "compiled" if merge.compiled is not None else "never called")


def mask_modes(seq: int, chunk: int) -> dict[str, tuple[bool, tuple[list[int], int | None, bool] | None]]:
    """Causal, full, and packed documents (of 1 token, shorter and longer than a chunk): with a window smaller than a
    chunk (masked blocks as their runs), without (one varlen call per masked block), and split over the ranks (Note
    [Split documents]): name -> (causal, (document lengths, window, split) or None)."""
    lengths, pattern = [], [1, chunk + 3, 2, 3 * chunk]
    while sum(lengths) < seq:
        lengths.append(min(pattern[len(lengths) % len(pattern)], seq - sum(lengths)))
    return {
        "causal": (True, None),
        "full": (False, None),
        "packed + window": (True, (lengths, chunk // 2 + 1, False)),
        "packed": (True, (lengths, None, False)),
        "packed split": (True, (lengths, None, True)),
    }


def packed_mask(packed: tuple[list[int], int | None, bool], seq: int, world: int) -> tuple[object, Tensor]:
    """The :class:`mesh_cp.AttentionMask` of two rows of ``packed`` documents and the ``(S, S)`` pairs that attend,
    in the order of the row the mesh computes (the split row's for split documents)."""
    import mesh_cp
    from mesh_cp.core.split import split_documents

    lengths, window, split = packed
    visible = packed_visibility(lengths, seq + 1 if window is None else window)
    if not split:
        return mesh_cp.AttentionMask.from_lengths([lengths] * 2, window=window), visible
    mask, (source, _) = split_documents([lengths] * 2, seq_len=seq, world=world)
    order = torch.tensor(source)
    return mask, visible[order][:, order]  # token g of the split row is token source[g] of the packed row


def mesh_attention_verdict(mesh, job: Job, device: torch.device, dtype: torch.dtype, p: int, schedule: str) -> Verdict:
    """Causal (zig-zag), full (contiguous), and packed documents with a window (zig-zag); MHA 4:4 and GQA 8:2."""
    import mesh_cp

    verdicts = []
    for mode, (causal, packed) in mask_modes(2 * p * job.chunk, job.chunk).items():
        layout = "zigzag" if causal else "contiguous"
        mask, visible = (None, None) if packed is None else packed_mask(packed, 2 * p * job.chunk, p)
        for heads, kv_heads in ((4, 4), (8, 2)):
            x = AttentionInputs.make(
                batch=2,
                seq=2 * p * job.chunk,
                heads=heads,
                kv_heads=kv_heads,
                dim=job.head_dim,
                dtype=dtype,
                device=device,
                causal=causal,
                lse_grad=True,
                seed=heads + 10 * causal,
            )
            x.mask = visible
            gold, plain = x.gold(), x.plain()

            def shard(t: Tensor, dim: int = 1) -> Tensor:
                return mesh_cp.shard_sequence(t, mesh=mesh, dim=dim, layout=layout)

            def shards(d: dict[str, Tensor]) -> dict[str, Tensor]:
                return {n: shard(t, 2 if n == "lse" else 1) for n, t in d.items()}

            for name in job.mesh_kernels:
                if name != "auto" and kernel_reasons(name, device, dtype, job.head_dim):
                    continue  # a named kernel that does not take this dtype (cuda_flash in fp32)
                kernel = name
                if job.faults:  # the fault goes into the kernel this case runs
                    from mesh_cp.kernels import get_kernel

                    chosen = resolve_auto(device, dtype, job.head_dim) if name == "auto" else get_kernel(name)
                    kernel = with_fault(chosen, job.faults)
                leaves = [shard(t).detach().requires_grad_() for t in (x.q, x.k, x.v)]
                out, lse = mesh_cp.mesh_attn_func(
                    *leaves,
                    mesh=mesh,
                    causal=causal,
                    layout=layout,
                    return_lse=True,
                    kernel=kernel,
                    schedule=schedule,
                    mask=mask,
                )
                if out.dtype != dtype:
                    return Verdict(False, f"out is {out.dtype}, not the inputs' {dtype}", math.inf)
                x.loss(out, lse, shard(x.do), shard(x.dlse, 2)).backward()
                got = {"out": out, "lse": lse, **grads_of(leaves)}
                label = f"{mode} {heads}:{kv_heads}" + ("" if name == "auto" else f" {name}")
                verdicts.append((label, judge(got, shards(gold), shards(plain), dtype)))
    return merge_verdicts(verdicts)


# ----------------------------------------------------------------------------------------------------
# Hugging Face: a tiny Llama with hf.attach against the single-process SDPA model
# ----------------------------------------------------------------------------------------------------

HF_TOL_FP32 = 1e-4


def hf_checks(job: Job, section: str, rank: int, device: torch.device) -> list[Case]:
    """A tiny Llama, MHA and GQA, tile 2x2 (or the most square), in fp32, bf16 weights, and fp32 weights
    under bf16 autocast, with the job's ``hf_schedule``."""
    import torch.distributed as dist

    import mesh_cp

    tile = most_square(job.world)
    meshes: dict = {}

    def mesh() -> object:
        if importlib.util.find_spec("transformers") is None:
            raise Skip("transformers is not installed")
        if "mesh" not in meshes:
            meshes["mesh"] = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        return meshes["mesh"]

    cases = [
        Case(
            section, f"{job.label} P={job.world} {tile[0]}x{tile[1]} CPMesh.create", lambda: Verdict(True, str(mesh()))
        )
    ]
    suffix = "" if job.hf_schedule == "overlap" else f" ({job.hf_schedule} schedule)"
    for name, kv_heads in (("llama", 4), ("llama-gqa", 2)):
        for mode in job.hf_modes:

            def compare(kv_heads=kv_heads, mode=mode) -> Verdict:
                return hf_verdict(mesh(), device, kv_heads, mode, job.hf_schedule)

            cases.append(Case(section, f"{job.label} {name} {mode}{suffix}", compare))

        def generated(kv_heads=kv_heads) -> Verdict:
            return generate_verdict(mesh(), device, kv_heads)

        def generated_bf16(kv_heads=kv_heads) -> Verdict:
            return generate_bf16_verdict(mesh(), device, kv_heads)

        cases.append(Case(section, f"{job.label} {name} generate", generated))
        cases.append(Case(section, f"{job.label} {name} generate bf16", generated_bf16))
    return cases


def _generation_case(device: torch.device, kv_heads: int):
    """The tiny Llama (SDPA) and 3 left-padded prompts of different lengths of the generate cases."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mesh_cp.testing.models import tiny_config

    config = tiny_config(LlamaConfig, hidden_size=64, intermediate_size=128, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()
    lengths, gen = (9, 4, 14), torch.Generator().manual_seed(2)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, max(lengths) - n :] = torch.randint(1, config.vocab_size, (n,), generator=gen)
    return base, ids.to(device), (ids != 0).long().to(device)


def generate_bf16_verdict(mesh, device: torch.device, kv_heads: int) -> Verdict:
    """``hf.generate`` with bf16 weights (the flash decode kernel of a static cache on CUDA, Note [Flash decode]):
    the logits of each of its 6 steps against the single-process model run over the tokens it chose (teacher
    forcing, so diverging tokens do not change the reference), by flash-attn's rule: within twice the bf16 SDPA
    model's error against the same model in fp64, plus the floor."""
    from mesh_cp.integrations import hf

    base, ids, mask = _generation_case(device, kv_heads)
    model = hf.attach(copy.deepcopy(base).to(torch.bfloat16), mesh)
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    got = hf.generate(model, ids, mask, mesh=mesh, **options)
    full_mask = torch.cat([mask, torch.ones_like(got.sequences[:, ids.shape[1] :])], 1)
    positions = (full_mask.cumsum(1) - 1).clamp_min(0)
    steps = slice(ids.shape[1] - 1, got.sequences.shape[1] - 1)  # the logits that chose each new token

    def forced(dtype: torch.dtype) -> Tensor:
        with torch.no_grad():
            out = copy.deepcopy(base).to(dtype)(got.sequences, attention_mask=full_mask, position_ids=positions)
        return out.logits[:, steps]

    logits = torch.stack(got.logits, 1)
    return judge({"logits": logits}, {"logits": forced(torch.float64)}, {"logits": forced(torch.bfloat16)},
                 torch.bfloat16)  # fmt: skip


def generate_verdict(mesh, device: torch.device, kv_heads: int) -> Verdict:
    """``hf.generate`` (prefill under the mesh, Tree-Attention decoding over the sharded cache) of 3 left-padded
    prompts of different lengths against single-process ``generate`` with SDPA, fp32: the logits of every step
    within 1e-4 and the same greedy tokens."""
    from mesh_cp.integrations import hf

    base, ids, mask = _generation_case(device, kv_heads)
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    want = base.generate(input_ids=ids, attention_mask=mask, **options)
    got = hf.generate(hf.attach(copy.deepcopy(base), mesh), ids, mask, mesh=mesh, **options)
    err = max(max_err(a, b) for a, b in zip(got.logits, want.logits, strict=True))
    same = torch.equal(got.sequences, want.sequences)
    detail = f"logits {err:.1e}/{HF_TOL_FP32:.1e} over 6 steps, tokens {'identical' if same else 'DIFFER'}"
    return Verdict(err <= HF_TOL_FP32 and same, detail, err / HF_TOL_FP32)


def hf_verdict(mesh, device: torch.device, kv_heads: int, mode: str, schedule: str) -> Verdict:
    """Logits and every parameter gradient of the mesh model against the single-process SDPA model.

    ``fp32``: within 1e-4 of the fp32 SDPA model (TF32 off). ``bf16`` (bf16 weights) and ``autocast``
    (fp32 weights under ``torch.autocast(bf16)``): 2x the error of the single-process SDPA model in the
    same precision, both against the model in fp64 (per gradient tensor).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.testing.models import tiny_config

    config = tiny_config(LlamaConfig, hidden_size=64, intermediate_size=128, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    if mode == "bf16":
        base = base.to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 16 * mesh.size), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    autocast = mode == "autocast"

    def context():
        return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()

    def single(model, cast: bool) -> tuple[Tensor, dict[str, Tensor]]:
        with context() if cast else nullcontext():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_logits, ref_grads = single(copy.deepcopy(base), cast=autocast)

    model = hf.attach(copy.deepcopy(base), mesh, schedule=schedule)
    ddp = hf.data_parallel(model, mesh=mesh, find_unused_parameters=True)  # summed over CP; an unused one stays None
    batch = hf.shard_batch(ids, mesh=mesh)
    with context():
        logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = sorted(n for n, g in grads.items() if g is None)
    if missing:
        return Verdict(False, f"no gradient for {missing[:3]}", math.inf)

    def shard(t: Tensor) -> Tensor:
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag")

    if mode == "fp32":
        logits_err = max_err(logits, shard(ref_logits))
        grad_errs = {n: max_err(grads[n], ref_grads[n]) for n in grads}
        worst_name = max(grad_errs, key=grad_errs.get)
        ratio = max(logits_err, grad_errs[worst_name]) / HF_TOL_FP32
        tol = f"{HF_TOL_FP32:.1e}"
        detail = f"logits {logits_err:.1e}/{tol}, worst grad {worst_name} {grad_errs[worst_name]:.1e}/{tol}"
        return Verdict(ratio <= 1.0, detail, ratio)

    gold_logits, gold_grads = single(copy.deepcopy(base).to(torch.float64), cast=False)
    dtype = torch.bfloat16
    logits_v = judge({"logits": logits}, {"logits": shard(gold_logits)}, {"logits": shard(ref_logits)}, dtype)
    grad_v = [(n, judge({"g": grads[n]}, {"g": gold_grads[n]}, {"g": ref_grads[n]}, dtype)) for n in grads]
    worst_name, worst = max(grad_v, key=lambda nv: nv[1].ratio)
    failed = [n for n, v in grad_v if not v.ok]
    detail = f"{logits_v.detail}, worst grad {worst_name} {worst.detail.split(' ', 1)[1]}"
    if failed:
        detail = f"{len(failed)} gradients over 2x SDPA's error; {detail}"
    return Verdict(logits_v.ok and not failed, detail, max(logits_v.ratio, worst.ratio))


RANK_CHECKS: dict[str, Callable[[Job, str, int, torch.device], list[Case]]] = {
    "mesh": mesh_checks,
    "hf": hf_checks,
}
