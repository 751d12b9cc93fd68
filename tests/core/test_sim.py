"""The simulator and the ``mesh-cp`` command: traffic per link class, timing bounds, tile choice."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from mesh_cp.cli import main
from mesh_cp.core import AttentionShape, Tiling, factorizations, make_plan
from mesh_cp.sim import (
    Topology,
    choose_tile,
    describe_links,
    group_links,
    plan_for_topology,
    rank_traffic,
    simulate,
    simulate_ulysses,
    ulysses_unavailable,
)

PHASES = ("forward", "backward")


def topo(*, bandwidth: float = 1e6, pairs_per_second: float = 1e9, rpn: int = 4, latency: float = 0.0) -> Topology:
    """Uniform links (intra = inter); the defaults are communication-heavy for :func:`shape`."""
    return Topology(
        ranks_per_node=rpn,
        intra_bandwidth=bandwidth,
        inter_bandwidth=bandwidth,
        pairs_per_second=pairs_per_second,
        intra_latency=latency,
        inter_latency=latency,
    )


def shape(*, heads: int = 8, kv_heads: int = 8, seq_local: int = 64, itemsize: int = 2) -> AttentionShape:
    return AttentionShape(batch=1, seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=16, itemsize=itemsize)


def plans(world: int, s: AttentionShape, **kwargs):
    for a, b in factorizations(world):
        for backward in ("regather", "reuse"):
            for schedule in ("overlap", "collective"):
                yield make_plan(
                    Tiling(world=world, a=a, b=b),
                    s,
                    causal=True,
                    layout="zigzag",
                    backward=backward,
                    schedule=schedule,
                    **kwargs,
                )


def test_sim_and_cli_do_not_import_torch() -> None:
    code = "import sys, mesh_cp.sim, mesh_cp.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# Topology


def test_topology_round_trips_through_json_and_rejects_bad_input() -> None:
    t = Topology.h100_infiniband(head_dim=128)
    assert t.pairs_per_second == pytest.approx(4e14 / 512)
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match=r"unknown Topology keys \['bandwidth'\]"):
        Topology.from_dict({**t.to_dict(), "bandwidth": 1.0})
    with pytest.raises(ValueError, match=r"missing \['pairs_per_second'\]"):
        Topology.from_dict({k: v for k, v in t.to_dict().items() if k != "pairs_per_second"})
    with pytest.raises(ValueError, match="inter_bandwidth must be > 0, got 0"):
        dataclasses.replace(t, inter_bandwidth=0)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        dataclasses.replace(t, ranks_per_node=8.0)
    with pytest.raises(ValueError, match="unknown topology preset 'tpu'"):
        Topology.preset("tpu")


# ----------------------------------------------------------------------------------------------
# Traffic and placement


@pytest.mark.parametrize(("world", "rpn", "kv_heads"), [(12, 4, 8), (16, 4, 2), (8, 8, 8), (6, 1, 4)])
def test_traffic_per_link_class_sums_to_the_plan(world: int, rpn: int, kv_heads: int) -> None:
    topology = topo(rpn=rpn)
    for plan in plans(world, shape(kv_heads=kv_heads, itemsize=4)):
        for phase in PHASES:
            for rank in range(world):
                by_ring = rank_traffic(plan, topology, phase, rank)
                assert by_ring["q"].total == plan.bytes_sent(phase, group="q")
                assert by_ring["kv"].total == plan.bytes_sent(phase, group="kv")
            assert simulate(plan, topology).forward.traffic.total == plan.bytes_sent("forward")
            assert simulate(plan, topology).backward.traffic.total == plan.bytes_sent("backward")


def test_q_group_inside_a_node_keeps_q_traffic_intra_and_kv_traffic_inter() -> None:
    topology = topo(rpn=4)
    plan = make_plan(Tiling(world=16, a=4, b=4), shape(), causal=True, layout="zigzag")
    assert group_links(plan.tiling, topology) == {"q": "intra", "kv": "inter"}
    assert describe_links(plan.tiling, topology) == "Q ring inside a node, KV ring across nodes"
    for phase in PHASES:
        for rank in range(16):
            by_ring = rank_traffic(plan, topology, phase, rank)
            assert by_ring["q"].inter == 0 and by_ring["q"].intra == plan.bytes_sent(phase, group="q") > 0
            assert by_ring["kv"].intra == 0 and by_ring["kv"].inter == plan.bytes_sent(phase, group="kv") > 0
    # A Q-group of two nodes: the ranks at the boundary (3 and 7 of ring 0..7) send Q across nodes.
    wide = make_plan(Tiling(world=16, a=8, b=2), shape(), causal=True, layout="zigzag")
    assert group_links(wide.tiling, topology)["q"] == "inter"
    crossing = [g for g in range(16) if rank_traffic(wide, topology, "forward", g)["q"].inter]
    assert crossing == [3, 7, 11, 15]


def test_ring_sends_across_nodes_only_at_node_boundaries() -> None:
    topology = topo(rpn=4)
    ring = make_plan(Tiling(world=8, a=1, b=8), shape(), causal=True, layout="zigzag")
    inter = [rank_traffic(ring, topology, "forward", g)["kv"].inter > 0 for g in range(8)]
    assert inter == [False, False, False, True, False, False, False, True]
    assert simulate(ring, topology).forward.traffic.inter == ring.bytes_sent("forward")  # the boundary rank


def test_offsets_map_to_the_ranks_blocks_with_the_diagonal_at_zero() -> None:
    plan = make_plan(Tiling(world=12, a=3, b=4), shape(), causal=True, layout="zigzag")
    for rank in range(12):
        blocks = {(i, j): plan.block_at(rank, i, j) for i in range(3) for j in range(4)}
        assert sorted(blocks.values(), key=lambda w: (w.x, w.y)) == sorted(plan.blocks(rank), key=lambda w: (w.x, w.y))
        assert (blocks[(0, 0)].x, blocks[(0, 0)].y) == (rank, rank)
        assert (blocks[(1, 2)].x, blocks[(1, 2)].y) == ((rank - rank % 3) + (rank - 1) % 3, (rank - 6) % 12)


# ----------------------------------------------------------------------------------------------
# Timing


@pytest.mark.parametrize("pairs_per_second", [1e7, 1e9, 1e12])
def test_ring_forward_is_bounded_by_its_communication_and_its_compute(pairs_per_second: float) -> None:
    topology = topo(pairs_per_second=pairs_per_second, latency=1e-4)
    s = shape()
    ring = make_plan(Tiling(world=16, a=1, b=16), s, causal=True, layout="zigzag")
    fwd = simulate(ring, topology).forward
    comm = 15 * topology.transfer_time("inter", ring.chunk_bytes()[1])
    compute = ring.pairs(0) * s.batch * s.heads / pairs_per_second
    assert fwd.compute == pytest.approx(compute)
    assert max(comm, compute) <= fwd.time <= comm + compute


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_fast_network_makes_every_tile_compute_bound(layout: str) -> None:
    topology = topo(bandwidth=1e18, pairs_per_second=1e6)
    s = shape(kv_heads=2)
    for a, b in factorizations(16):
        for schedule in ("overlap", "collective"):
            plan = make_plan(Tiling(world=16, a=a, b=b), s, causal=True, layout=layout, schedule=schedule)
            busiest = max(plan.pairs(g) for g in range(16)) * s.batch * s.heads / 1e6
            result = simulate(plan, topology)
            assert result.forward.compute == pytest.approx(busiest)
            assert result.forward.time == pytest.approx(busiest, rel=1e-3)
            assert result.backward.time == pytest.approx(2.5 * busiest, rel=1e-3)


@pytest.mark.parametrize("pairs_per_second", [1e7, 1e9, 1e12])
@pytest.mark.parametrize("rpn", [1, 4])
def test_overlap_is_never_slower_than_collective(pairs_per_second: float, rpn: int) -> None:
    """True for every setting in this model, not only comm-heavy ones: while the overlapped replay
    waits, the transfer waited for (or one queued ahead of it) is on the wire, so its time is at most
    compute + the sum of its transfers; those carry the same bytes as the collectives with no more
    messages, and the collective schedule pays compute + all of them."""
    topology = topo(pairs_per_second=pairs_per_second, rpn=rpn, latency=1e-5)
    for plan in plans(16, shape(kv_heads=4)):
        if plan.schedule == "overlap":
            other = dataclasses.replace(plan, schedule="collective")
            for phase in PHASES:
                assert getattr(simulate(plan, topology), phase).time <= getattr(simulate(other, topology), phase).time


def test_overlap_hides_communication_when_compute_dominates() -> None:
    topology = topo(bandwidth=1e9, pairs_per_second=1e8)
    plan = make_plan(Tiling(world=16, a=4, b=4), shape(), causal=True, layout="zigzag")
    overlap, collective = simulate(plan, topology), simulate(dataclasses.replace(plan, schedule="collective"), topology)
    exposed = [r.forward.time - r.forward.compute for r in (overlap, collective)]
    assert exposed[0] < 0.5 * exposed[1]


def test_host_cost_of_transfers_slows_overlapped_compute_only() -> None:
    """Bytes moved while computing cost the rank compute time; a waiting rank (collective) pays none."""
    base = topo(bandwidth=1e9, pairs_per_second=1e8)
    costly = dataclasses.replace(base, host_seconds_per_byte=1e-8)
    plan = make_plan(Tiling(world=16, a=4, b=4), shape(), causal=True, layout="zigzag")
    moved = sum(
        2 * plan.step_bytes(phase)[(step.ring, step.kind)] for phase in PHASES for step in plan.overlap(phase).steps()
    )
    slower = simulate(plan, costly).time - simulate(plan, base).time
    assert 0 < slower <= moved * 1e-8 + 1e-12
    collective = dataclasses.replace(plan, schedule="collective")
    assert simulate(collective, costly).time == simulate(collective, base).time


# ----------------------------------------------------------------------------------------------
# Ulysses


def test_ulysses_traffic_and_availability() -> None:
    s = shape(heads=8, kv_heads=8, itemsize=2)
    c = s.chunk_elems * s.itemsize
    result = simulate_ulysses(8, s, topo(rpn=8))
    assert result.forward.traffic.inter == 0
    assert result.forward.traffic.intra == pytest.approx(7 / 8 * 4 * c)  # q, k, v in and o out
    assert result.backward.traffic.total == result.forward.traffic.total  # dO in, dq, dk, dv out
    spread = simulate_ulysses(8, s, topo(rpn=2))
    assert spread.forward.traffic.intra == pytest.approx(1 / 8 * 4 * c)  # one peer shares the node
    gqa = simulate_ulysses(8, shape(heads=8, kv_heads=2), topo())  # K/V heads replicated 4x
    assert gqa.forward.traffic.total == pytest.approx(7 / 8 * 2 * c + 2 * 7 * (c / 4) / 2)
    assert "does not divide heads=8" in ulysses_unavailable(16, s)
    with pytest.raises(NotImplementedError, match="P=16 does not divide heads=8"):
        simulate_ulysses(16, s, topo())


# ----------------------------------------------------------------------------------------------
# Tile choice


def test_choose_tile_is_square_for_mha_and_moves_towards_the_ring_for_gqa() -> None:
    topology = topo()
    mha, _ = choose_tile(16, shape(heads=8, kv_heads=8), topology)
    assert mha.shape == (4, 4)
    gqa, _ = choose_tile(16, shape(heads=8, kv_heads=2), topology)
    mqa, reason = choose_tile(16, shape(heads=32, kv_heads=1), topology)
    assert mqa.a < gqa.a < mha.a
    assert reason.startswith(f"tile {mqa}: predicted") and "vs ring 1x16" in reason


def test_memory_budget_excludes_tiles() -> None:
    topology, s = topo(), shape()
    best, _ = choose_tile(16, s, topology)
    memory = {
        (a, b): simulate(plan_for_topology(Tiling(world=16, a=a, b=b), s, topology), topology).memory
        for a, b in factorizations(16)
    }
    budget = memory[best.shape] - 1
    tile, reason = choose_tile(16, s, topology, memory_budget=budget)
    assert tile != best and memory[tile.shape] <= budget
    assert "over the memory budget" in reason
    with pytest.raises(ValueError, match="raise the budget"):
        choose_tile(16, s, topology, memory_budget=min(memory.values()) - 1)


# ----------------------------------------------------------------------------------------------
# CLI


def cli(seq: int = 4096, *extra: str) -> list[str]:
    return ["plan", "--world", "16", "--seq", str(seq), "--heads", "16", "--head-dim", "64", *extra]


def test_cli_prints_one_row_per_tile_ulysses_and_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(4096, "--ranks-per-node", "4", "--kv-heads", "2", "--memory-budget", "1GiB")) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    for a, b in factorizations(16):
        assert f"{a}x{b}" in rows
    assert rows["1x16"].split()[-2] == "1.00x"  # the ring's speed-up over itself (overlap)
    assert "ulysses" in rows and "unavailable" not in rows["ulysses"]
    assert "chosen tile" in out


def test_cli_reports_bad_input_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(cli(4008))
    assert exit_info.value.code == 2
    assert "pad the sequence to 4032" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(cli(4096, "--memory-budget", "lots"))
    assert "write e.g. '40GiB'" in capsys.readouterr().err


def test_cli_reads_a_topology_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(topo(rpn=16).to_dict()))
    main(cli(4096, "--topology", str(path)))
    out = capsys.readouterr().out
    assert "(1 node(s) x 16)" in out and "intra 0.001 GB/s" in out


def test_cli_plot_writes_a_png(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "scaling.png"
    main(cli(1536, "--plot", str(path)))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"plot written to {path}" in capsys.readouterr().out
