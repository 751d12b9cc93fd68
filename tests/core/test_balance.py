"""Balanced packing (:mod:`mesh_cp.core.balance`, Note [Balanced packing]).

- The three packed mixes of ``scripts/bench_rank.py`` at ``P = 16``, 8192 tokens per rank, its 4x4 tile: the busiest
  rank's pairs over the mean before and after; ``mixed`` and ``short`` end within 10%, ``long`` (7 documents) at the
  best of its 5040 orders, 1.189.
- The cost model counts what the plan counts: :class:`PackCost` and :func:`rank_pairs` against
  :meth:`AttentionPlan.pairs` on random rows (every layout and tile at P = 2 to 6, windows, padding, several rows).
- ``scripts/bench_rank.py --balance`` adds the balanced rows and their table.
- The answer is a permutation whose rows fit, never worse than the given order, the same on every call; several
  rows are balanced together; bad input is refused with the value and the fix.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from mesh_cp.core import AttentionMask, AttentionShape, Tiling, make_plan
from mesh_cp.core.balance import _evaluate, _items, _mean, balance_documents, rank_pairs
from mesh_cp.core.balance_cost import PackCost
from mesh_cp.core.tiling import factorizations

ROOT = Path(__file__).resolve().parents[2]
WORLD, PER_RANK = 16, 8192
SEQ = WORLD * PER_RANK
# The busiest rank's pairs over the mean, before and after balancing (4x4, zig-zag).
EXPECTED = {"long": (1.538, 1.189), "mixed": (1.696, 1.10), "short": (1.343, 1.10)}


def imbalance(pairs: list[int]) -> float:
    return max(pairs) / (sum(pairs) / len(pairs))


def spans(mask) -> list[int]:
    return [b - a for a, b in mask.documents[0]]


@pytest.fixture(scope="module")
def bench():
    """``scripts/bench_rank.py`` as a module."""
    spec = importlib.util.spec_from_file_location("bench_rank", ROOT / "scripts" / "bench_rank.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mixes(bench) -> dict[str, list[int]]:
    """The document lengths of the bench's packed rows at ``S = 16 * 8192`` (seed 0, unscaled, as on CUDA)."""
    masks = bench.masks(SEQ, 1, 0)
    return {name: spans(masks[f"packed {name}"]) for name in bench.MIXES}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bench_mixes_balance(mixes, name: str) -> None:
    lengths = mixes[name]
    before, goal = EXPECTED[name]
    (order,) = balance_documents(lengths, seq_len=SEQ, world=WORLD, tile=(4, 4))
    assert sorted(order) == list(range(len(lengths)))
    given = rank_pairs([lengths], seq_len=SEQ, world=WORLD, tile=(4, 4))
    balanced = rank_pairs([[lengths[i] for i in order]], seq_len=SEQ, world=WORLD, tile=(4, 4))
    assert round(imbalance(given), 3) == before
    assert sum(balanced) == sum(given)
    if name == "long":  # 7 documents: every order is tried, and the best leaves 1.189 (Note [Balanced packing])
        assert round(imbalance(balanced), 3) == goal
    else:
        assert imbalance(balanced) <= goal


def test_bench_balance_flag(bench) -> None:
    """``--balance`` adds every packed row in balanced order, and the table of busiest over mean."""
    masks = bench.masks(WORLD * 512, 16, 0, WORLD)
    args = bench.parse_args(["--device", "cpu", "--lengths", "512", "--balance"])
    table = bench.imbalance_table(args)
    for name in bench.MIXES:
        given, balanced = spans(masks[f"packed {name}"]), spans(masks[f"packed {name} balanced"])
        assert sorted(given) == sorted(balanced)
        for mix, lengths in ((f"packed {name}", given), (f"packed {name} balanced", balanced)):
            ratio = imbalance(rank_pairs([lengths], seq_len=WORLD * 512, world=WORLD))
            assert f"| 512 | {mix} | {ratio:.3f} |" in table
    assert set(bench.masks(WORLD * 512, 16, 0)) == {"causal", *(f"packed {name}" for name in bench.MIXES)}


def random_rows(rng: random.Random, seq: int, rows: int) -> list[list[int]]:
    out = []
    for _ in range(rows):
        left, row = seq - rng.randint(0, min(5, seq - 1)), []
        while left > 0:
            row.append(min(left, rng.randint(1, seq)))
            left -= row[-1]
        out.append(row)
    return out


