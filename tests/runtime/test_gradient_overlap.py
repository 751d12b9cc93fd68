"""Gradient reduction overlapped with backward (Note [Overlapped gradient reduction]), on 4 gloo ranks (DP 2 x CP 2,
and CP 4): the same gradients as the blocking reduce and as one process computing the whole loss, one all-reduce
per bucket launched while backward still runs, parameters some ranks or every rank leave unused, accumulation over
micro-batches, several steps, and torch DDP over the same group."""

from __future__ import annotations

import pytest
import torch

from mesh_cp.runtime.gradients import gradient_buckets
from mesh_cp.testing import expect_error, run_sections, section_results, spawn_gloo

WORLD = 4
SMALL = 1100  # bytes: splits the fp32 layers into several buckets


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
    import torch.distributed as dist

    import mesh_cp

    return mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2)), mesh_cp.DataContextParallel.create(
        dist.group.WORLD, cp_size=2, tile=(1, 2)
    )


def equal_section(rank: int, world: int) -> dict:
    """Blocking and overlapped reduce of the same backward, over CP 4 and over DP 2 x CP 2, default and small
    buckets; a hook on ``l1.weight`` (the last gradient backward makes), registered first, counts the all-reduces
    already launched when that gradient arrives."""
    import mesh_cp
    from mesh_cp.debug import CommCounter

    mesh, layout = layouts()
    results = {}
    for over in ("cp", "dp x cp"):
        divide = 1 if over == "cp" else layout.dp_size
        reference = Net()
        (sum(loss_of(reference, r) for r in range(world)) / divide).backward()  # one process, the whole loss
        for name, bucket_bytes in (("default", None), ("small", SMALL)):
            options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            row = {}
            for form in ("blocking", "overlapped"):
                model = Net()
                before_last = []
                model.l1.weight.register_post_accumulate_grad_hook(lambda p: before_last.append(reduces(counter)))
                if form == "overlapped":
                    make = (
                        layout.overlap_gradients
                        if over == "dp x cp"
                        else lambda m, **o: mesh_cp.overlap_gradients(m, mesh, **o)
                    )
                    reduction = make(model, **options)
                with CommCounter() as counter:
                    loss_of(model, rank).backward()
                    if form == "blocking":
                        count = (
                            layout.reduce_gradients
                            if over == "dp x cp"
                            else lambda m, **o: mesh_cp.reduce_gradients(m, mesh, **o)
                        )(model, **options)
                    else:
                        count = reduction.finish()
                row[form] = {
                    "grads": grads(model),
                    "count": count,
                    "reduces": reduces(counter),
                    "before_last": before_last,
                }
            results[f"{name}, {over}"] = {
                "vs blocking": rel_errors(row["overlapped"]["grads"], row["blocking"]["grads"]),
                "vs one process": rel_errors(row["overlapped"]["grads"], grads(reference)),
                **{f"{form} {k}": v for form, r in row.items() for k, v in r.items() if k != "grads"},
            }
    return results


def unused_section(rank: int, world: int) -> dict:
    """``side`` is used by rank 0 only, ``never`` by no rank: ``unused="zeros"`` reduces zeros for them on every
    rank alike, and ``never`` keeps no gradient, as in one process; ``unused="error"`` names them, on the ranks that
    lack them, after the same collectives."""
    import torch.distributed as dist

    _, layout = layouts()
    model = Net(side=True, never=True)
    reduction = layout.overlap_gradients(model)
    loss_of(model, rank, use_side=rank == 0).backward()
    count = reduction.finish()
    reference = Net(side=True, never=True)
    (sum(loss_of(reference, r, use_side=r == 0) for r in range(world)) / layout.dp_size).backward()
    want = grads(reference)  # never: None, as in one process
    out = {"count": count, "buckets": reduction.num_buckets, "errors": rel_errors(grads(model), want)}
    out["never is None"] = all(p.grad is None for p in model.never.parameters())
    out["side is set"] = all(p.grad is not None for p in model.side.parameters())  # rank 0's, on every rank
    strict = Net(side=True)
    refusing = layout.overlap_gradients(strict, unused="error")
    loss_of(strict, rank, use_side=rank == 0).backward()
    try:
        out["error"] = f"returned {refusing.finish()}"
    except RuntimeError as err:
        out["error"] = str(err)
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the ranks are still in step: this pairs with itself on every rank
    out["in step"] = probe.item() == world
    return out


