"""torch's DDP over CP and over DP x CP with mesh_cp's scaling (Note [DDP over DP x CP]), on 4 gloo ranks (CP 4 tiled
2x2, and DP 2 x CP 2): the gradients of one process computing the whole loss (summed over CP, averaged over DP),
all-reduces launched while backward runs, DDP's own options passed through, parameters some ranks or no rank use,
accumulation over micro-batches with ``no_sync()``, plain DDP's scaling beside it, and the refused keywords."""

from __future__ import annotations

import pytest
import torch

from mesh_cp.testing import expect_error, run_sections, section_results, spawn_gloo

WORLD = 4
SMALL_MB = 1100 / 2**20  # bucket_cap_mb that splits the fp32 layers into several buckets


class Net(torch.nn.Module):
    """Three layers called in registration order (the last in bf16 when ``bf16``), a ``side`` layer only the
    ranks given ``use_side`` call, and a ``never`` layer no forward calls."""

    def __init__(self, bf16: bool = True, side: bool = False, never: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.l3 = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16 if bf16 else torch.float32)
        self.side = torch.nn.Linear(8, 8) if side else None
        self.never = torch.nn.Linear(8, 4) if never else None

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        out = self.l3(h.to(self.l3.weight.dtype)).float()
        return out + self.side(h) if self.side is not None and use_side else out


def loss_of(model: torch.nn.Module, rank: int, micro: int = 0, **kwargs) -> torch.Tensor:
    """Rank ``rank``'s share of the loss on its micro-batch ``micro``."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + 10 * rank + micro))
    return (model(x, **kwargs) ** 2).mean()


def reference_grads(world: int, divide: int, **net) -> dict[str, torch.Tensor | None]:
    """One process: the gradients of the sum of every rank's loss share, divided by ``divide`` (the DP size)."""
    reference = Net(**net)
    (sum(loss_of(reference, r, use_side=r == 0) for r in range(world)) / divide).backward()
    return grads(reference)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().double().clone() for n, p in model.named_parameters()}


def rel_errors(got: dict, want: dict) -> dict[str, float]:
    """Relative max error per parameter (``inf`` where one has a gradient and the other not)."""
    out = {}
    for name, w in want.items():
        g = got[name]
        if g is None or w is None:
            out[name] = 0.0 if g is None and w is None else float("inf")
        else:
            out[name] = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    return out


def reduces(counter) -> int:
    return sum(r.op == "all_reduce" for r in counter.records)


def layouts():
    """CP 4 (tile 2x2) over the world, and DP 2 x CP 2 (tile 1x2)."""
    import torch.distributed as dist

    import mesh_cp

    return mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2)), mesh_cp.DataContextParallel.create(
        dist.group.WORLD, cp_size=2, tile=(1, 2)
    )


def wrap(over: str, model: torch.nn.Module, **ddp_options):
    """``model`` in DDP over CP alone (``mesh_cp.data_parallel``) or over DP x CP (``layout.data_parallel``)."""
    import mesh_cp

    mesh, layout = layouts()
    if over == "cp":
        return mesh_cp.data_parallel(model, mesh=mesh, **ddp_options)
    return layout.data_parallel(model, **ddp_options)


def equal_section(rank: int, world: int) -> dict:
    """Two backward passes (the same loss, gradients zeroed between) through DDP over CP 4 and over DP 2 x CP 2,
    default and small buckets, against one process; a hook on ``l1.weight`` (the last gradient backward makes),
    registered before DDP's, counts the all-reduces already launched when that gradient arrives. DDP puts every
    parameter of a dtype in one bucket for the first backward and rebuilds the buckets in the order of its
    gradients after it."""
    from mesh_cp.debug import CommCounter

    results = {}
    for over, divide in (("cp", 1), ("dp x cp", 2)):
        want = reference_grads(world, divide)
        for name, options in (("default", {}), ("small", {"bucket_cap_mb": SMALL_MB})):
            model = Net()
            before_last = []
            model.l1.weight.register_post_accumulate_grad_hook(lambda p: before_last.append(reduces(counter)))
            ddp = wrap(over, model, **options)
            row: dict = {"errors": [], "reduces": [], "before last": before_last}
            for _ in range(2):
                model.zero_grad()
                with CommCounter() as counter:
                    loss_of(ddp, rank).backward()
                row["errors"].append(rel_errors(grads(model), want))
                row["reduces"].append(reduces(counter))
            results[f"{name}, {over}"] = row
    return results