def test_cost_model_counts_what_the_plan_counts() -> None:
    rng = random.Random(0)
    for _ in range(120):
        world = rng.choice([2, 3, 4, 6])
        a, b = rng.choice(factorizations(world))
        layout = rng.choice(["zigzag", "contiguous"])
        seq = (2 * world if layout == "zigzag" else world) * rng.randint(1, 10)
        window = rng.choice([None, None, 1, 3, 17])
        rows = random_rows(rng, seq, rng.randint(1, 3))
        where = {"seq_len": seq, "world": world, "tile": (a, b), "layout": layout, "window": window}
        reference = rank_pairs(rows, **where)
        shape = AttentionShape(batch=1, seq_local=seq // world, heads=1, kv_heads=1, head_dim=8, itemsize=2)
        plans = [
            make_plan(
                Tiling(world, a, b),
                shape,
                causal=True,
                layout=layout,
                mask=AttentionMask.from_lengths([row], window=window),
            )
            for row in rows
        ]
        assert reference == [sum(p.pairs(g) for p in plans) for g in range(world)], (rows, where)
        sizes = [n for row in rows for n in row]
        cost = PackCost(
            seq_len=seq, tiling=Tiling(world, a, b), layout=layout, window=window, rows=len(rows), longest=max(sizes)
        )
        firsts = np.cumsum([0, *map(len, rows)])
        items = np.array(sizes + [0] * (len(rows) - 1))
        order = _items(tuple(tuple(range(firsts[r], firsts[r + 1])) for r in range(len(rows))), len(sizes))
        pairs, _, _ = _evaluate(cost, items, order[None], _mean(cost, items))
        assert pairs[0].tolist() == reference, (rows, where)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window", [None, 300])
def test_a_permutation_never_worse_than_the_given_order(layout: str, window: int | None) -> None:
    rng = random.Random(1)
    lengths = [rng.randint(100, 2600) for _ in range(24)]
    seq, where = 8 * 4096, {"world": 4, "tile": (2, 2), "layout": layout, "window": window}
    (order,) = balance_documents(lengths, seq_len=seq, **where)
    assert sorted(order) == list(range(len(lengths)))
    assert order == balance_documents(lengths, seq_len=seq, **where)[0]  # deterministic
    given = rank_pairs([lengths], seq_len=seq, **where)
    balanced = rank_pairs([[lengths[i] for i in order]], seq_len=seq, **where)
    assert max(balanced) <= max(given)


def test_rows_are_chosen_together() -> None:
    """Two rows of long documents: choosing each document's row as well beats balancing each row alone."""
    rng = random.Random(2)
    rows = [[rng.randint(8192, 32768) for _ in range(3)] for _ in range(2)]
    lengths = [n for row in rows for n in row]
    where = {"seq_len": SEQ, "world": WORLD, "tile": (4, 4)}
    together = balance_documents(lengths, rows=2, **where)
    assert sorted(i for row in together for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= SEQ for row in together)
    alone = [[row[i] for i in balance_documents(row, **where)[0]] for row in rows]
    best_alone = max(rank_pairs(alone, **where))
    assert max(rank_pairs([[lengths[i] for i in row] for row in together], **where)) < best_alone


def test_trivial_inputs_keep_their_order() -> None:
    assert balance_documents([5, 3, 8], seq_len=16, world=1) == ((0, 1, 2),)
    assert balance_documents([7], seq_len=16, world=4) == ((0,),)
    assert balance_documents([], seq_len=16, world=4, rows=2) == ((), ())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [4, 0, 3]}, r"positive ints, got 0 at index 1; drop empty documents"),
        ({"lengths": [4, 2.5]}, r"positive ints, got 2.5 at index 1"),
        ({"lengths": [40]}, r"document 0 has 40 tokens, more than a row of seq_len=32; split it"),
        ({"lengths": [20, 20]}, r"hold 40 tokens, more than 1 row\(s\) of 32; pass rows=2 or more"),
        ({"lengths": [20, 20, 20], "rows": 2}, r"do not fit 2 rows of 32 tokens by first fit, .*pass rows=3"),
        ({"seq_len": 30}, r"seq_len 30 must be a positive multiple of 8 .*pad the sequence to 32"),
        ({"tile": (3, 1)}, r"tile 3x1 does not factor the CP group size 4"),
        ({"world": 0}, r"world must be the number of ranks that compute blocks \(a positive int\), got 0"),
        ({"rows": 0}, r"rows must be a positive int \(the rows of the batch\), got 0"),
        ({"window": 0}, r"window must be a positive number of tokens or None, got 0"),
        ({"layout": "spiral"}, r"spiral"),
    ],
)
def test_bad_input_is_refused_with_the_fix(kwargs: dict, message: str) -> None:
    args = {"lengths": [4, 3], "seq_len": 32, "world": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        balance_documents(args.pop("lengths"), **args)
