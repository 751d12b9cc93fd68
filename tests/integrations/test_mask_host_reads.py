"""Zero host reads per training step with packed-document masks, and at most one host-to-device copy.

A packed run draws new documents every step, so what the mesh builds from a mask on the host (the plan, its tiles,
the document ids) is new every step. On a GPU a read of a device tensor on the host (``.item()``, ``bool()``,
``.tolist()``, ``.cpu()``, an op whose output size depends on the data) stalls the step, and a host-to-device copy
made in every layer is a transfer per layer where one per step would do. Here a model of :data:`LAYERS`
mesh-attention layers (``mesh_cp.mesh_attn_func(..., mask=...)``, causal, zig-zag) trains on a 2 x 2 mesh of 4 gloo
ranks for :data:`STEPS` steps, a new packing (other document lengths, some padding) on each, under
:class:`StepCounter`: :class:`~tests.integrations.test_device_discipline.DeviceDiscipline` (a second, virtual device
``cpu:0`` beside the host) counting per step

- every host read of a device tensor, whoever makes it (torch included): ``_local_scalar_dense`` (``item``, ``int``,
  ``float``, ``bool``), ``equal``, ``nonzero``, ``masked_select``, ``tolist``, a ``.cpu()`` or ``.to("cpu")`` of a
  device tensor, and the ops whose output size is read from the data (boolean indexing, ``repeat_interleave`` by a
  tensor, ``unique``);
- every host-to-device copy: ``.to(device)`` of a host tensor, ``torch.tensor``/``as_tensor`` of host data with a
  device, ``copy_`` and item assignment of a host tensor into a device one;
- every cross-rank call check that gathers (:func:`mesh_cp.runtime.check.check_same`): the check keys on
  ``AttentionMask.form()``, so a new packing is no new signature.

torch runs the backward of a custom autograd Function (``MeshAttnFunc``'s) with no ``TorchFunctionMode`` active, so
the function-level checks (placement of factories, ``.to``, ``.tolist``, ``.cpu``) would not see it;
:class:`StepCounter` pushes them again around every such backward.

Cases: both schedules (``"collective"``, ``"overlap"``) times a kernel that takes masked tiles as boolean masks
(``cpu_flash``) and one that also takes varlen segments (``reference``: the collective schedule runs the unmasked
blocks of a Q chunk as one chunk call, group by group). After the first step (which checks the call and builds what depends
on the call shape only) every step reads nothing back, checks nothing across ranks, and copies once: the document
ids of the new mask (:func:`mesh_cp.core.numerics.document_ids`, cached per mask and device, so not once per layer).
A planted ``bool()`` in the LSE merge, ``tolist()`` in the backward and an uncached ``document_ids`` are caught, so
the zeros are the detector's, not its blindness.

Not covered: what :class:`DeviceDiscipline` cannot see (its module docstring), and CUDA-only paths. A kernel that
takes masked blocks only as segments (``flash_attn``, ``cuda_flash``) gets no document ids but builds one varlen plan
per masked block (:func:`mesh_cp.kernels.varlen.varlen_plan`, cached per segments and device): with a new packing
that is one copy per masked block per step, shared by every layer and by backward.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import mesh_cp
from mesh_cp.core import AttentionMask
from mesh_cp.testing import run_sections, section_results, spawn_gloo
from tests.integrations.test_device_discipline import (
    DEVICE,
    ROOT,
    DeviceDiscipline,
    _is_host_device,
    _patched,
    _Placement,
)

LAYERS, STEPS, WORLD, TILE = 3, 4, 4, (2, 2)
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 2, 1, 8
MODEL = HEADS * HEAD_DIM
CASES = {f"{schedule}, {kernel}": (schedule, kernel) for schedule in ("collective", "overlap")
         for kernel in ("cpu_flash", "reference")}  # fmt: skip
PLANTED = "planted read and per-layer copy"
_SKIP = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).resolve()),
         str(ROOT / "tests" / "integrations" / "test_device_discipline.py"))  # fmt: skip
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
"""Ops whose boolean indices are read on the host (their true entries size the result)."""


def _site() -> str:
    """Where the nearest frame outside torch and the detectors is, as ``path:line`` (the code that made the op)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    return f"{os.path.relpath(name, ROOT) if name.startswith(str(ROOT)) else name}:{frame.f_lineno}"


