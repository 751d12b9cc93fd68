"""Device discipline of the three examples (accelerate, DeepSpeed, Megatron-core) and of generation (the accelerate
generation example: prefill under the mesh, tree decoding over the sharded cache), checked on the CPU.

On a GPU the launcher picks a device (``accelerator.device``, ``engine.device``, ``cuda:LOCAL_RANK``) that
is not where tensors are made by default (the CPU): a model or batch that is never moved reaches the
model's forward or an NCCL collective from the wrong device, and a device tensor read on the host
(``.item()``, ``int()``, ``bool()``) stalls the GPU every step. Here there is one real device, so
:class:`DeviceDiscipline` makes a second, virtual one while an example runs:

- *host*: a tensor made by a factory (``torch.tensor``, ``zeros``, ``arange``, ``from_numpy``, ...) with no
  ``device=`` or with ``device="cpu"``, or computed from host tensors only. This is the CPU of a GPU machine.
- *the launcher's device*, ``cpu:0`` (accelerate's CPU device; DeepSpeed's CPU accelerator is made to say
  ``cpu:0``; Megatron's ``run`` gets it): a tensor made with ``device=cpu:0`` (or the ``.device`` of a device
  tensor), moved there with ``.to(cpu:0)``, or computed from any device tensor. ``.to(...)`` and ``.cpu()``
  copy across, as on a GPU. ``Tensor.device`` reports ``cpu:0`` for device tensors and ``cpu`` for host
  ones, so ``.to(x.device)`` and ``device=x.device`` behave as on a GPU.

Placement lives on storages (views, ``Parameter``s and ``param.data`` share it), is set by a
``TorchFunctionMode`` (factories, moves) and carried through every aten op, backward included, by a
``TorchDispatchMode``. Where torch or mesh_cp picks a process group's device by its backend (gloo: the
CPU), it gets the launcher's device, as it would on NCCL. Recorded as violations:

- a host tensor (an input, parameter or buffer) reaching a module's forward;
- a host tensor in a ``c10d`` collective (``torch.distributed``, and everything built on it);
- an op mixing a host tensor of one or more dimensions with a device tensor (CUDA refuses it; a 0-dim host
  tensor is a scalar to CUDA, and copies and indexing are allowed: their result is where their first tensor
  is);
- from the first forward on, a host read (``_local_scalar_dense``: ``item``/``int``/``float``/``bool``;
  ``equal``, ``nonzero``, ``tolist``) of a *device* tensor whose nearest caller outside torch is
  mesh_cp's own code (``mesh_cp/``, ``integrations/``, ``examples/``) that happens more than once (a check made on the
  first call and cached is fine; one made every step or every layer is not), unless its line is marked
  ``# host sync: printed`` (the one read per step that prints the loss) or ``# host sync: once per call
  signature`` (the mesh's call check, made for each new shape of call: training and evaluation are two, at most
  :data:`SIGNATURES` are allowed). Host reads inside transformers, DeepSpeed or Megatron are theirs, not counted.

What it cannot catch: tensors made outside the factories above (unpickled by ``torch.load``, made in C++
by a library, a list turned into an index) count as on the device; code that only runs on CUDA
(``CudaStep``, NCCL-only branches, TransformerEngine) does not run here; ops inside ``torch.compile``d code
are not seen; the checkpoint/resume paths are not run (``test_accelerate``, ``test_deepspeed`` and
``test_megatron`` run them); a host read through the buffer protocol is not seen (``numpy()`` of a device
tensor is recorded as a violation, ``memoryview`` is not), nor one made only once (a cached check).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from mesh_cp.testing import spawn_gloo

ROOT = Path(__file__).resolve().parents[2]
HOST = torch.device("cpu")
DEVICE = torch.device("cpu", 0)
PRINTED = "# host sync: printed"
PER_SIGNATURE = "# host sync: once per call signature"
SIGNATURES = 4
"""The most call signatures an example may check (a read at a PER_SIGNATURE line each)."""
OURS = tuple(str(ROOT / folder) + os.sep for folder in ("mesh_cp", "integrations", "examples"))
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
THIS_FILE = str(Path(__file__).resolve())

_FACTORIES = set(_device_constructors()) | {torch.from_numpy, torch.frombuffer}
_NEW = {torch.Tensor.new_tensor, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
        torch.Tensor.new_full}  # fmt: skip
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
_NO_TENSOR_COLLECTIVES = {"barrier", "monitored_barrier"}
_SYNC_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "is_nonzero"}
_MIX_OK = {"copy_", "_to_copy", "index", "index_put_", "_index_put_impl_", "index_put", "lift_fresh", "detach"}


def _is_host_device(device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    return device.type == "cpu" and device.index is None


def _caller() -> tuple[str, int] | None:
    """The nearest Python frame outside torch, this file and dispatch modes (which pass ops on, such as
    ``mesh_cp.CommCounter``): ``(file, line)``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != THIS_FILE and frame.f_code.co_name != "__torch_dispatch__":
            return name, frame.f_lineno
        frame = frame.f_back
    return None


