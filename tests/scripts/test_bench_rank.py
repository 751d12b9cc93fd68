"""``scripts/bench_rank.py --quick`` on CPU: it exits 0 and prints its tables, and its JSON has a row per head
layout, mask and schedule and a decode row per head layout, positive times, fractions of the single call's rate in
``(0, 5)``, the kernel calls counted in rank 0's forward equal to what the plan says (collective: its program;
overlapped: the programs of its runs), and a baseline whose causal pairs match rank 0's.

The overlapped schedule's replay without communication (Note [Replayed overlapped schedule] in the script) against
the collective rows on the same chunks: rank 0's own rows after the replayed forward are its partial rows of the
collective schedule merged with the partial the last reduce step lands, and its ``dq`` and ``dk, dv`` after the
replayed backward are the collective partials plus the landed ones; its forward makes the calls of the plan's runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesh_cp.core import AttentionMask, AttentionShape, Tiling, make_plan, most_square_tile
from mesh_cp.core.numerics import attention_delta, document_ids, merged
from mesh_cp.kernels import resolve_kernel
from mesh_cp.runtime.call import AttentionCall, Saved
from mesh_cp.runtime.executors import backward_blocks, forward_blocks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_rank.py"
WORLD, L, HEADS, HEAD_DIM = 16, 128, 4, 64
MASKS = ("causal", "packed long", "packed mixed", "packed short")
SCHEDULES = ("collective", "overlap")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_rank", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_rank_quick(tmp_path: Path) -> None:
    out = tmp_path / "rank.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--world", str(WORLD), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["world"], doc["head_dim"], doc["kernel"], doc["dtype"]) == (WORLD, HEAD_DIM, "cpu_flash", "float32")
    assert doc["schedules"] == list(SCHEDULES)
    layouts = {(HEADS, HEADS), (HEADS, HEADS // 4)}
    train = {
        (r["L"], (r["heads"], r["kv_heads"]), r["mask"], r["schedule"]): r for r in doc["rows"] if r["kind"] == "train"
    }
    decode = {(r["L"], (r["heads"], r["kv_heads"])): r for r in doc["rows"] if r["kind"] == "decode"}
    assert len(train) == len([r for r in doc["rows"] if r["kind"] == "train"])
    assert set(train) == {(L, hk, m, s) for hk in layouts for m in MASKS for s in SCHEDULES}
    assert set(decode) == {(L, hk) for hk in layouts}
    table = [line for line in proc.stdout.splitlines() if line.startswith(f"| {L} |")]
    assert len(table) == len(train) + len(decode)
    assert sum(f"| {s} |" in line for line in table for s in SCHEDULES) == len(train)

    a, b = most_square_tile(WORLD)
    for (_, (heads, kv_heads), mask, schedule), r in train.items():
        assert r["ms_fwd"] > 0 and r["ms_bwd"] > 0 and r["single_ms"] > 0 and r["tflops"] > 0
        assert 0 < r["fraction"] < 5, r
        assert r["kernel_calls"] == r["plan_kernel_calls"] > 0
        n = r["single_tokens"]
        assert abs(n * (n + 1) // 2 - r["pairs"]) <= n
        other = train[(L, (heads, kv_heads), mask, "overlap" if schedule == "collective" else "collective")]
        assert (r["pairs"], r["blocks"], r["single_ms"]) == (other["pairs"], other["blocks"], other["single_ms"])
        if mask == "causal":
            shape = AttentionShape(batch=1, seq_local=L, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, itemsize=4)
            plan = make_plan(Tiling(WORLD, a, b), shape, causal=True, layout="zigzag")
            assert r["blocks"] == len(plan.blocks(0)) == a * b
            assert r["masked_blocks"] == 0 and r["pairs"] == plan.pairs(0)
            if schedule == "collective":
                # cpu_flash takes no segments: each Q chunk is its two halves (the diagonal's chunk one call more each)
                assert a <= r["kernel_calls"] <= 2 * a + 2 < r["blocks"]
            else:
                # nor does the overlapped schedule join a run of blocks for it (Note [Rows of the overlapped schedule])
                assert r["kernel_calls"] == r["blocks"]
        else:
            assert r["pairs"] < train[(L, (heads, kv_heads), "causal", schedule)]["pairs"]
    for r in decode.values():
        assert r["context"] == WORLD * L
        assert r["rank_ms"] > 0 and r["single_ms"] > 0 and r["ratio"] > 0 and r["local_step_ms"] > 0
        assert r["kernel"] == "local step"  # the flash decode kernel runs on CUDA only


def test_bench_rank_schedules_option() -> None:
    bench = load_script()
    assert bench.parse_args(["--device", "cpu"]).schedules == SCHEDULES
    assert bench.parse_args(["--device", "cpu", "--schedules", "overlap"]).schedules == ("overlap",)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--schedules", "ring"])


@pytest.mark.parametrize(
    ("world", "packed", "backward"),
    [(8, False, "regather"), (8, True, "regather"), (16, False, "regather"), (16, True, "reuse")],
)
def test_overlap_replay_against_collective(world: int, packed: bool, backward: str) -> None:
    bench = load_script()
    seq_local, heads, kv_heads, dim = 32, 2, 1, 16
    a, b = most_square_tile(world)
    # documents of 1 to 80 tokens: blocks without keys, masked blocks, documents over chunk and ring boundaries
    lengths = bench.document_lengths(world * seq_local, 1, 80, seed=world)
    mask = AttentionMask.from_lengths([lengths]) if packed else None
    shape = AttentionShape(batch=1, seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=4)
    kernel = bench.CountingKernel(
        resolve_kernel("auto", torch.device("cpu"), torch.float32, dim, needs=("mask|segments",))
    )
    doc_ids = None if mask is None else document_ids(mask, 1, world * seq_local, torch.device("cpu"))
    opts = {"causal": True, "layout": "zigzag", "mask": mask, "backward": backward}
    calls = {
        s: AttentionCall(
            mesh=bench.NoMesh(),
            plan=make_plan(Tiling(world, a, b), shape, schedule=s, **opts),
            kernel=kernel,
            scale=dim**-0.5,
            doc_ids=doc_ids,
        )
        for s in SCHEDULES
    }
    gen = torch.Generator().manual_seed(world + packed)
    data = {
        "q": torch.randn((a, 1, seq_local, heads, dim), generator=gen),
        "do": torch.randn((a, 1, seq_local, heads, dim), generator=gen),
        "kv": torch.randn((b, 2, 1, seq_local, kv_heads, dim), generator=gen),
    }
    with torch.no_grad():
        o_acc, lse_acc = forward_blocks(calls["collective"], 0, data["q"], data["kv"])
        delta = torch.stack([attention_delta(data["do"][i], o_acc[i]) for i in range(a)])
        data["stats"] = torch.stack((lse_acc, delta), dim=1)
        dq_acc, dkv_acc = backward_blocks(calls["collective"], 0, data["q"], data["do"], data["stats"], data["kv"])

        call = calls["overlap"]
        inputs = bench.replay_inputs(call, data, torch.Generator().manual_seed(7))
        landed = inputs["forward"][1]["q"][a - 2].clone()  # step a - 2 lands offset 0: rank 0's own rows
        kernel.calls = 0
        out, lse, gathered = bench.replay_forward(call, inputs)
        runs = call.plan.overlap_calls(0, "forward")
        assert kernel.calls == sum(len(call.run(0, "forward", t)[1].calls) for t in runs) > 0
        assert kernel.calls == bench.overlap_kernel_calls(call)
        n_o = out.numel()
        want_o, want_lse = merged(o_acc[0], lse_acc[0], landed[:n_o].view_as(out), landed[n_o:].view_as(lse))
        torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)

        # backward from the collective's partial rows, so that offset 0's lse and delta are the collective's
        dq_landed, dkv_landed = (inputs["backward"][1][ring][n - 2].clone() for ring, n in (("q", a), ("kv", b)))
        k, v = data["kv"][0]
        saved = Saved(q=data["q"][0], k=k, v=v, out=o_acc[0].clone(), lse=lse_acc[0].clone(), gathered=gathered)
        dq, dkv = bench.replay_backward(call, inputs, saved)
        torch.testing.assert_close(dq, dq_acc[0] + dq_landed, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.stack(dkv), dkv_acc[0] + dkv_landed, rtol=1e-4, atol=1e-5)
        assert torch.isfinite(dq).all() and all(torch.isfinite(g).all() for g in dkv)