class StepCounter(DeviceDiscipline):
    """:class:`DeviceDiscipline` that counts, per step (:meth:`next_step`), host reads of device tensors by anyone,
    host-to-device copies and call checks across ranks, each by ``what (at path:line)``."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, collections.Counter]] = []

    def next_step(self) -> None:
        self.steps.append({kind: collections.Counter() for kind in ("reads", "copies", "checks")})

    def count(self, kind: str, what: str) -> None:
        if self.steps:
            self.steps[-1][kind][f"{what} (at {_site()})"] += 1

    def host_read(self, what: str) -> None:
        self.count("reads", what)

    def __enter__(self) -> StepCounter:
        import mesh_cp.runtime.check as check

        super().__enter__()
        real = check.check_same

        def counted_check(*args, **kwargs):
            self.count("checks", "check_same")
            return real(*args, **kwargs)

        real_apply = BackwardCFunction.apply

        def apply(ctx, *grads):  # torch runs a custom Function's backward with no function mode: push them again
            with _Placement(self), _Transfers(self):
                return real_apply(ctx, *grads)

        self._stack.enter_context(_patched(check, "check_same", counted_check))
        self._stack.enter_context(_patched(BackwardCFunction, "apply", apply))
        self._stack.enter_context(_Transfers(self))  # entered last: sees each call before the placement modes
        self._stack.enter_context(_DataSized(self))
        return self


class _Transfers(TorchFunctionMode):
    """Host-to-device copies, and device-to-host copies (host reads), by the placement of :class:`StepCounter`."""

    def __init__(self, counter: StepCounter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, c = kwargs or {}, self.c
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            parsed = {k: v for k, v in kwargs.items() if k != "copy"}
            device = torch.device("cpu") if func is torch.Tensor.cpu else torch._C._nn._parse_to(*args[1:], **parsed)[0]
            if device is not None and device.type == "cpu" and c.is_host(args[0]) != _is_host_device(device):
                c.count("copies", "to(device)") if c.is_host(args[0]) else c.host_read("cpu()")
        elif func in (torch.tensor, torch.as_tensor) and not _is_host_device(kwargs.get("device")):
            if not isinstance(args[0], torch.Tensor) or c.is_host(args[0]):
                c.count("copies", f"torch.{func.__name__}(host data, device=...)")
        elif func in (torch.Tensor.copy_, torch.Tensor.__setitem__) and not c.is_host(args[0]):
            source = args[1] if func is torch.Tensor.copy_ else args[2]
            if isinstance(source, torch.Tensor) and c.is_host(source) and source.dim() > 0:
                c.count("copies", f"{func.__name__} of a host tensor")
        return func(*args, **kwargs)


class _DataSized(TorchDispatchMode):
    """Ops on device tensors whose output size is read from the data on the host (a sync on CUDA)."""

    def __init__(self, counter: StepCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func._opname
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        indices = pytree.tree_leaves(args[1]) if name in _INDEXING else []
        boolean = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
        by_tensor = func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if (boolean or by_tensor or "unique" in name) and any(not self.c.is_host(x) for x in tensors):
            self.c.host_read(f"aten.{name} sized by the data")
        return func(*args, **kwargs)


# --- the training run, on every rank ------------------------------------------------------------------------


def packing(seed: int) -> AttentionMask:
    """Every row: short documents (up to 7 tokens) up to a point in the first half-chunk, one long document to a point
    in the last, short ones after, then 0 to 2 tokens of padding, all drawn anew. The long document leaves the
    blocks between the middle chunks whole, so the collective schedule also runs unmasked blocks as chunk calls
    beside the blocks the mask cuts."""
    rng, lengths = random.Random(seed), []
    for _ in range(BATCH):
        start, stop, end = rng.randrange(1, SEQ // 8), rng.randrange(SEQ - SEQ // 8, SEQ - 2), SEQ - rng.randrange(3)
        lengths.append([*_short(rng, start), stop - start, *_short(rng, end - stop)])
    return AttentionMask.from_lengths(lengths)


def _short(rng: random.Random, total: int) -> list[int]:
    """Lengths of 1 to 7 tokens summing to ``total``."""
    out = []
    while total > 0:
        out.append(min(total, rng.randrange(1, 8)))
        total -= out[-1]
    return out


class Layer(torch.nn.Module):
    """Projections around one mesh-attention call with the step's mask, and a residual."""

    def __init__(self, mesh, schedule: str, kernel: str) -> None:
        super().__init__()
        self.mesh, self.schedule, self.kernel = mesh, schedule, kernel
        self.qkv = torch.nn.Linear(MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE)
        self.out = torch.nn.Linear(MODEL, MODEL, device=DEVICE)

    def forward(self, h: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        o = mesh_cp.mesh_attn_func(
            q.reshape(b, s, HEADS, HEAD_DIM),
            k.reshape(b, s, KV_HEADS, HEAD_DIM),
            v.reshape(b, s, KV_HEADS, HEAD_DIM),
            mesh=self.mesh,
            causal=True,
            layout="zigzag",
            kernel=self.kernel,
            schedule=self.schedule,
            mask=mask,
        )
        return h + self.out(o.reshape(b, s, MODEL))


def train(mesh, schedule: str, kernel: str, seed: int) -> dict:
    """:data:`STEPS` steps of :data:`LAYERS` layers, a new packing each, under a :class:`StepCounter`: per step the
    reads, copies and checks; the placement violations; the last loss."""
    torch.manual_seed(seed)
    with StepCounter() as counter:
        layers = torch.nn.ModuleList(Layer(mesh, schedule, kernel) for _ in range(LAYERS))
        optimizer = torch.optim.SGD(layers.parameters(), lr=0.01)
        for step in range(STEPS):
            counter.next_step()
            mask = packing(seed * 100 + step)
            h = torch.randn(BATCH, SEQ // WORLD, MODEL, device=DEVICE)
            for layer in layers:
                h = layer(h, mask)
            loss = h.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "steps": [{kind: dict(seen) for kind, seen in step.items()} for step in counter.steps],
        "violations": counter.violations,
        "loss": loss.item(),
    }


def _planted(mesh) -> dict:
    """The collective schedule on ``cpu_flash`` with a ``bool()`` of a device tensor in the LSE merge (skip a
    partial that attends nothing), a ``tolist()`` in the backward (a nan check) and ``document_ids`` uncached (a
    copy in every layer)."""
    import mesh_cp.runtime.attention as attention
    import mesh_cp.runtime.call as call
    import mesh_cp.runtime.executors as executors
    from mesh_cp.core import numerics

    real_merge, real_delta = call.merge_, executors.attention_delta

    def merge_(o_acc, lse_acc, o_new, lse_new):
        if bool(torch.isinf(lse_new).all()):  # the planted read
            return
        real_merge(o_acc, lse_acc, o_new, lse_new)

    def document_ids(mask, batch, seq_len, device):
        return numerics._document_ids.__wrapped__(mask, batch, seq_len, torch.device(device))

    def attention_delta(do, out, dlse=None):
        delta = real_delta(do, out, dlse)
        if delta.isnan().any().tolist():  # the planted read in backward (seen by no dispatch mode)
            raise FloatingPointError("nan in the backward")
        return delta

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(call, "merge_", merge_))
        stack.enter_context(_patched(executors, "attention_delta", attention_delta))
        stack.enter_context(_patched(attention, "document_ids", document_ids))
        return train(mesh, "collective", "cpu_flash", seed=len(CASES) + 1)