def unused_section(rank: int, world: int) -> dict:
    """``side`` is used by rank 0 only, ``never`` by no rank. With ``find_unused_parameters=True``: ``side`` gets
    rank 0's gradient on every rank, ``never`` keeps none, as in one process. Without it, a parameter no rank used
    makes the next forward raise."""
    _, layout = layouts()
    model = Net(side=True, never=True)
    ddp = layout.data_parallel(model, find_unused_parameters=True)
    loss_of(ddp, rank, use_side=rank == 0).backward()
    out = {"errors": rel_errors(grads(model), reference_grads(world, layout.dp_size, side=True, never=True))}
    out["never is None"] = all(p.grad is None for p in model.never.parameters())
    out["side is set"] = all(p.grad is not None for p in model.side.parameters())
    strict = layout.data_parallel(Net(never=True))
    loss_of(strict, rank).backward()
    expect_error(out, "without find_unused_parameters", RuntimeError, "find_unused_parameters=True", lambda: strict(
        torch.zeros(1, 16)
    ))  # fmt: skip
    return out


def accumulate_section(rank: int, world: int) -> dict:
    """Three SGD steps over two micro-batches each (the first under ``no_sync()``), ``zero_grad`` with and without
    ``set_to_none``, DDP's ``gradient_as_bucket_view`` and small buckets: the parameters of one process stepping on
    the sum over ranks and micro-batches divided by DP; no all-reduce in a ``no_sync()`` backward."""
    from mesh_cp.debug import CommCounter

    _, layout = layouts()
    model, reference = Net(bf16=False), Net(bf16=False)
    ddp = layout.data_parallel(model, bucket_cap_mb=SMALL_MB, gradient_as_bucket_view=True)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    out: dict = {"no_sync reduces": [], "reduces": []}
    for step in range(3):
        for optim in optims:
            optim.zero_grad(set_to_none=step != 1)
        with CommCounter() as counter, ddp.no_sync():
            loss_of(ddp, rank, micro=2 * step).backward()
        out["no_sync reduces"].append(reduces(counter))
        with CommCounter() as counter:
            loss_of(ddp, rank, micro=2 * step + 1).backward()
        out["reduces"].append(reduces(counter))
        total = sum(loss_of(reference, r, micro=2 * step + m) for r in range(world) for m in (0, 1))
        (total / layout.dp_size).backward()
        if step == 0:
            out["first step grads"] = rel_errors(grads(model), grads(reference))
        for optim in optims:
            optim.step()
    params = [{n: p.detach().double() for n, p in m.named_parameters()} for m in (model, reference)]
    out["params"] = rel_errors(*params)
    return out


def plain_ddp_section(rank: int, world: int) -> dict:
    """Plain DDP over all DP x CP ranks averages over the 4 ranks: mesh_cp's gradients divided by ``cp_size``; its
    loss times ``cp_size`` gives mesh_cp's (Note [DDP over DP x CP])."""
    from torch.nn.parallel import DistributedDataParallel

    _, layout = layouts()
    want = reference_grads(world, layout.dp_size, bf16=False)
    out = {}
    for factor in (1, layout.mesh.size):
        model = Net(bf16=False)
        ddp = DistributedDataParallel(model, process_group=layout.group)
        (loss_of(ddp, rank) * factor).backward()
        out[f"loss x {factor}"] = rel_errors(grads(model), {n: g / layout.mesh.size * factor for n, g in want.items()})
    return out


