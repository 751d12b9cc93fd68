"""The simulator and the ``mesh-cp`` command: traffic per link class, timing bounds, tile choice."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from mesh_cp.cli import main
from mesh_cp.core import AttentionShape, Tiling, factorizations, head_parallel_unavailable, make_plan
from mesh_cp.sim import (
    Topology,
    Traffic,
    all_to_all_seconds,
    choose,
    describe_links,
    group_links,
    link_cost,
    mesh_group_topology,
    peak_bytes,
    plan_for_topology,
    rank_traffic,
    simulate,
    simulate_candidates,
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
                assert by_ring["heads"] == Traffic()  # u = 1: no head exchange
                assert by_ring["q"].total == plan.bytes_sent(phase, group="q")
                assert by_ring["kv"].total == plan.bytes_sent(phase, group="kv")
            assert simulate(plan, topology).forward.traffic.total == plan.bytes_sent("forward")
            assert simulate(plan, topology).backward.traffic.total == plan.bytes_sent("backward")


def test_q_group_inside_a_node_keeps_q_traffic_intra_and_kv_traffic_inter() -> None:
    topology = topo(rpn=4)
    plan = make_plan(Tiling(world=16, a=4, b=4), shape(), causal=True, layout="zigzag")
    assert group_links(1, plan.tiling, topology) == {"heads": "intra", "q": "intra", "kv": "inter"}
    assert describe_links(1, plan.tiling, topology) == "Q ring inside a node, KV ring across nodes"
    for phase in PHASES:
        for rank in range(16):
            by_ring = rank_traffic(plan, topology, phase, rank)
            assert by_ring["q"].inter == 0 and by_ring["q"].intra == plan.bytes_sent(phase, group="q") > 0
            assert by_ring["kv"].intra == 0 and by_ring["kv"].inter == plan.bytes_sent(phase, group="kv") > 0
    # A Q-group of two nodes: the ranks at the boundary (3 and 7 of ring 0..7) send Q across nodes.
    wide = make_plan(Tiling(world=16, a=8, b=2), shape(), causal=True, layout="zigzag")
    assert group_links(1, wide.tiling, topology)["q"] == "inter"
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


def ulysses(world: int, s: AttentionShape, topology: Topology, **options):
    """Ulysses as a point of the one model: ``u = P`` around the tile ``1 x 1``."""
    return simulate(plan_for_topology(world, Tiling(1, 1, 1), s, topology, **options), topology)


def test_ulysses_traffic_and_availability() -> None:
    s = shape(heads=8, kv_heads=8, itemsize=2)
    c = s.chunk_elems * s.itemsize
    result = ulysses(8, s, topo(rpn=8))
    assert result.forward.traffic.inter == 0
    assert result.forward.traffic.intra == pytest.approx(7 / 8 * 4 * c)  # q, k, v in and o out
    assert result.backward.traffic.total == result.forward.traffic.total  # dO in, dq, dk, dv out
    spread = ulysses(8, s, topo(rpn=2))
    assert spread.forward.traffic.intra == pytest.approx(1 / 8 * 4 * c)  # one peer shares the node
    gqa = ulysses(8, shape(heads=8, kv_heads=2), topo())  # K/V heads replicated 4x
    assert gqa.forward.traffic.total == pytest.approx(7 / 8 * 2 * c + 2 * 7 * (c / 4) / 2)
    assert "head_parallel=16 does not divide the 8 query heads" in head_parallel_unavailable(16, 16, s)
    with pytest.raises(ValueError, match="head_parallel=16 does not divide the 8 query heads"):
        ulysses(16, s, topo())


# ----------------------------------------------------------------------------------------------
# Tile choice


def test_choose_tile_is_square_for_mha_and_moves_towards_the_ring_for_gqa() -> None:
    topology = topo()
    _, mha, _ = choose(16, shape(heads=8, kv_heads=8), topology, head_parallel=1)
    assert mha.shape == (4, 4)
    _, gqa, _ = choose(16, shape(heads=8, kv_heads=2), topology, head_parallel=1)
    u, mqa, reason = choose(16, shape(heads=32, kv_heads=1), topology, head_parallel=1)
    assert u == 1 and mqa.a < gqa.a < mha.a
    assert reason.startswith(f"tile {mqa}: predicted") and "it is the best mesh" in reason


def test_memory_budget_excludes_tiles() -> None:
    topology, s = topo(), shape()
    _, best, _ = choose(16, s, topology, head_parallel=1)
    memory = {
        (a, b): simulate(plan_for_topology(1, Tiling(world=16, a=a, b=b), s, topology), topology).memory
        for a, b in factorizations(16)
    }
    budget = memory[best.shape] - 1
    _, tile, reason = choose(16, s, topology, memory_budget=budget, head_parallel=1)
    assert tile != best and memory[tile.shape] <= budget
    assert "over the memory budget" in reason
    with pytest.raises(ValueError, match="raise the budget"):
        choose(16, s, topology, memory_budget=min(memory.values()) - 1, head_parallel=1)
    with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes or None, got 0"):
        choose(16, s, topology, memory_budget=0)


@pytest.mark.parametrize("schedule", ["overlap", "collective"])
def test_memory_of_every_candidate_is_the_peak_of_its_plan(schedule: str) -> None:
    """The prediction's memory is :func:`peak_bytes` of the plan, for every ``(u, a x b)``: with ``u > 1`` the mesh's
    peak on the mesh shape plus the head-layout copies the exchange holds (forward all it moves, backward dO)."""
    topology, s = topo(rpn=4), shape(heads=8, kv_heads=2)
    results = simulate_candidates(16, s, topology, schedule=schedule)
    assert {u for u, _ in results} == {1, 2, 4, 8}
    for (u, tiling), result in results.items():
        plan = plan_for_topology(u, tiling, s, topology, schedule=schedule)
        assert result.memory == max(peak_bytes(plan, phase) for phase in PHASES)
        copies = {
            phase: sum(t.piece_bytes * u for t in plan.all_to_alls(phase) if t.what in ("q,k,v", "out", "dout"))
            for phase in PHASES
        }
        mesh_only = dataclasses.replace(plan, shape=plan.mesh_shape, head_parallel=1)
        for phase in PHASES:
            assert peak_bytes(plan, phase) == peak_bytes(mesh_only, phase) + copies[phase]
            assert (copies[phase] > 0) == (u > 1)


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


def test_cli_head_parallel_fixes_u_of_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(4096, "--ranks-per-node", "4", "--head-parallel", "1")) == 0
    chosen = capsys.readouterr().out.split("\nchosen ")[1]
    assert re.match(r"tile \d+x\d+: predicted", chosen) and "it is the best mesh" in chosen
    assert main(cli(4096, "--ranks-per-node", "4", "--head-parallel", "4")) == 0
    assert re.match(r"tile \d+x\d+ with head_parallel=4", capsys.readouterr().out.split("\nchosen ")[1])
    with pytest.raises(SystemExit) as exit_info:
        main(cli(4096, "--head-parallel", "3"))
    assert exit_info.value.code == 2
    assert "head_parallel=3 does not divide the CP group size P=16" in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "scaling.png"
    main(cli(1536, "--plot", str(path)))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"plot written to {path}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Head-parallel x mesh plans, USP and Ulysses: the same model


@pytest.mark.parametrize(("world", "rpn"), [(12, 4), (12, 3), (16, 4), (8, 16)])
def test_one_head_parallel_rank_predicts_the_plain_mesh(world: int, rpn: int) -> None:
    """``u = 1``: no head exchange; the traffic is that of the rank sending the most across nodes on its rings."""
    topology = topo(rpn=rpn, latency=1e-5)
    s = shape(kv_heads=2)
    for a, b in factorizations(world):
        tiling = Tiling(world=world, a=a, b=b)
        links = group_links(1, tiling, topology)
        ratio = topology.bandwidth(links["q"]) / topology.bandwidth(links["kv"])
        assert links["heads"] == "intra" and link_cost(1, tiling, topology) in ((1.0, ratio), (1 / ratio, 1.0))
        for schedule in ("overlap", "collective"):
            plan = plan_for_topology(1, tiling, s, topology, schedule=schedule)
            result = simulate(plan, topology)
            sends = [[rank_traffic(plan, topology, phase, r) for phase in PHASES] for r in range(world)]
            busiest = max(range(world), key=lambda r: (sum(t["q"].inter + t["kv"].inter for t in sends[r]), -r))
            for phase, sent in zip(PHASES, sends[busiest], strict=True):
                got = getattr(result, phase)
                assert got.a2a == Traffic() and got.a2a_time == 0 and got.traffic == got.mesh == sent["q"] + sent["kv"]
            assert (result.name, result.head_parallel, result.tiling) == (f"{tiling} {schedule}", 1, tiling)


@pytest.mark.parametrize("schedule", ["overlap", "collective"])
def test_the_mesh_of_a_head_parallel_plan_is_a_plain_mesh_on_its_shape(schedule: str) -> None:
    """P = 16, 4 ranks per node, u = 2: head groups inside nodes, and each mesh group (every other rank) sees 8 mesh
    ranks two per node; its mesh is predicted as the plain mesh of its shape on that cluster, the head exchange
    added before it."""
    cluster, mesh_view = topo(rpn=4, latency=1e-5), topo(rpn=2, latency=1e-5)
    s = shape(kv_heads=2)
    for a, b in factorizations(8):
        tiling = Tiling(world=8, a=a, b=b)
        plan = plan_for_topology(2, tiling, s, cluster, schedule=schedule)
        plain_plan = plan_for_topology(1, tiling, plan.mesh_shape, mesh_view, schedule=schedule)
        assert plan.link_cost == plain_plan.link_cost
        result, plain = simulate(plan, cluster), simulate(plain_plan, mesh_view)
        for phase in PHASES:
            got, want = getattr(result, phase), getattr(plain, phase)
            assert got.a2a.inter == 0 and got.a2a.total == plan.bytes_sent(phase, group="heads") > 0
            assert (got.mesh, got.compute) == (want.traffic, want.compute)
            assert got.time == pytest.approx(got.a2a_time + want.time)
            held = ("q,k,v", "out") if phase == "forward" else ("dout",)  # sim/memory.py: peak_bytes
            copies = sum(t.piece_bytes * 2 for t in plan.all_to_alls(phase) if t.what in held)
            assert got.memory == want.memory + copies


def ulysses_by_hand(world: int, s: AttentionShape, topology: Topology) -> dict[str, tuple[Traffic, float, float]]:
    """DeepSpeed-Ulysses by hand, per phase ``(traffic, time, compute)``: q, k, v in (one all-to-all, Note [One
    exchange per direction]) and o out (dO in, dq, dk, dv out), direct all-to-alls over the P ranks, from the last rank (on the smallest node: the most peers across
    nodes); then each rank computes the full causal sequence of ``heads / P`` heads. A K or V sends one
    ``1 / min(P, kv_heads)`` piece to each peer (K/V heads repeated when ``P > kv_heads``)."""
    q_bytes = s.chunk_elems * s.itemsize
    kv_piece = q_bytes * s.kv_heads // s.heads / min(world, s.kv_heads)
    pieces = (q_bytes / world + 2 * kv_piece, q_bytes / world)
    seq = s.seq_local * world
    compute = seq * (seq + 1) // 2 * s.batch * (s.heads // world) / topology.pairs_per_second
    timed = [all_to_all_seconds(piece, range(world), topology, world - 1) for piece in pieces]
    comm, traffic = sum(t for t, _ in timed), sum((sent for _, sent in timed), Traffic())
    return {
        phase: (traffic, comm + compute * factor, compute * factor)
        for phase, factor in (("forward", 1.0), ("backward", topology.backward_factor))
    }


@pytest.mark.parametrize("rpn", [8, 2, 3])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_all_head_parallel_ranks_predict_ulysses(rpn: int, kv_heads: int) -> None:
    topology = topo(rpn=rpn, latency=1e-5)
    s = shape(kv_heads=kv_heads)
    result, by_hand = ulysses(8, s, topology), ulysses_by_hand(8, s, topology)
    for phase in PHASES:
        ours, (traffic, time, compute) = getattr(result, phase), by_hand[phase]
        assert (ours.traffic, ours.time, ours.compute) == (traffic, pytest.approx(time), compute)
        assert ours.mesh == Traffic() and ours.a2a == ours.traffic


def test_all_to_all_counts_the_peers_of_the_group_only() -> None:
    topology = topo(rpn=4, latency=1.0)
    time, sent = all_to_all_seconds(10.0, range(4, 12), topology, 5)  # 3 peers in node 1, 4 in node 2
    assert sent == Traffic(intra=30, inter=40)
    assert time == pytest.approx(max(3 + 30 / 1e6, 4 + 40 / 1e6))
    assert all_to_all_seconds(10.0, (5,), topology, 5) == (0.0, Traffic())


def test_hybrid_groups_sit_on_the_nodes_their_ranks_do() -> None:
    """P = 16, 4 ranks per node. u = 4: head groups fill a node and the mesh ranks are a node each (every ring hop
    crosses); u = 2: two mesh ranks per node, so a 2 x 4 tile's Q ring stays inside; u = 8: head groups span two
    nodes, so 4 of 7 all-to-all peers are across."""
    topology, s = topo(rpn=4), shape(itemsize=4)
    cases = {(4, (2, 2)): ("intra", "inter", "inter"), (2, (2, 4)): ("intra", "intra", "inter")}
    cases[(8, (2, 1))] = ("inter", "inter", "intra")  # a KV ring of one rank moves nothing
    for (u, ab), links in cases.items():
        tiling = Tiling(16 // u, *ab)
        assert tuple(group_links(u, tiling, topology)[k] for k in ("heads", "q", "kv")) == links
        plan = plan_for_topology(u, tiling, s, topology)
        result = simulate(plan, topology)
        for phase in PHASES:
            got = getattr(result, phase)
            assert got.a2a.total == plan.bytes_sent(phase, group="heads")
            assert got.mesh.total == plan.bytes_sent(phase, group="q") + plan.bytes_sent(phase, group="kv")
            assert got.traffic == got.a2a + got.mesh
        assert (result.a2a.inter > 0) == (links[0] == "inter")
    spread = simulate(plan_for_topology(8, Tiling(2, 2, 1), s, topology), topology).forward.a2a
    assert spread.inter * 3 == spread.intra * 4
    assert "head groups inside a node, Q ring across nodes, KV ring across nodes" in describe_links(
        4, Tiling(4, 2, 2), topology
    )


def test_mesh_groups_placed_differently_take_the_slowest() -> None:
    """P = 12, u = 3, 4 ranks per node: head group {3, 4, 5} spans two nodes, and mesh group 0 (ranks 0, 3, 6, 9)
    is placed unlike mesh group 1 (1, 4, 7, 10); the slowest of each counts."""
    topology = topo(rpn=4, latency=1e-5)
    views = {mesh_group_topology(topology, 3, 12, i).nodes for i in range(3)}
    assert views == {(0, 0, 1, 2), (0, 1, 1, 2), (0, 1, 2, 2)}
    s = shape(heads=6, kv_heads=6)
    result = simulate(plan_for_topology(3, Tiling(4, 2, 2), s, topology), topology)
    assert group_links(3, Tiling(4, 2, 2), topology)["heads"] == "inter"
    assert result.forward.a2a.inter > 0 and result.forward.time >= result.forward.a2a_time + result.forward.compute


def test_choose_with_one_head_parallel_rank_chooses_among_the_plain_meshes() -> None:
    topology = topo()
    for heads, kv_heads in ((8, 8), (8, 2), (32, 1)):
        s = shape(heads=heads, kv_heads=kv_heads)
        plain = simulate_candidates(16, s, topology, head_parallel=1)
        everything = simulate_candidates(16, s, topology)
        assert plain == {key: result for key, result in everything.items() if key[0] == 1}
        u, tiling, reason = choose(16, s, topology, head_parallel=1)
        assert u == 1 and plain[(1, tiling)].time == min(r.time for r in plain.values())
        assert reason.startswith(f"tile {tiling}: predicted")
        assert "it is the best mesh" in reason and "the best USP" not in reason
    with pytest.raises(ValueError, match="head_parallel=3 does not divide the CP group size P=16"):
        choose(16, shape(), topology, head_parallel=3)


def test_choose_searches_every_split_within_the_memory_budget() -> None:
    topology, s = topo(rpn=4, latency=1e-5), shape(heads=8, kv_heads=8)
    results = simulate_candidates(16, s, topology)
    assert {u for u, _ in results} == {1, 2, 4, 8}
    assert len(results) == sum(len(factorizations(16 // u)) for u in (1, 2, 4, 8))
    u, tiling, reason = choose(16, s, topology)
    best = min(results.values(), key=lambda r: r.time)
    assert results[(u, tiling)].time == best.time
    budget = sorted(r.memory for r in results.values())[len(results) // 2]
    fits = [r for r in results.values() if r.memory <= budget]
    u2, tiling2, reason2 = choose(16, s, topology, memory_budget=budget)
    assert results[(u2, tiling2)].memory <= budget and results[(u2, tiling2)].time == min(r.time for r in fits)
    assert f"{len(results) - len(fits)} candidate(s) over the memory budget" in reason2
    with pytest.raises(ValueError, match="below the peak of every tile of 16 ranks"):
        choose(16, s, topology, memory_budget=min(r.memory for r in results.values()) - 1)


def test_cli_prints_the_best_hybrid_and_usp_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(4096, "--ranks-per-node", "4")) == 0
    out = capsys.readouterr().out
    tagged = {line.split()[-2] + " " + line.split()[-1]: line for line in out.splitlines() if "  best " in line}
    assert set(tagged) == {"best hybrid", "best USP"}
    assert re.fullmatch(r"\d+x\(1x\d+\)", tagged["best USP"].split()[0])  # u x (1 x m): a ring of m
    assert re.fullmatch(r"\d+x\(([2-9]|\d\d+)x\d+\)", tagged["best hybrid"].split()[0])  # a > 1: a mesh
    assert "Ux(AxB): all-to-alls over heads" in out and "\n    the best USP tile 1x" in out