def accumulate_section(rank: int, world: int) -> dict:
    """Three steps of SGD over two micro-batches each (the first under ``no_sync``), ``zero_grad`` with and without
    ``set_to_none``: the same parameters as the blocking reduce, no all-reduce in the ``no_sync`` backward, and the
    gradients left as views of the buckets."""
    from mesh_cp.debug import CommCounter

    _, layout = layouts()
    models = {"blocking": Net(bf16=False), "overlapped": Net(bf16=False)}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    reduction = layout.overlap_gradients(models["overlapped"], bucket_bytes=SMALL)
    out = {"no_sync reduces": [], "counts": [], "views": []}
    for step in range(3):
        for form, model in models.items():
            optims[form].zero_grad(set_to_none=step != 1)
            if form == "blocking":
                for micro in (0, 1):
                    loss_of(model, rank, micro=2 * step + micro).backward()
                layout.reduce_gradients(model)
            else:
                with CommCounter() as counter, reduction.no_sync():
                    loss_of(model, rank, micro=2 * step).backward()
                out["no_sync reduces"].append(reduces(counter))
                loss_of(model, rank, micro=2 * step + 1).backward()
                out["counts"].append(reduction.finish())
                storages = {b.untyped_storage().data_ptr() for b in reduction.buffers}
                out["views"].append(all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters()))
        if step == 0:
            out["first step grads"] = rel_errors(grads(models["overlapped"]), grads(models["blocking"]))
            out["buckets"] = reduction.num_buckets
        for optim in optims.values():
            optim.step()
    params = {k: {n: p.detach().double() for n, p in m.named_parameters()} for k, m in models.items()}
    out["params"] = rel_errors(params["overlapped"], params["blocking"])
    return out


def misuse_section(rank: int, world: int) -> dict:
    """A second backward without ``finish()``, ``finish()`` inside ``no_sync()``, an unknown ``unused``."""
    _, layout = layouts()
    model = Net(bf16=False)
    reduction = layout.overlap_gradients(model)
    checks: dict = {}
    loss_of(model, rank).backward()
    expect_error(
        checks,
        "second backward",
        RuntimeError,
        r"a second backward since the last finish\(\)",
        lambda: loss_of(model, rank).backward(),
    )
    reduction.finish()  # drains what the refused step launched (alike on every rank)
    with reduction.no_sync():
        expect_error(checks, "finish in no_sync", RuntimeError, r"finish\(\) inside no_sync\(\)", reduction.finish)
    expect_error(
        checks,
        "unused",
        ValueError,
        r"unused 'ignore' is not supported",
        lambda: layout.overlap_gradients(Net(), unused="ignore"),
    )
    frozen = Net().requires_grad_(False)
    expect_error(
        checks, "frozen", ValueError, r"no parameter that requires a gradient", lambda: layout.overlap_gradients(frozen)
    )
    reduction.remove()
    changing = Net(bf16=False)
    reduction = layout.overlap_gradients(changing)
    changing.l1.weight.requires_grad_(False)  # frozen after the buckets were made
    loss_of(changing, rank).backward()
    expect_error(
        checks, "requires_grad changed", RuntimeError, r"requires_grad changed .* for \['l1.weight'\]",
        reduction.finish,
    )  # fmt: skip
    probe = torch.ones(1)
    torch.distributed.all_reduce(probe)  # still in step
    checks["in step after the change"] = probe.item() == world
    reduction.remove()
    return checks


def ddp_section(rank: int, world: int) -> dict:
    """torch DDP over all DP x CP ranks averages over the 4 ranks; mesh_cp sums over CP and averages over DP: the
    loss times ``cp_size`` gives mesh_cp's gradients under DDP."""
    from torch.nn.parallel import DistributedDataParallel

    _, layout = layouts()
    blocking = Net(bf16=False)
    loss_of(blocking, rank).backward()
    layout.reduce_gradients(blocking)
    out = {}
    for factor in (1, layout.mesh.size):
        model = Net(bf16=False)
        ddp = DistributedDataParallel(model, process_group=layout.group)
        (loss_of(ddp, rank) * factor).backward()
        want = {n: g / layout.mesh.size * factor for n, g in grads(blocking).items()}
        out[f"loss x {factor}"] = rel_errors(grads(model), want)
    return out