def _site(caller: tuple[str, int] | None) -> str:
    if caller is None:
        return "?"
    name, line = caller
    short = os.path.relpath(name, ROOT) if name.startswith(str(ROOT)) else name.split("site-packages" + os.sep)[-1]
    return f"{short}:{line}"


class DeviceDiscipline:
    """``with DeviceDiscipline() as d: run_example()``; then ``d.violations`` (what a GPU would refuse or
    stall on, with counts), ``d.reads`` (unmarked host reads of device tensors by our code, with counts)
    and ``d.printed`` (the marked ones). See the module docstring."""

    def __init__(self) -> None:
        self._host: weakref.WeakSet = weakref.WeakSet()
        self._violations: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        self.printed: dict[str, int] = {}
        self.per_signature: dict[str, int] = {}
        self.armed = False
        self._stack = contextlib.ExitStack()

    # placement -----------------------------------------------------------------------------------
    def is_host(self, t) -> bool:
        try:
            return isinstance(t, torch.Tensor) and t.untyped_storage() in self._host
        except (RuntimeError, NotImplementedError, TypeError):
            return False

    def place(self, out, host: bool):
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                if host:
                    self._host.add(storage)
                else:
                    self._host.discard(storage)
        return out

    def move(self, src: torch.Tensor, out: torch.Tensor, host: bool) -> torch.Tensor:
        """``out = src.to(...)``: copy when the placement changes (as a GPU does), then place it."""
        if self.is_host(out) != host and out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
            out = out.clone()
        return self.place(out, host)

    def violation(self, kind: str, what: str) -> None:
        key = f"{kind}: {what} (at {_site(_caller())})"
        self._violations[key] = self._violations.get(key, 0) + 1

    @property
    def violations(self) -> dict[str, int]:
        """Everything recorded, and the host reads made more than once."""
        reads = {f"repeated host read of a device tensor: {k}": n for k, n in self.reads.items() if n > 1}
        reads |= {f"more call checks than signatures: {k}": n for k, n in self.per_signature.items() if n > SIGNATURES}
        return self._violations | reads

    def host_read(self, what: str) -> None:
        if not self.armed:
            return
        caller = _caller()
        if caller is None or not caller[0].startswith(OURS):
            return  # a library's own read, not ours
        line = linecache.getline(caller[0], caller[1])
        key = f"{what} in `{line.strip()}` (at {_site(caller)})"
        seen = self.printed if PRINTED in line else self.per_signature if PER_SIGNATURE in line else self.reads
        seen[key] = seen.get(key, 0) + 1

    # context -------------------------------------------------------------------------------------
    def __enter__(self) -> DeviceDiscipline:
        import torch.distributed.distributed_c10d as c10d

        import mesh_cp.runtime.groups

        def on_device(real):
            def group_device(*args, **kwargs):
                device = real(*args, **kwargs)
                return DEVICE if _is_host_device(device) else device

            return group_device

        stack = self._stack
        real_group_device = mesh_cp.runtime.groups.group_device
        for module in [m for name, m in sys.modules.items() if name.startswith("mesh_cp")]:
            if getattr(module, "group_device", None) is real_group_device:
                stack.enter_context(_patched(module, "group_device", on_device(real_group_device)))
        stack.enter_context(_patched(c10d, "_get_object_coll_device", on_device(c10d._get_object_coll_device)))
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook)
        stack.callback(handle.remove)
        stack.enter_context(_Propagation(self))
        stack.enter_context(_Placement(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _forward_pre_hook(self, module, args):
        self.armed = True
        name = type(module).__name__
        for t in pytree.tree_leaves(args):
            if self.is_host(t):
                self.violation("forward", f"{name} got a host input of shape {tuple(t.shape)}")
        for kind, tensors in (
            ("parameter", module.parameters(recurse=False)),
            ("buffer", module.buffers(recurse=False)),
        ):
            for t in tensors:
                if self.is_host(t):
                    self.violation("forward", f"{name} has a host {kind} of shape {tuple(t.shape)}")


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class _Placement(TorchFunctionMode):
    """Factories, moves and ``Tensor.device`` (see the module docstring)."""

    def __init__(self, tracker: DeviceDiscipline):
        super().__init__()
        self.t = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = self.t
        if func == torch.Tensor.device.__get__:
            real = func(*args)
            return (HOST if t.is_host(args[0]) else DEVICE) if real.type == "cpu" else real
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            if not any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args, kwargs))):
                t.place(out, _is_host_device(kwargs.get("device")))
            return out
        if func is torch.Tensor.to:
            parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to reads no copy= (generate passes it)
            device = torch._C._nn._parse_to(*args[1:], **parsed)[0]
            out = func(*args, **kwargs)
            if device is None or device.type != "cpu":
                return out
            return t.move(args[0], out, _is_host_device(device))
        if func is torch.Tensor.cpu:
            return t.move(args[0], func(*args, **kwargs), True)
        if func in _NEW:
            out = func(*args, **kwargs)
            host = t.is_host(args[0]) if kwargs.get("device") is None else _is_host_device(kwargs["device"])
            return t.place(out, host)
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and not t.is_host(args[0]):
            if func is torch.Tensor.numpy:
                t.violation("numpy", f"numpy() of a device tensor of shape {tuple(args[0].shape)}")
            else:
                t.host_read("tolist()")
        return func(*args, **kwargs)


