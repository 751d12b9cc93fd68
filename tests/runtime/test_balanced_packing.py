"""``ShardingCollator(packed=True, balance=True | "split")``: the same loss and gradients as the given order, less
work on the busiest rank (Note [Balanced packing], Note [Split documents]).

One process: the collator runs for every rank of a P = 4 mesh (tile 2x2; a stand-in :class:`CPMesh` with no process
group, which the collator does not use), the shards are put back in global order, and a tiny Llama computes the
loss of the whole row with the collator's position ids, shifted labels and label count, each document attending
only inside itself (the mask the collator returns). The balanced row holds the same documents in another order,
its busiest rank computes fewer pairs, and its loss and parameter gradients equal the given order's up to float
rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from mesh_cp.core import Tiling
from mesh_cp.core.balance import rank_pairs
from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import document_ids
from mesh_cp.core.split import split_documents
from mesh_cp.runtime.batch import ShardingCollator, causal_lm_loss
from mesh_cp.runtime.mesh import CPMesh

transformers = pytest.importorskip("transformers")

WORLD, TILE = 4, (2, 2)
LENGTHS = [3, 41, 7, 60, 12, 5, 33, 19, 2, 26]
SEQ = 208  # their tokens, a multiple of 2P = 8: no padding


def stand_in_mesh(rank: int) -> CPMesh:
    """Rank ``rank`` of a 2x2 mesh, without process groups (the collator reads the tiling, rank and size only)."""
    groups = {"group": None, "q_group": None, "kv_group": None, "check_group": None}
    return CPMesh(tiling=Tiling(WORLD, *TILE), rank=rank, global_ranks=tuple(range(WORLD)), **groups)


def collated_row(examples: list[dict], balance: bool | str) -> dict:
    """The collator's batch for every rank, put back in global order: ids, positions, shifted labels, mask."""
    shards = [
        ShardingCollator(stand_in_mesh(r), pad_token_id=0, packed=True, balance=balance)(examples) for r in range(WORLD)
    ]
    seq = WORLD * shards[0]["input_ids"].shape[1]
    row = {key: torch.empty(1, seq, dtype=torch.long) for key in ("input_ids", "position_ids", "shift_labels")}
    for rank, shard in enumerate(shards):
        where = torch.tensor(local_positions(seq, WORLD, rank, "zigzag"))
        for key in row:
            row[key][:, where] = shard[key]
    assert all(s["mesh_cp_mask"] == shards[0]["mesh_cp_mask"] for s in shards)
    assert len({int(s["num_items_in_batch"]) for s in shards}) == 1
    return {**row, "mask": shards[0]["mesh_cp_mask"], "num_items": int(shards[0]["num_items_in_batch"])}


def loss_and_grads(model, row: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seq = row["input_ids"].shape[1]
    ids = document_ids(row["mask"], 1, seq)[0]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    attend = ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0) & causal) | torch.eye(seq, dtype=torch.bool)
    model.zero_grad()
    logits = model(
        input_ids=row["input_ids"], position_ids=row["position_ids"], attention_mask=attend[None, None]
    ).logits
    loss = causal_lm_loss(logits, row["shift_labels"], row["num_items"])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_loss_and_grads(given: dict, other: dict) -> None:
    """A tiny Llama's loss and parameter gradients on ``other`` equal those on ``given`` up to float rounding."""
    from mesh_cp.testing.models import tiny_causal_lms

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"], attn_implementation="sdpa")
    loss, grads = loss_and_grads(model, given)
    loss_o, grads_o = loss_and_grads(model, other)
    torch.testing.assert_close(loss_o, loss, rtol=1e-6, atol=0)
    for g, g_o in zip(grads, grads_o, strict=True):
        torch.testing.assert_close(g_o, g, rtol=1e-5, atol=1e-7)


def test_balanced_collator_keeps_the_loss_and_balances_the_ranks() -> None:
    rng = random.Random(0)
    examples = [{"input_ids": [rng.randint(3, 95) for _ in range(n)]} for n in LENGTHS]
    given, balanced = collated_row(examples, balance=False), collated_row(examples, balance=True)
    spans = [[b - a for a, b in row["mask"].documents[0]] for row in (given, balanced)]
    assert spans[0] == LENGTHS and sorted(spans[1]) == sorted(LENGTHS) and spans[1] != LENGTHS
    seq = given["input_ids"].shape[1]
    busiest = [max(rank_pairs([s], seq_len=seq, world=WORLD, tile=TILE)) for s in spans]
    assert busiest[1] < busiest[0], busiest
    assert given["num_items"] == balanced["num_items"] == sum(LENGTHS) - len(LENGTHS)
    assert_same_loss_and_grads(given, balanced)


def test_split_collator_keeps_the_loss_and_evens_out_the_ranks() -> None:
    """``balance="split"`` (Note [Split documents]): the ranks compute the same pairs (the given order's busiest
    rank computes 1.3 times the mean), and the loss and gradients are the given order's."""
    rng = random.Random(1)
    examples = [{"input_ids": [rng.randint(3, 95) for _ in range(n)]} for n in LENGTHS]
    given, split = collated_row(examples, balance=False), collated_row(examples, balance="split")
    assert split["mask"].parts is not None and split["mask"] == split_documents([LENGTHS], seq_len=SEQ, world=WORLD)[0]
    pairs = [rank_pairs([LENGTHS], seq_len=SEQ, world=WORLD, tile=TILE, split=s) for s in (False, True)]
    assert max(pairs[0]) * WORLD / sum(pairs[0]) > 1.3 and max(pairs[1]) * WORLD / sum(pairs[1]) < 1.02, pairs
    assert given["num_items"] == split["num_items"]
    assert_same_loss_and_grads(given, split)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"balance": True}, r"balance=True lays out the documents of a packed row; pass packed=True"),
        ({"balance": "split"}, r"balance='split' lays out the documents of a packed row; pass packed=True"),
        ({"balance": "sorted", "packed": True}, r"balance must be one of False, True, 'order', 'split', got 'sorted'"),
        (
            {"balance": "split", "packed": True, "layout": "contiguous"},
            r"balance='split' cuts documents over the zig-zag layout, got layout='contiguous'",
        ),
    ],
)
def test_balance_is_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingCollator(stand_in_mesh(0), pad_token_id=0, **options)