SECTIONS = {
    "equal": equal_section,
    "unused": unused_section,
    "accumulate": accumulate_section,
    "misuse": misuse_section,
    "ddp": ddp_section,
}


def overlap_worker(rank: int, world: int) -> dict[str, dict]:
    return run_sections(SECTIONS, rank, world)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, dict]]:
    return spawn_gloo(overlap_worker, WORLD)


def expected_buckets(bucket_bytes: int | None, **net) -> int:
    params = [p for p in Net(**net).parameters()][::-1]
    return len(gradient_buckets(params) if bucket_bytes is None else gradient_buckets(params, bucket_bytes))


def test_overlapped_equals_blocking_and_launches_during_backward(world4) -> None:
    # against one process, the bf16 l3.weight differs by bf16 rounding (gloo adds the ranks' bf16 gradients in
    # bf16); every fp32 gradient agrees to 1e-6, and every gradient with the blocking reduce
    tol = {"l1.weight": 1e-6, "l1.bias": 1e-6, "l2.weight": 1e-6, "l2.bias": 1e-6, "l3.weight": 2e-2}
    assert expected_buckets(None) == 2 and expected_buckets(SMALL) == 4  # bf16 | fp32; bf16 | l2 | l1.bias | l1.weight
    for rank, res in enumerate(section_results(world4, "equal")):
        for key, r in res.items():
            want = expected_buckets(SMALL if key.startswith("small") else None)
            assert r["overlapped count"] == r["overlapped reduces"] == want, (rank, key, r)
            assert max(r["vs blocking"].values()) <= 1e-6, (rank, key, r["vs blocking"])  # the same bf16 bucket
            assert all(e <= tol[n] for n, e in r["vs one process"].items()), (rank, key, r["vs one process"])
            # the blocking reduce starts after backward: nothing launched when l1.weight's gradient arrives; the
            # overlapped one has launched every bucket before l1.weight's (the last one)
            assert r["blocking before_last"] == [0], (rank, key, r)
            assert r["overlapped before_last"] == [want - 1], (rank, key, r)


def test_unused_parameters_reduce_zeros_or_are_named(world4) -> None:
    for rank, r in enumerate(section_results(world4, "unused")):
        assert r["count"] == r["buckets"] == expected_buckets(None, side=True, never=True), (rank, r)
        assert all(e <= 2e-2 if n == "l3.weight" else e <= 1e-6 for n, e in r["errors"].items()), (rank, r["errors"])
        assert r["never is None"] and r["side is set"] and r["in step"], (rank, r)
        if rank == 0:
            assert r["error"] == f"returned {expected_buckets(None, side=True)}", r["error"]
        else:
            assert "2 parameter(s) got no gradient on this rank" in r["error"], (rank, r["error"])
            assert "side.bias, side.weight" in r["error"] and "unused='zeros'" in r["error"], (rank, r["error"])


def test_accumulation_over_micro_batches_and_several_steps(world4) -> None:
    for rank, r in enumerate(section_results(world4, "accumulate")):
        assert r["buckets"] == expected_buckets(SMALL, bf16=False) > 1, (rank, r)
        assert r["no_sync reduces"] == [0, 0, 0] and r["counts"] == [r["buckets"]] * 3, (rank, r)
        assert r["views"] == [True] * 3, (rank, r)
        assert max(r["first step grads"].values()) <= 1e-6, (rank, r["first step grads"])
        assert max(r["params"].values()) <= 1e-6, (rank, r["params"])


def test_misuse_is_refused_by_name(world4) -> None:
    for rank, checks in enumerate(section_results(world4, "misuse")):
        assert all(v is True for v in checks.values()) and len(checks) == 6, (rank, checks)


def test_ddp_over_the_dp_by_cp_group_is_mesh_cp_divided_by_cp_size(world4) -> None:
    for rank, r in enumerate(section_results(world4, "ddp")):
        for key, errors in r.items():
            assert max(errors.values()) <= 1e-6, (rank, key, errors)