class _Propagation(TorchDispatchMode):
    """Carries placement through aten ops; checks collectives, mixed ops and host reads."""

    def __init__(self, tracker: DeviceDiscipline):
        super().__init__()
        self.t = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = self.t
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        name = func._opname
        if func.namespace in _COLLECTIVE_NAMESPACES:
            if name not in _NO_TENSOR_COLLECTIVES:
                for x in tensors:
                    if t.is_host(x):
                        t.violation(
                            "collective", f"{func.namespace}.{name} got a host tensor of shape {tuple(x.shape)}"
                        )
            return func(*args, **kwargs)
        host = [x for x in tensors if t.is_host(x)]
        device = [x for x in tensors if not t.is_host(x)]
        if name == "fill_" and t.is_host(args[0]):
            # ``host[i:j] = 3`` fills with a 0-dim tensor torch makes in C++ (unseen here, so counted as on the
            # device); CUDA fills from a 0-dim value on any device.
            device = [x for x in device if x.dim() > 0]
        if name in _SYNC_OPS and device:
            t.host_read(f"aten.{name}")
        if host and device and name not in _MIX_OK and any(x.dim() > 0 for x in host):
            shapes = [tuple(x.shape) for x in host]
            t.violation("mixed devices", f"aten.{name} mixes host tensors {shapes} with device tensors")
        out = func(*args, **kwargs)
        if name in _MIX_OK:  # a copy or an indexing op: the result is where its first tensor is
            t.place(out, t.is_host(tensors[0]))
        elif host and not device:
            t.place(out, True)
        return out


# --- the examples, in one spawned group of 4 ----------------------------------------------------------

TINY = ["--hidden", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--vocab", "300",
        "--corpus-mb", "0.03", "--seq-len", "64", "--steps", "2", "--reference"]  # fmt: skip