def worker(rank: int, world: int) -> dict:
    """Every case, then the planted one, in one group (sections: a case that raises fails its own tests)."""
    torch.set_num_threads(1)
    mesh = mesh_cp.CPMesh.create(torch.distributed.group.WORLD, tile=TILE)
    sections = {name: (lambda r, w, s=s, k=k, i=i: train(mesh, s, k, seed=i + 1))
                for i, (name, (s, k)) in enumerate(CASES.items())}  # fmt: skip
    sections[PLANTED] = lambda r, w: _planted(mesh)
    return run_sections(sections, rank, world)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn_gloo(worker, WORLD)


def _later_steps(results: list[dict]) -> list[tuple[int, int, dict]]:
    """``(rank, step, counts)`` of every step after the first, on every rank."""
    steps = [(rank, res["steps"]) for rank, res in enumerate(results)]
    return [(rank, step, counts) for rank, counted in steps for step, counts in enumerate(counted) if step]


@pytest.mark.parametrize("case", CASES)
def test_masked_steps_read_nothing_back_and_check_nothing(runs, case) -> None:
    """After the first step, a step with a new packing makes no host read of a device tensor and no call check."""
    results = section_results(runs, case)
    for rank, res in enumerate(results):
        assert res["violations"] == {}, (rank, res["violations"])
        assert len(res["steps"]) == STEPS and math.isfinite(res["loss"]), (rank, res)
        assert res["steps"][0]["checks"], (rank, "the first step made no call check: the counter did not run")
    for rank, step, counts in _later_steps(results):
        assert counts["reads"] == {} and counts["checks"] == {}, (rank, step, counts)


