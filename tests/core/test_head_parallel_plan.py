"""The head-parallel x mesh plan as data: groups, all-to-all bytes, refusals, and the claim it is for, checked
through the cost model at 256 ranks."""

from __future__ import annotations

import dataclasses

import pytest

from mesh_cp.core import (
    AttentionShape,
    Tiling,
    factorizations,
    head_group_ranks,
    head_parallel_unavailable,
    make_plan,
    mesh_group_ranks,
    valid_head_parallel,
)
from mesh_cp.sim import Topology, best_of_kind, choose, link_cost, simulate_candidates

PHASES = ("forward", "backward")


def shape(*, seq_local: int = 8, heads: int = 8, kv_heads: int = 8, itemsize: int = 2) -> AttentionShape:
    """Per-rank sizes of the inputs: ``seq_local = S / P`` tokens, all heads."""
    return AttentionShape(batch=2, seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=16, itemsize=itemsize)


def plan_of(u: int, tiling: Tiling, s: AttentionShape, **options):
    return make_plan(tiling, s, causal=True, layout="zigzag", head_parallel=u, **options)


# ----------------------------------------------------------------------------------------------
# Groups


@pytest.mark.parametrize(("world", "u"), [(8, 2), (12, 3), (16, 16), (6, 1)])
def test_head_groups_and_mesh_groups_cross_once(world: int, u: int) -> None:
    heads = {head_group_ranks(world, u, r) for r in range(world)}
    meshes = {mesh_group_ranks(world, u, r) for r in range(world)}
    for groups, size in ((heads, u), (meshes, world // u)):
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert all(len(g) == size for g in groups)
    for r in range(world):
        g, i = divmod(r, u)
        head, mesh = head_group_ranks(world, u, r), mesh_group_ranks(world, u, r)
        assert head == tuple(range(g * u, g * u + u))  # consecutive ranks: inside a node when u | ranks per node
        assert head.index(r) == i and mesh.index(r) == g  # rank i of head group g, mesh rank g of mesh group i
        assert set(head) & set(mesh) == {r}
    assert head_group_ranks(8, 2, 5) == (4, 5) and mesh_group_ranks(8, 2, 5) == (1, 3, 5, 7)


def test_group_helpers_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="head_parallel=3 does not divide the CP group size P=8"):
        head_group_ranks(8, 3, 0)
    with pytest.raises(ValueError, match="rank 8 is outside the CP group of size 8"):
        mesh_group_ranks(8, 2, 8)
    with pytest.raises(ValueError, match="head_parallel .* must be a positive int, got 0"):
        mesh_group_ranks(8, 0, 0)


# ----------------------------------------------------------------------------------------------
# Bytes


@pytest.mark.parametrize(
    ("heads", "kv_heads", "u", "forward_c"),
    [
        (8, 8, 4, 3.0),  # MHA: 3/4 of q, k, v and out
        (8, 4, 2, 1.5),  # GQA, u < kv_heads: K/V split, half a C each
        (8, 2, 4, 2.25),  # GQA, u > kv_heads: K/V repeated to one head per rank
        (8, 1, 8, 3.5),  # MQA: one query head and its (repeated) K/V head per rank
    ],
)
def test_all_to_all_bytes_are_one_piece_per_peer(heads: int, kv_heads: int, u: int, forward_c: float) -> None:
    s = shape(heads=heads, kv_heads=kv_heads)
    c = s.chunk_elems * s.itemsize
    plan = plan_of(u, Tiling(world=2, a=1, b=2), s)
    with_lse = dataclasses.replace(plan, return_lse=True)
    # By hand: a rank sends each of its u - 1 peers, for its own S/P tokens, the heads that peer gets.
    per_token_head = s.batch * s.seq_local * s.head_dim * s.itemsize
    q_piece = (heads // u) * per_token_head
    kv_piece = max(kv_heads // u, 1) * per_token_head  # one K/V head per peer when repeated
    lse_piece = s.batch * (heads // u) * s.seq_local * 4  # fp32
    by_hand = (u - 1) * (2 * q_piece + 2 * kv_piece)  # forward q, k, v, out; backward dO, dq, dk, dv
    assert plan.bytes_sent("forward", group="heads") == by_hand == forward_c * c
    assert plan.bytes_sent("backward", group="heads") == by_hand
    lse_bytes = [with_lse.bytes_sent(phase, group="heads") for phase in PHASES]
    assert lse_bytes == [by_hand + (u - 1) * lse_piece] * 2
    # The lse returned but read by no loss: its gradient is not sent (B H L 4 (u - 1) / u bytes less per rank).
    assert with_lse.bytes_sent("backward", group="heads", lse_grad=False) == by_hand
    assert with_lse.stats_bytes_sent("backward") - with_lse.stats_bytes_sent("backward", lse_grad=False) == (
        (u - 1) * lse_piece
    )
    assert [t.what for t in with_lse.all_to_alls("backward", lse_grad=False)] == ["dout", "dq,dk,dv"]
    assert [t.what for t in with_lse.all_to_alls("forward")] == ["q,k,v", "out", "lse"]  # one exchange for q, k, v
    assert [t.what for t in plan.all_to_alls("backward")] == ["dout", "dq,dk,dv"]
    inner = plan.mesh_shape
    assert (inner.seq_local, inner.heads, inner.kv_heads) == (u * s.seq_local, heads // u, max(kv_heads // u, 1))
    assert inner.chunk_elems == s.chunk_elems  # S/m tokens x H/u heads: the same C
    for phase in PHASES:
        groups = [plan.bytes_sent(phase, group=g) for g in ("heads", "q", "kv")]
        assert plan.bytes_sent(phase) == sum(groups)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("u", [1, 2, 4, 8])
def test_bytes_follow_the_traffic_formula(heads: int, kv_heads: int, u: int) -> None:
    """In fp32 every transfer is at the input's element size, so bytes = formula x C + statistics."""
    s = shape(heads=heads, kv_heads=kv_heads, itemsize=4)
    c = s.chunk_elems * s.itemsize
    for a, b in factorizations(4):
        for backward in ("regather", "reuse"):
            plan = plan_of(u, Tiling(world=4, a=a, b=b), s, backward=backward)
            r = plan.mesh_shape.kv_ratio
            assert r == max(kv_heads // u, 1) / (heads // u)  # r' = r while u | kv_heads, u / heads when repeated
            for phase in PHASES:
                regather = phase == "backward" and backward == "regather"
                mesh = 3 * (a - 1) + 4 * r * (b - 1) if regather else 2 * (a - 1) + 2 * r * (b - 1)
                formula = (2 + 2 * r) * (u - 1) / u + mesh
                assert plan.traffic_units(phase) == pytest.approx(formula)
                stats = plan.stats_bytes_sent(phase)
                assert plan.bytes_sent(phase) == pytest.approx(formula * c + stats, abs=1e-6)


def test_one_head_parallel_rank_is_the_plain_plan() -> None:
    s = shape(kv_heads=2)
    for a, b in factorizations(6):
        tiling = Tiling(world=6, a=a, b=b)
        plan = plan_of(1, tiling, s, backward="reuse", return_lse=True)
        assert plan.world == 6 and plan.tiling == tiling and plan.mesh_shape == s
        for phase in PHASES:
            assert plan.all_to_alls(phase) == () and plan.bytes_sent(phase, group="heads") == 0
            assert plan.bytes_sent(phase) == plan.bytes_sent(phase, group="q") + plan.bytes_sent(phase, group="kv")


# ----------------------------------------------------------------------------------------------
# Refusals


REFUSALS = [
    (
        3,
        Tiling(2, 1, 2),
        shape(),
        r"head_parallel=3 does not divide the 8 query heads; choose head_parallel among \[1, 2\]",
    ),
    (6, Tiling(2, 1, 2), shape(heads=12, kv_heads=4), "head_parallel=6 and the 4 K/V heads must divide one another"),
    (
        1,
        Tiling(4, 2, 2),
        shape(seq_local=3),
        r"seq_local 3 must be even for the zigzag layout \(global seq_len must be a multiple of 2\*P = 8\); pad",
    ),
    (0, Tiling(4, 2, 2), shape(), "head_parallel .* must be a positive int, got 0"),
]


@pytest.mark.parametrize(("u", "tiling", "s", "message"), REFUSALS)
def test_refusals_name_the_value_and_the_fix(u: int, tiling, s: AttentionShape, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_of(u, tiling, s)


def test_valid_head_parallel_and_odd_sequences() -> None:
    assert valid_head_parallel(16, shape(heads=8, kv_heads=8)) == (1, 2, 4, 8)
    assert valid_head_parallel(16, shape(heads=16, kv_heads=4)) == (1, 2, 4, 8, 16)  # 8, 16: K/V heads repeated
    assert valid_head_parallel(12, shape(heads=12, kv_heads=4)) == (1, 2, 4, 12)  # 3, 6: neither divides 4
    assert head_parallel_unavailable(12, 3, shape(heads=12, kv_heads=4)) is not None
    odd = shape(seq_local=3)  # 3 tokens per rank: no zig-zag half-chunks, whatever the head-parallel degree
    for u in (1, 2):
        with pytest.raises(ValueError, match="must be even for the zigzag layout"):
            plan_of(u, Tiling(4 // u, 1, 4 // u), odd)
        make_plan(Tiling(4 // u, 1, 4 // u), odd, causal=True, layout="contiguous", head_parallel=u)
    with pytest.raises(ValueError, match="pad the sequence to 16"):
        simulate_candidates(4, odd, H100)


# ----------------------------------------------------------------------------------------------
# The claim, through the cost model: P = 256 ranks, 8 per node, head_dim 128


def cluster_shape(kv_heads: int, seq_local: int) -> AttentionShape:
    return AttentionShape(batch=1, seq_local=seq_local, heads=32, kv_heads=kv_heads, head_dim=128, itemsize=2)


H100 = Topology.preset("h100", head_dim=128, ranks_per_node=8)


@pytest.mark.parametrize("kv_heads", [32, 8])  # MHA and GQA 32:8
def test_at_256_ranks_the_node_wide_hybrid_sends_less_across_nodes_than_usp(kv_heads: int) -> None:
    """1M tokens (4096 per rank). With head groups filling a node (u = 8), the all-to-alls stay on NVLink and
    the mesh of the 32 ranks that hold the same heads replaces USP's ring: fewer bytes across nodes than the best
    USP split (any u), the best plain mesh and the ring. Attention is compute-bound here, so every candidate hides
    its mesh traffic and the time the all-to-alls add (which overlap nothing) is all that separates them: under 1%.
    """
    s = cluster_shape(kv_heads, 4096)
    results = simulate_candidates(256, s, H100)
    node_wide = min((k for k in results if k[0] == 8), key=lambda k: (results[k].time, results[k].traffic.inter))
    hybrid, usp = results[node_wide], results[best_of_kind(results, "usp")]
    mesh, ring = results[best_of_kind(results, "mesh")], results[(1, Tiling(256, 1, 256))]
    assert node_wide[1].a > 1  # a mesh, not USP's ring
    assert hybrid.a2a.inter == 0 and hybrid.mesh.intra == 0  # all-to-alls inside a node, the mesh across nodes
    assert hybrid.traffic.inter < 0.6 * min(usp.traffic.inter, mesh.traffic.inter)
    assert usp.traffic.inter < ring.traffic.inter
    assert hybrid.time < min(usp.time, mesh.time) * 1.01
    # Per head-parallel degree inside a node: the fastest tile of u never sends more across nodes, nor is slower,
    # than u's USP split (a mesh never moves more than a ring of the same size).
    for u in (2, 4, 8):
        fastest = min((k for k in results if k[0] == u), key=lambda k: (results[k].time, results[k].traffic.inter))
        ring_of_u = results[(u, Tiling(256 // u, 1, 256 // u))]
        assert results[fastest].traffic.inter <= ring_of_u.traffic.inter and results[fastest].time <= ring_of_u.time


@pytest.mark.parametrize("kv_heads", [32, 8])
def test_at_256_ranks_the_choice_is_never_slower_than_the_best_plain_mesh(kv_heads: int) -> None:
    for seq_local in (512, 1024, 2048, 4096, 8192):
        s = cluster_shape(kv_heads, seq_local)
        results = simulate_candidates(256, s, H100)
        u, tiling, reason = choose(256, s, H100)
        _, tile, _ = choose(256, s, H100, head_parallel=1)
        assert results[(u, tiling)].time <= results[(1, tile)].time
        assert reason.startswith(f"tile {tiling}" + ("" if u == 1 else f" with head_parallel={u}"))


@pytest.mark.parametrize(("kv_heads", "seq_local"), [(32, 2048), (8, 512)])
def test_at_256_ranks_the_hybrid_wins_where_communication_shows(kv_heads: int, seq_local: int) -> None:
    """Where the mesh cannot hide its traffic (MHA at 2048 tokens per rank, GQA at 512), the choice is a hybrid
    that is faster than the best plain mesh and the best USP split, with fewer bytes across nodes than either."""
    s = cluster_shape(kv_heads, seq_local)
    results = simulate_candidates(256, s, H100)
    u, tiling, reason = choose(256, s, H100)
    chosen, usp, mesh = (results[k] for k in ((u, tiling), best_of_kind(results, "usp"), best_of_kind(results, "mesh")))
    assert (u, tiling.a) == (8, {32: 4, 8: 2}[kv_heads])  # head groups fill a node; a mesh over the rest
    assert chosen.time < min(usp.time, mesh.time)
    assert chosen.traffic.inter < min(usp.traffic.inter, mesh.traffic.inter)
    assert "it is the best hybrid" in reason and "the best USP" in reason and "Ulysses unavailable" in reason


def test_auto_mesh_builds_the_chosen_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """What :func:`mesh_cp.auto_mesh` asks the runtime for (the mesh construction itself is stubbed out)."""
    auto = pytest.importorskip("mesh_cp.auto")
    monkeypatch.setattr(auto.dist, "get_world_size", lambda group: 256)
    monkeypatch.setattr(auto.dist, "get_rank", lambda group: 1)
    monkeypatch.setattr(auto.CPMesh, "from_tiling", classmethod(lambda cls, group, tiling, **kw: (group, tiling, kw)))
    group, s = object(), cluster_shape(32, 2048)
    for head_parallel in (None, 1):  # None: every split; 1: plain meshes only
        u, tiling, reason = choose(256, s, H100, head_parallel=head_parallel)
        options = {"head_parallel": u, "link_cost": link_cost(u, tiling, H100), "reason": reason}
        built = auto.auto_mesh(group, topology="h100", shape=s, head_parallel=head_parallel)
        assert built == (group, tiling, options | {"timeout": None, "debug": False})
    assert built[1] == choose(256, s, H100, head_parallel=1).tiling
    fixed = auto.auto_mesh(group, topology=H100, tile="2x8", head_parallel=16)
    assert fixed[1] == Tiling(16, 2, 8) and fixed[2]["head_parallel"] == 16 and fixed[2]["reason"] == ""
    with pytest.raises(ValueError, match="head_parallel=3 does not divide the CP group size P=256"):
        auto.auto_mesh(group, topology=H100, tile="2x8", head_parallel=3)
    with pytest.raises(ValueError, match="auto_mesh: 'heads' was renamed 'head_parallel'"):
        auto.auto_mesh(group, topology=H100, tile="2x8", heads=16)