def _accelerate(rank: int, world: int) -> DeviceDiscipline:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from examples.accelerate import finetune

    os.environ |= {"ACCELERATE_USE_CPU": "true", "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    accelerator = Accelerator()  # joins the spawned group; its device is cpu:0
    assert accelerator.device == DEVICE, accelerator.device
    try:
        with DeviceDiscipline() as tracker:
            finetune.train(finetune.parse_args(TINY), accelerator)
    finally:
        AcceleratorState._reset_state(True)
    return tracker


def _deepspeed(rank: int, world: int) -> DeviceDiscipline:
    from deepspeed.accelerator import get_accelerator

    from examples.deepspeed import finetune

    accelerator = get_accelerator()
    config = str(ROOT / "configs" / "ds_mesh_cp_zero2.json")
    args = finetune.parse_args([*TINY, "--deepspeed_config", config, "--local_rank", str(rank)])
    with contextlib.ExitStack() as stack:  # DeepSpeed's CPU accelerator names the launcher's device cpu:0
        stack.enter_context(_patched(accelerator, "device_name", lambda device_index=None: "cpu:0"))
        stack.enter_context(_patched(accelerator, "current_device_name", lambda: "cpu:0"))
        tracker = stack.enter_context(DeviceDiscipline())
        finetune.train(args)
    return tracker


def _megatron(rank: int, world: int, data_dir: str) -> DeviceDiscipline:
    from megatron.core import parallel_state as ps

    from examples.megatron import pretrain_gpt

    config = str(ROOT / "configs" / "megatron_cpu_test.yaml")
    args = pretrain_gpt.parse_args(["--config", config, "--steps", "2", "--corpus-mb", "0.05", "--data-dir", data_dir])
    try:
        with DeviceDiscipline() as tracker:
            pretrain_gpt.run(args, DEVICE)
    finally:
        ps.destroy_model_parallel()
    return tracker


def _generate(rank: int, world: int) -> DeviceDiscipline:
    """The generation example: prefill under the mesh and tree decoding, on the launcher's device."""
    from examples.accelerate import generate

    args = generate.parse_args([*TINY, "--prompt-tokens", "150", "--new-tokens", "4"])
    with DeviceDiscipline() as tracker:
        generate.run(args, DEVICE)
    return tracker


def examples_worker(rank: int, world: int, data_dir: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    out = {}
    for name, run in (("accelerate", _accelerate), ("deepspeed", _deepspeed), ("megatron", _megatron)):
        tracker = run(rank, world, data_dir) if name == "megatron" else run(rank, world)
        out[name] = {"violations": tracker.violations, "reads": tracker.reads, "printed": tracker.printed}
    tracker = _generate(rank, world)
    out["generate"] = {"violations": tracker.violations, "reads": tracker.reads, "printed": tracker.printed}
    return out


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> list[dict]:
    for module in ("accelerate", "deepspeed", "megatron.core"):
        pytest.importorskip(module)
    return spawn_gloo(examples_worker, 4, str(tmp_path_factory.mktemp("megatron_data")))


@pytest.mark.parametrize("example", ["accelerate", "deepspeed", "megatron", "generate"])
def test_example_keeps_tensors_on_the_launchers_device(examples, example) -> None:
    for rank, result in enumerate(examples):
        assert result[example]["violations"] == {}, (rank, result[example]["violations"])


@pytest.mark.parametrize("example", ["accelerate", "deepspeed", "megatron"])
def test_example_reads_the_device_only_to_print(examples, example) -> None:
    """The marked per-step read (the printed loss) is seen, so the detector ran; nothing else is read."""
    for rank, result in enumerate(examples):
        assert result[example]["printed"], (rank, "the printed loss was never read: the detector did not run")
        assert all(n >= 2 for n in result[example]["printed"].values()), result[example]["printed"]


# --- the detector itself, in this process ---------------------------------------------------------------


def test_detector_catches_what_a_gpu_would_refuse() -> None:
    """Each kind of violation is seen, and the same code with the moves done is clean."""
    torch.manual_seed(0)
    with DeviceDiscipline() as bad:
        model = torch.nn.Linear(4, 4)  # never moved
        x = torch.randn(2, 4)
        model(x)
        int(model(x).sum())  # a read after the first forward, from this file: not ours, not counted
        torch.ones(3, device=DEVICE) + torch.arange(3)  # mixes a host vector into a device op
    kinds = sorted({k.split(":")[0] for k in bad.violations})
    assert kinds == ["forward", "mixed devices"], bad.violations
    assert any("host parameter" in k for k in bad.violations) and any("host input" in k for k in bad.violations)

    with DeviceDiscipline() as good:
        model = torch.nn.Linear(4, 4).to(DEVICE)
        x = torch.randn(2, 4).to(DEVICE)
        y = model(x)
        assert y.device == DEVICE and x.cpu().device == HOST and torch.arange(2).device == HOST
        assert torch.arange(4)[[1, 2]].device == HOST and y[:, torch.tensor([0, 1])].device == DEVICE  # indexing
        torch.ones(3, device=y.device) + torch.tensor(2.0)  # a host scalar is allowed, as on CUDA
        y.sum().backward()
        assert model.weight.grad.device == DEVICE
    assert good.violations == {}, good.violations


def _run_as_ours(source: str, **names) -> None:
    """Run ``source`` as if it were a file of mesh_cp's integrations (its lines visible to linecache)."""
    name = str(ROOT / "integrations" / "_host_read_probe.py")
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        exec(compile(source, name, "exec"), names)
    finally:
        linecache.cache.pop(name, None)


def test_detector_sees_host_reads_in_our_code() -> None:
    """A read of a device tensor from mesh_cp's code is counted per line (a repeated one is a violation)
    unless the line is marked as printed; reads of host tensors, and reads before the first forward, are
    free."""
    source = f"int(x)\nfloat(x)  {PRINTED}\nbool(x > 0)\n"
    with DeviceDiscipline() as tracker:
        _run_as_ours(source, x=torch.tensor(2.0, device=DEVICE))  # not armed yet: setup
        tracker.armed = True
        _run_as_ours(source, x=torch.tensor(2.0))  # host
        _run_as_ours(source, x=torch.tensor(2.0, device=DEVICE))
        assert tracker.violations == {}, tracker.violations  # each line read once so far
        _run_as_ours(source, x=torch.tensor(3.0, device=DEVICE))
    probe = "integrations/_host_read_probe.py"
    assert tracker.reads == {
        f"aten._local_scalar_dense in `int(x)` (at {probe}:1)": 2,
        f"aten._local_scalar_dense in `bool(x > 0)` (at {probe}:3)": 2,
    }, tracker.reads
    assert sorted(tracker.violations) == [f"repeated host read of a device tensor: {k}" for k in sorted(tracker.reads)]
    assert tracker.printed == {f"aten._local_scalar_dense in `float(x)  {PRINTED}` (at {probe}:2)": 2}


def test_megatron_loss_share_reads_no_count_on_the_host() -> None:
    """``training.loss_share`` checks a device count where it is (no ``int()`` per step), and still refuses 0."""
    pytest.importorskip("megatron.core")
    from mesh_cp.integrations.megatron import training

    per_token, mask = torch.ones(2, 3), torch.ones(2, 3)
    with DeviceDiscipline() as tracker:
        tracker.armed = True
        share = training.loss_share(per_token.to(DEVICE), mask.to(DEVICE), torch.tensor(6.0, device=DEVICE))
    assert tracker.violations == {} and tracker.reads == {}, (tracker.violations, tracker.reads)
    assert share.item() == 1.0
    for zero in (0, torch.tensor(0.0)):
        with pytest.raises(ValueError, match=r"global_tokens must be >= 1"):
            training.loss_share(per_token, mask, zero)


# --- launchers: the GPU is bound before the NCCL group is made --------------------------------------


class _Stop(Exception):
    pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine with 8 GPUs where this process is LOCAL_RANK 3 of 8 under torchrun; records
    ``torch.cuda.set_device`` and stops at ``init_process_group``."""
    import torch.distributed as dist

    events: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    def set_device(device):
        events.append(("set_device", device if isinstance(device, int) else torch.device(device).index))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)

    def init_process_group(backend=None, *args, **kwargs):
        events.append(("init_process_group", backend))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    env = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    return events


def test_accelerate_example_binds_the_gpu_before_the_nccl_group(fake_cuda) -> None:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from examples.accelerate import finetune

    try:
        with pytest.raises(_Stop):
            finetune.main(TINY)
    finally:
        AcceleratorState._reset_state(True)
    assert fake_cuda[:2] == [("set_device", 3), ("init_process_group", "nccl")], fake_cuda


def test_megatron_example_binds_the_gpu_before_the_nccl_group(fake_cuda) -> None:
    pytest.importorskip("megatron.core")
    from examples.megatron import pretrain_gpt

    with pytest.raises(_Stop):
        pretrain_gpt.main(["--steps", "1"])
    assert fake_cuda == [("set_device", 3), ("init_process_group", "nccl")], fake_cuda


def test_deepspeed_initialize_binds_the_gpu_before_the_nccl_group(monkeypatch) -> None:
    """``mesh_cp.integrations.deepspeed.initialize`` (the DeepSpeed example's) sets the accelerator's device
    to ``LOCAL_RANK`` before ``deepspeed.init_distributed`` makes the (device-bound) NCCL group."""
    pytest.importorskip("deepspeed")
    import deepspeed
    import deepspeed.accelerator

    from mesh_cp.integrations import deepspeed as mesh_ds

    events: list = []

    class CudaAccelerator:
        def device_name(self, device_index=None):
            return "cuda"

        def communication_backend_name(self):
            return "nccl"

        def set_device(self, index):
            events.append(("set_device", index))

    def init_distributed(dist_backend=None, **kwargs):
        events.append(("init_distributed", dist_backend))
        raise _Stop

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: CudaAccelerator())
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setenv("LOCAL_RANK", "3")
    config = {"train_micro_batch_size_per_gpu": 1, "mesh_attention": {"enabled": True, "cp_size": 4, "tile": "2x2"}}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(_Stop):
        mesh_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert events == [("set_device", 3), ("init_distributed", "nccl")], events