@pytest.mark.parametrize("case", CASES)
def test_masked_steps_copy_the_document_ids_once(runs, case) -> None:
    """After the first step, the one host-to-device copy of a step is the new mask's document ids, made in the first
    layer and reused by the others."""
    for rank, step, counts in _later_steps(section_results(runs, case)):
        assert list(counts["copies"].values()) == [1], (rank, step, counts["copies"])
        assert "mesh_cp/core/numerics.py" in next(iter(counts["copies"])), (rank, step, counts["copies"])


def test_counter_catches_a_planted_read_and_per_layer_copies(runs) -> None:
    """The planted ``bool()`` in the merge and ``tolist()`` in the backward are read in every layer of every step,
    and the uncached ids copied in every layer."""
    for rank, step, counts in _later_steps(section_results(runs, PLANTED)):
        for what in ("aten._local_scalar_dense", "tolist()"):
            reads = sum(n for k, n in counts["reads"].items() if k.startswith(what))
            assert reads >= LAYERS, (rank, step, what, counts["reads"])
        assert sum(counts["copies"].values()) == LAYERS, (rank, step, counts["copies"])


def test_reference_builds_no_dense_mask_from_segments(runs) -> None:
    """The reference kernel, which takes dense masks, runs chunk calls group by group with its own causal flag and
    masked tiles with masks built on the device: no step, the first included, copies a mask built from segments on
    the host (:func:`mesh_cp.kernels.varlen.segments_mask`)."""
    steps = [step["copies"] for res in section_results(runs, "collective, reference") for step in res["steps"]]
    assert steps and not any("mesh_cp/kernels/varlen.py" in site for copies in steps for site in copies), steps


def _touch(x: torch.Tensor) -> None:
    """One of each read and copy :class:`StepCounter` counts, on tensors placed like ``x``."""
    x.sum().item(), x.tolist(), x.cpu(), x[x > 1], x.nonzero(), torch.unique(x)
    x.repeat_interleave(torch.ones(3, dtype=torch.int64, device=x.device))
    torch.ones(2).to(x.device), torch.tensor([1.0], device=x.device), x.new_zeros(2).copy_(torch.ones(2))
    x[0:2] = torch.ones(2)


def test_counter_sees_each_read_and_copy_of_a_device_tensor() -> None:
    """Each kind of read and copy is counted once on a device tensor, none on a host one."""
    with StepCounter() as counter:
        for x in (torch.arange(1.0, 4.0), torch.arange(1.0, 4.0, device=DEVICE)):
            counter.next_step()
            _touch(x)
    host, device = (
        {kind: sorted(k.split(" (at ")[0] for k in seen) for kind, seen in s.items()} for s in counter.steps
    )
    assert host == {"reads": [], "copies": [], "checks": []}, host
    sized = [f"aten.{op} sized by the data" for op in ("_unique2", "index", "repeat_interleave")]
    reads = ["aten._local_scalar_dense", "aten.nonzero", *sized, "cpu()", "tolist()"]
    assert device["reads"] == sorted(reads), device["reads"]
    copies = [
        "__setitem__ of a host tensor",
        "copy_ of a host tensor",
        "to(device)",
        "torch.tensor(host data, device=...)",
    ]
    assert device["copies"] == sorted(copies), device["copies"]
