"""The decode cost model: tree reduction against passing or gathering the K/V cache (pure Python)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from mesh_cp.core.decode import DecodeReduction, DecodeShape
from mesh_cp.sim import (
    DECODE_METHODS,
    Topology,
    decode_table,
    default_decode_tile,
    format_decode_table,
    simulate_decode,
    tree_level_links,
)


def shape_at(context: int, **kw) -> DecodeShape:
    base = dict(batch=1, new_tokens=1, heads=32, kv_heads=8, head_dim=128, context=context, itemsize=2)
    return DecodeShape(**{**base, **kw})


def topo(rpn: int = 4, latency: float = 1e-6) -> Topology:
    return Topology(
        ranks_per_node=rpn,
        intra_bandwidth=4e11,
        inter_bandwidth=5e10,
        intra_latency=latency,
        inter_latency=2 * latency,
        pairs_per_second=1e12,
    )


def test_tree_bytes_per_level_match_the_reduction_and_ignore_context():
    shape = shape_at(4096, batch=2, new_tokens=3)
    costs = simulate_decode(shape, 16, topo(), tile=(4, 4))
    expected = DecodeReduction.for_tile(4, 4).bytes_by_level(shape)
    assert tuple(lv.bytes_sent for lv in costs["tree"].levels) == expected
    assert costs["tree"].bytes_total == DecodeReduction.for_tile(4, 4).bytes_sent(shape)
    flat = costs["tree flat"]
    assert tuple(lv.bytes_sent for lv in flat.levels) == DecodeReduction.for_tile(1, 16).bytes_by_level(shape)
    long = simulate_decode(shape_at(65536, batch=2, new_tokens=3), 16, topo(), tile=(4, 4))
    for method in ("tree", "tree flat"):
        assert long[method].bytes_intra == costs[method].bytes_intra
        assert long[method].bytes_inter == costs[method].bytes_inter
        assert long[method].comm_s == pytest.approx(costs[method].comm_s)


def test_ring_and_gather_bytes_grow_linearly_with_context():
    world = 8
    for method in ("ring", "gather"):
        sent = [simulate_decode(shape_at(c), world, topo())[method].bytes_total for c in (4096, 8192, 65536)]
        assert sent[1] == 2 * sent[0] and sent[2] == 16 * sent[0]
        assert sent[0] == (world - 1) * shape_at(4096).shard_bytes(world)


def test_node_local_tile_sends_q_level_inside_and_kv_level_across_nodes():
    shape = shape_at(8192)
    topology = topo(rpn=4)
    assert default_decode_tile(16, topology) == (4, 4)
    assert tree_level_links((4, 4), topology) == ("intra", "inter")
    costs = simulate_decode(shape, 16, topology)
    tree, flat = costs["tree"], costs["tree flat"]
    q_bytes, kv_bytes = DecodeReduction.for_tile(4, 4).bytes_by_level(shape)
    assert tree.tile == (4, 4)
    assert (tree.bytes_intra, tree.bytes_inter) == (q_bytes, kv_bytes)
    assert [(lv.members, lv.link) for lv in tree.levels] == [(4, "intra"), (4, "inter")]
    assert flat.tile == (1, 16) and flat.bytes_intra == 0
    assert flat.bytes_inter == DecodeReduction.for_tile(1, 16).bytes_sent(shape) > 0
    # One all-gather per level, n - 1 messages of one piece each.
    assert tree.messages == 3 + 3 and flat.messages == 15
    assert (q_bytes, kv_bytes) == (3 * shape.piece_bytes, 3 * shape.piece_bytes)


def test_the_reduction_is_one_all_gather_of_the_packed_pieces_per_level():
    shape = shape_at(4096, batch=2, new_tokens=3, heads=8, kv_heads=2, head_dim=64)
    assert shape.piece_bytes == 2 * 3 * 8 * (64 + 1) * 4  # [out, lse] of every row and head, fp32
    assert DecodeReduction.for_tile(1, 8).collectives(shape) == (("all_gather", 8, shape.piece_bytes),)
    assert DecodeReduction.for_tile(4, 2).collectives(shape) == (
        ("all_gather", 4, shape.piece_bytes),
        ("all_gather", 2, shape.piece_bytes),
    )
    assert DecodeReduction.for_tile(4, 2).bytes_by_level(shape) == (3 * shape.piece_bytes, shape.piece_bytes)
    assert DecodeReduction.for_tile(1, 1).collectives(shape) == ()


def test_tree_time_is_compute_then_the_all_gathers():
    shape, topology = shape_at(10000), topo(rpn=4)
    tree = simulate_decode(shape, 16, topology)["tree"]
    compute = shape.batch * shape.heads * shape.new_tokens * 625 / topology.pairs_per_second
    comm = sum(
        topology.transfer_time(link, (n - 1) * shape.piece_bytes, messages=n - 1)
        for n, link in ((4, "intra"), (4, "inter"))
    )
    assert tree.compute_s == pytest.approx(compute)
    assert tree.comm_s == pytest.approx(comm)
    assert tree.time_s == pytest.approx(compute + comm)


def test_ring_overlaps_compute_with_transfers_and_gather_does_not():
    shape, topology, world = shape_at(32768), topo(rpn=4), 8
    costs = simulate_decode(shape, world, topology)
    shard = shape.shard_bytes(world)
    step_comm = topology.transfer_time("inter", shard)
    step_compute = shape.heads * (32768 // world) / topology.pairs_per_second
    ring = costs["ring"]
    assert ring.time_s == pytest.approx(step_compute + (world - 1) * max(step_compute, step_comm))
    assert ring.compute_s == pytest.approx(world * step_compute)
    assert (ring.bytes_intra, ring.bytes_inter, ring.messages) == (0, (world - 1) * shard, world - 1)
    assert ring.kv_bytes_per_rank == 3 * shard
    gather = costs["gather"]
    assert gather.comm_s == pytest.approx((world - 1) * step_comm)
    assert gather.time_s == pytest.approx(gather.comm_s + world * step_compute)
    # A ring inside one node sends only over NVLink.
    inside = simulate_decode(shape, world, topo(rpn=8))
    assert inside["ring"].bytes_inter == 0 and inside["ring"].bytes_intra == (world - 1) * shard
    assert inside["tree"].bytes_inter == 0 and inside["tree"].tile == (8, 1)


def test_one_rank_communicates_nothing():
    shape = shape_at(4096)
    costs = simulate_decode(shape, 1, topo())
    assert tuple(costs) == DECODE_METHODS
    for cost in costs.values():
        assert (cost.bytes_total, cost.messages, cost.comm_s) == (0, 0, 0.0)
        assert cost.time_s == pytest.approx(cost.compute_s) and cost.compute_s > 0
        assert cost.kv_bytes_per_rank == shape.shard_bytes(1)


def test_h100_two_nodes_tree_beats_ring_at_long_context():
    topology = Topology.h100_infiniband(head_dim=128)
    assert topology.ranks_per_node == 8
    for context in (32768, 65536, 131072, 1 << 20):
        costs = simulate_decode(shape_at(context), 16, topology)
        assert costs["tree"].tile == (8, 2)
        assert costs["tree"].time_s < costs["ring"].time_s
        assert costs["tree"].time_s < costs["gather"].time_s
        assert costs["gather"].kv_bytes_per_rank == 16 * costs["tree"].kv_bytes_per_rank
        # The node-local tree crosses nodes less than the flat one.
        assert costs["tree"].bytes_inter < costs["tree flat"].bytes_inter


@pytest.mark.parametrize("tile", [(3, 5), (4, 2), (0, 16), (16,), (4.0, 4.0), "4x4"])
def test_bad_tile_names_it_and_the_factorizations(tile):
    with pytest.raises(ValueError, match="tile") as info:
        simulate_decode(shape_at(4096), 16, topo(), tile=tile)
    assert repr(tile) in str(info.value) and "world=16" in str(info.value) and "(4, 4)" in str(info.value)


@pytest.mark.parametrize("world", [0, -2, 2.0, True])
def test_bad_world_is_named(world):
    with pytest.raises(ValueError, match=f"world must be a positive int.*{world!r}"):
        simulate_decode(shape_at(4096), world, topo())


def test_bad_shape_or_topology_is_named():
    with pytest.raises(TypeError, match="DecodeShape"):
        simulate_decode(dataclasses.asdict(shape_at(4096)), 4, topo())
    with pytest.raises(TypeError, match="Topology"):
        simulate_decode(shape_at(4096), 4, "h100")


def test_decode_table_rows_and_text():
    topology = Topology.h100_infiniband()
    rows = decode_table(shape_at(0), 16, topology, [4096, 65536])
    assert [row.context for row in rows] == [4096, 65536]
    assert rows[1].costs["ring"].bytes_total == 16 * rows[0].costs["ring"].bytes_total
    assert rows[1].fastest() == "tree"
    text = format_decode_table(rows)
    lines = text.splitlines()
    assert len(lines) == 3 and "tree us" in lines[0] and lines[2].split()[0] == "65536"
    assert lines[2].split()[-1] == "tree"
    with pytest.raises(ValueError, match="unknown decode methods"):
        format_decode_table(rows, methods=("tree", "allgather"))


def test_sim_decode_does_not_import_torch():
    code = "import sys, mesh_cp.sim.decode; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_decode_prints_the_table_and_names_a_bad_tile(capsys: pytest.CaptureFixture[str]) -> None:
    from mesh_cp.cli import main

    assert main(["decode", "--world", "16", "--heads", "32", "--kv-heads", "8", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("decoding 1 token(s) x batch 1, 32:8 heads x 128 bf16, cache sharded over 16 ranks")
    rows = [line.split() for line in out[2:]]
    assert [row[0] for row in rows] == ["4096", "32768", "262144", "1048576"]
    assert all(row[-1] == "tree" for row in rows)
    assert len({row[5] for row in rows}) == 1  # the tree's KiB (intra+inter) do not change with the context
    with pytest.raises(SystemExit):
        main(["decode", "--world", "16", "--heads", "32", "--head-dim", "128", "--tile", "3x5"])
    assert "tile 3x5 does not factor the CP group size 16" in capsys.readouterr().err