def refused_section(rank: int, world: int) -> dict:
    """The keywords the layout provides or that would average outside the hook, the former reductions, a model
    already wrapped or with nothing to train, and a second communication hook (DDP takes one)."""
    import mesh_cp

    mesh, layout = layouts()
    checks: dict = {}
    refused = ("process_group", "device_mesh", "mixed_precision")
    for name in (*refused, "delay_all_reduce_named_params", "param_to_hook_all_reduce"):
        expect_error(checks, name, ValueError, rf"DataContextParallel.data_parallel\(\) does not take {name}=", (
            lambda name=name: layout.data_parallel(Net(), **{name: None})
        ))  # fmt: skip
    expect_error(checks, "cp process_group", ValueError, r"mesh_cp.data_parallel\(\) does not take process_group=",
                 lambda: mesh_cp.data_parallel(Net(), mesh=mesh, process_group=mesh.group))  # fmt: skip
    for name, call in {
        "reduce_gradients": lambda: mesh_cp.reduce_gradients(Net(), mesh),
        "overlap_gradients": lambda: mesh_cp.overlap_gradients(Net(), mesh),
        "layout.reduce_gradients": lambda: layout.reduce_gradients(Net()),
        "layout.overlap_gradients": lambda: layout.overlap_gradients(Net()),
    }.items():
        fix = "layout.data_parallel" if name.startswith("layout") else "mesh_cp.data_parallel"
        expect_error(checks, name, NotImplementedError, rf"{name.split('.')[-1]} was replaced by .*{fix}", call)
    frozen = Net().requires_grad_(False)
    expect_error(checks, "frozen", ValueError, "no parameter that requires a gradient", (
        lambda: layout.data_parallel(frozen)
    ))  # fmt: skip
    ddp = layout.data_parallel(Net())
    expect_error(checks, "wrapped", ValueError, "already wrapped in DistributedDataParallel; pass ddp.module", (
        lambda: layout.data_parallel(ddp)
    ))  # fmt: skip
    expect_error(checks, "second hook", RuntimeError, "can only be called once", (
        lambda: ddp.register_comm_hook(None, lambda state, bucket: None)
    ))  # fmt: skip
    return checks


SECTIONS = {
    "equal": equal_section,
    "unused": unused_section,
    "accumulate": accumulate_section,
    "plain ddp": plain_ddp_section,
    "refused": refused_section,
}


def gradients_worker(rank: int, world: int) -> dict[str, dict]:
    return run_sections(SECTIONS, rank, world)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, dict]]:
    return spawn_gloo(gradients_worker, WORLD)


def test_sum_over_cp_and_mean_over_dp_equal_one_process(world4) -> None:
    # against one process the bf16 l3.weight differs by bf16 rounding (its bucket is divided and summed in bf16);
    # every fp32 gradient agrees to 1e-6
    tol = {"l1.weight": 1e-6, "l1.bias": 1e-6, "l2.weight": 1e-6, "l2.bias": 1e-6, "l3.weight": 2e-2}
    for rank, res in enumerate(section_results(world4, "equal")):
        assert set(res) == {"default, cp", "small, cp", "default, dp x cp", "small, dp x cp"}, res
        for key, r in res.items():
            for errors in r["errors"]:
                assert all(e <= tol[n] for n, e in errors.items()), (rank, key, errors)
            # one bucket per dtype (bf16 | fp32), then rebuilt: with 1100-byte buckets the fp32 layers in two
            small = key.startswith("small")
            assert r["reduces"] == [2, 3 if small else 2], (rank, key, r)
            # the all-reduce of a bucket of the last layers starts while backward still computes l1.weight's gradient
            assert r["before last"][0] == 1 and (r["before last"][1] >= 1 or not small), (rank, key, r)


def test_unused_parameters(world4) -> None:
    for rank, r in enumerate(section_results(world4, "unused")):
        assert all(e <= 2e-2 if n == "l3.weight" else e <= 1e-6 for n, e in r["errors"].items()), (rank, r["errors"])
        assert r["never is None"] is True and r["side is set"] is True, (rank, r)
        assert r["without find_unused_parameters"] is True, (rank, r)


def test_accumulation_with_no_sync(world4) -> None:
    for rank, r in enumerate(section_results(world4, "accumulate")):
        # one fp32 bucket in the first step, then rebuilt in two of about 1100 bytes
        assert r["no_sync reduces"] == [0, 0, 0] and r["reduces"] == [1, 2, 2], (rank, r)
        assert max(r["first step grads"].values()) <= 1e-6, (rank, r["first step grads"])
        assert max(r["params"].values()) <= 1e-6, (rank, r["params"])


def test_plain_ddp_over_the_layout_is_mesh_cp_divided_by_cp_size(world4) -> None:
    for rank, r in enumerate(section_results(world4, "plain ddp")):
        assert set(r) == {"loss x 1", "loss x 2"}, r
        for key, errors in r.items():
            assert max(errors.values()) <= 1e-6, (rank, key, errors)


def test_refused_by_name(world4) -> None:
    for rank, checks in enumerate(section_results(world4, "refused")):
        assert all(v is True for v in checks.values()) and len(checks) == 13, (rank, checks)
