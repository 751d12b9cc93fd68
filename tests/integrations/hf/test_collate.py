"""``hf.shard_collated`` / ``hf.ShardCollated`` on the batches real collators build, on 2 gloo ranks (tile 1x2).

Packed forms: TRL's padding-free ``DataCollatorForLanguageModeling`` (with ``pad_to_multiple_of``, so a tail of
padding numbered 0, 0, ...) and transformers' ``DataCollatorWithFlattening`` (with ``cu_seq_lens_*``, ``max_length_*``
and ``seq_idx``) give exactly the shard of ``shard_batch(documents=...)`` on the same documents, which test_hf.py
compares with the single-process model; padded batches (right and left padding, TRL's ``return_position_ids``) give
the shard of ``shard_batch(attention_mask=...)``. Every key outside ``hf.BATCH_KEYS`` and every packing key that
disagrees with ``position_ids`` is refused, by name, showing where the values differ.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from mesh_cp.testing import expect_error, spawn_gloo  # noqa: E402

PAD = 0
DOCS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]


def _same(a: dict, b: dict) -> bool | str:
    if sorted(a) != sorted(b):
        return f"keys {sorted(a)} != {sorted(b)}"
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return f"{key}: {x.tolist()} != {y.tolist()}"
        elif x != y:
            return f"{key}: {x} != {y}"
    return True


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import mesh_cp
    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, 2))
    shard = lambda batch: hf.shard_collated(batch, mesh=mesh, pad_token_id=PAD)  # noqa: E731
    examples = [{"input_ids": d} for d in DOCS]
    lengths = [len(d) for d in DOCS]
    flat = torch.tensor([t for d in DOCS for t in d])
    row = torch.cat([flat, torch.full((4 - len(flat) % 4,), PAD)]).unsqueeze(0)  # padded to the mesh's multiple
    labels = row.clone()
    labels[0, len(flat) :] = -100
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100  # no label for a document's first token (the collators' convention)
    packed = hf.ShardingCollator.batch_dict(hf.shard_batch(row, mesh=mesh, labels=labels, documents=[lengths]))
    results: dict = {}
    trl_free = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, pad_to_multiple_of=8)
    results["trl padding-free"] = _same(shard(trl_free(examples)), packed)
    flattening = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    results["DataCollatorWithFlattening"] = _same(shard(flattening(examples)), packed)

    padded_ids = torch.tensor([DOCS[0] + [PAD, PAD], DOCS[2]])
    mask = (torch.arange(7) < torch.tensor([[5], [7]])).long()
    expected = hf.ShardingCollator.batch_dict(
        hf.shard_batch(
            torch.cat([padded_ids, torch.zeros(2, 1, dtype=torch.long)], 1),
            mesh=mesh,
            attention_mask=torch.cat([mask, torch.zeros(2, 1, dtype=torch.long)], 1),
        )
    )
    trl_padded = DataCollatorForLanguageModeling(pad_token_id=PAD, return_position_ids=True)
    results["trl padded with positions"] = _same(shard(trl_padded([examples[0], examples[2]])), expected)
    left = {"input_ids": torch.tensor([[PAD, PAD, *DOCS[0]]]), "labels": torch.tensor([[-100, -100, *DOCS[0]]])}
    left["attention_mask"] = (left["input_ids"] != PAD).long()
    left_expected = hf.shard_batch(
        torch.cat([left["input_ids"], torch.zeros(1, 1, dtype=torch.long)], 1),
        mesh=mesh,
        attention_mask=torch.cat([left["attention_mask"], torch.zeros(1, 1, dtype=torch.long)], 1),
    )
    results["left padding"] = _same(shard(left), hf.ShardingCollator.batch_dict(left_expected))

    good = flattening(examples)
    refusals = {
        "unknown key": ({**good, "token_type_ids": good["input_ids"]}, r"\['token_type_ids'\].*does not shard"),
        "no labels": ({"input_ids": good["input_ids"]}, r"has no labels"),
        "float ids": ({**good, "input_ids": good["input_ids"].float()}, r"input_ids must hold integers"),
        "cu_seq_lens": (
            {**good, "cu_seq_lens_q": torch.tensor([0, 5, 9, 15], dtype=torch.int32)},
            r"cu_seq_lens_q does not describe the documents of position_ids \(first difference at index 2: got "
            r"\[\.\.\.\[0, 5, 9, 15\]\.\.\.\], expected \[\.\.\.\[0, 5, 8, 15\]\.\.\.\]\)",
        ),
        "max_length": ({**good, "max_length_k": 5}, r"max_length_k does not describe"),
        "seq_idx": ({**good, "seq_idx": torch.zeros_like(good["seq_idx"])}, r"seq_idx does not describe .*index 5"),
        "no position_ids": (
            {k: v for k, v in good.items() if k != "position_ids"},
            r"but no position_ids: mesh_cp reads a packed row's documents from position_ids",
        ),
        "positions inside a document": (
            {**good, "position_ids": good["position_ids"].masked_fill(torch.arange(15) == 3, 7)},
            r"position_ids of row 0 are not 0, 1, \.\.\. inside each document \(first difference at index 3",
        ),
        "positions not from 0": (
            {**good, "position_ids": good["position_ids"] + 1},
            r"position_ids of row 0 do not start at 0",
        ),
        "two packed rows": (
            {
                "input_ids": good["input_ids"].repeat(2, 1),
                "labels": good["labels"].repeat(2, 1),
                "position_ids": good["position_ids"].repeat(2, 1),
                "cu_seq_lens_q": good["cu_seq_lens_q"],
            },
            r"describe one packed row; the batch has 2 rows",
        ),
        "positions beside a mask": (
            {**trl_padded([examples[0]]), "position_ids": torch.tensor([[0, 1, 2, 4, 5]])},
            r"position_ids of row 0 do not number its real tokens 0, 1, \.\.\. \(first difference at index 3",
        ),
    }
    for name, (batch, pattern) in refusals.items():
        expect_error(results, name, ValueError, pattern, lambda batch=batch: shard(batch))
    expect_error(
        results,
        "collator already shards",
        ValueError,
        r"already mesh_cp's ShardingCollator",
        lambda: hf.ShardCollated(hf.ShardingCollator(mesh, pad_token_id=PAD), mesh, pad_token_id=PAD),
    )
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_gloo(worker, 2, deadline=240)


@pytest.mark.parametrize(
    "case",
    [
        "trl padding-free",
        "DataCollatorWithFlattening",
        "trl padded with positions",
        "left padding",
        "unknown key",
        "no labels",
        "float ids",
        "cu_seq_lens",
        "max_length",
        "seq_idx",
        "no position_ids",
        "positions inside a document",
        "positions not from 0",
        "two packed rows",
        "positions beside a mask",
        "collator already shards",
    ],
)
def test_collated_batches(results: list[dict], case: str) -> None:
    for rank, result in enumerate(results):
        assert result[case] is True, f"rank {rank}: {case}: {result[case]}"


def test_replica_examples_split_a_global_batch() -> None:
    from mesh_cp.integrations.hf.collate import replica_examples

    batch = [{"input_ids": [i, i]} for i in range(5)]
    parts = [replica_examples(batch, r, 2) for r in range(2)]
    assert parts == [batch[:3], batch[3:]]
    short = [replica_examples(batch[:1], r, 2) for r in range(2)]
    assert short[0] == batch[:1] and short[1] == [{"input_ids": [0, 0], "labels": [-100, -100]}]
    with pytest.raises(ValueError, match=r"leaves DP replica 1 of 2 none"):
        replica_examples([[1, 2]], 1, 2)
