"""``ShardingCollator`` over examples that hold several documents (TRL's ``pack_dataset`` rows, with ``seq_lengths``
and/or ``position_ids``), and the allow-list of an example's keys (``mesh_cp.runtime.example_keys``).

On 4 gloo ranks (tile 2x2, a section of ``tests/runtime/test_api.py``'s spawned group): TRL's packed examples,
collated with ``packed=True`` (also ``balance="split"``) and ``packed=False``, give an attached tiny Llama the loss
and parameter gradients of the stock model's per-document forwards, summed (within 1e-5); the same examples with their
boundaries ignored are 1.2e-3 off. Without process groups (the collator run for a stand-in rank of a 2x2 mesh): every
key that describes an example's documents gives the same batch, padding is honoured where exact, and every other key
or disagreement between keys is refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mesh_cp.runtime.batch import ShardingCollator, shard_batch
from mesh_cp.testing import expect_error
from mesh_cp.testing.models import VOCAB, tiny_causal_lms

TOL = 1e-5
LENGTHS = [9, 14, 5, 22, 3, 17, 11, 6, 20]
"""Documents TRL packs into rows of :data:`ROW` tokens."""
ROW = 32


GROUPS = [[3, 0], [8, 6], [5, 1], [7, 2, 4]]
"""The documents of each of TRL's packed examples (``pack_dataset(..., ROW)``, best fit decreasing)."""


def documents() -> tuple[list[list[int]], list[list[int]]]:
    """The documents' ids and labels (a 2-token prompt without loss)."""
    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    return docs, [[-100, -100, *d[2:]] for d in docs]


def packed_examples(*, positions: bool = True) -> list[dict]:
    """TRL's packed examples of :func:`documents` (``pack_dataset`` gives ``input_ids``, ``labels``, ``seq_lengths``;
    trl is not imported, its import takes seconds in every spawned rank: a test checks that these are its rows).
    ``positions``: the second example also has the ``position_ids`` TRL's collator derives from ``seq_lengths``, the
    next ones have those instead of ``seq_lengths``."""
    docs, labels = documents()
    examples = [
        {
            "input_ids": [t for i in group for t in docs[i]],
            "labels": [t for i in group for t in labels[i]],
            "seq_lengths": [LENGTHS[i] for i in group],
        }
        for group in GROUPS
    ]
    for e in examples[1:] if positions else ():
        e["position_ids"] = [p for n in e["seq_lengths"] for p in range(n)]
        if e is not examples[1]:
            del e["seq_lengths"]
    return examples


def _per_document_loss(model, docs: list[list[int]], labels: list[list[int]]) -> tuple[torch.Tensor, int]:
    """The stock model's mean next-token loss over every document, each its own forward: summed, over the count."""
    total, count = torch.zeros(()), 0
    for ids, lab in zip(docs, labels, strict=True):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        target = torch.tensor(lab[1:])
        total = total + torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    return total / count, count


def examples_section(rank: int, world: int) -> dict:
    """The attached model's loss and summed gradients on the collated packed examples, against the stock model's
    per-document forwards."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import mesh_cp
    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    (docs, labels), examples = documents(), packed_examples()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"], attn_implementation="sdpa")
    ref_loss, count = _per_document_loss(ref, docs, labels)
    ref_loss.backward()
    # What the collator gave before it read the examples' boundaries: every example one document.
    joined = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    with torch.no_grad():
        unbounded = _per_document_loss(ref, [e["input_ids"] for e in joined], [e["labels"] for e in joined])[0]
    res: dict = {"items": count, "boundaries matter": abs(unbounded.item() - ref_loss.item()) > 1e-4}
    for name, options in {
        "packed": {"packed": True},
        "rows": {},
        "split": {"packed": True, "balance": "split"},
    }.items():
        model = hf.attach(copy.deepcopy(ref), mesh)
        model.zero_grad()
        ddp = hf.data_parallel(model, mesh=mesh)  # gradients summed over the CP group
        batch = hf.ShardingCollator(mesh, pad_token_id=0, **options)(examples)
        loss = ddp(**batch).loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group)
        grads = [
            (p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        ]
        res[name] = {
            "loss error": abs(total.item() - ref_loss.item()),
            "gradient error": max(grads),
            "items": int(batch["num_items_in_batch"]),
            "documents": sum(len(row) for row in batch["mesh_cp_mask"].documents),
        }
    return res


def check_examples_section(per_rank: list[dict]) -> None:
    """Every rank's result of :func:`examples_section` (read by the test in ``tests/runtime/test_api.py``)."""
    for rank, res in enumerate(per_rank):
        assert res["boundaries matter"] is True, res
        for name in ("packed", "rows", "split"):
            got = res[name]
            assert got["items"] == res["items"], (rank, name, got)
            assert got["documents"] >= len(LENGTHS), (rank, name, got)  # split: a document's parts count apart
            assert got["loss error"] <= TOL and got["gradient error"] <= TOL, (rank, name, got)


def _mesh():
    """Rank 1 of a 2x2 mesh without process groups (imported here: its module skips without transformers)."""
    from tests.runtime.test_balanced_packing import stand_in_mesh

    return stand_in_mesh(1)


def _collate(examples: list, **options) -> dict:
    return ShardingCollator(_mesh(), pad_token_id=0, **options)(examples)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


SPLIT = [4, 7, 5]
IDS = list(range(3, 19))
BOUNDARIES = {
    "seq_lengths": SPLIT,
    "position_ids": [*range(4), *range(7), *range(5)],
    "cu_seq_lens_q": [0, 4, 11, 16],
    "cu_seq_lens_k": [0, 4, 11, 16],
    "seq_idx": [0] * 4 + [1] * 7 + [2] * 5,
}


@pytest.mark.parametrize("keys", [[k] for k in BOUNDARIES] + [list(BOUNDARIES)])
def test_every_boundary_key_gives_the_examples_documents(keys: list[str]) -> None:
    example = {"input_ids": IDS, **{k: BOUNDARIES[k] for k in keys}, "max_length_q": 7}
    documents = [{"input_ids": IDS[a:b]} for a, b in ((0, 4), (4, 11), (11, 16))]
    assert _same(_collate([example], packed=True), _collate(documents, packed=True))
    row = torch.tensor([IDS])
    assert _same(_collate([example]), ShardingCollator.batch_dict(shard_batch(row, mesh=_mesh(), documents=[SPLIT])))
    assert _collate([example])["mesh_cp_mask"].documents == (((0, 4), (4, 11), (11, 16)),)
    one = {"input_ids": IDS, "position_ids": list(range(16)), "cu_seq_lens_q": [0, 16], "attention_mask": [1] * 16}
    assert _same(_collate([one]), _collate([IDS])) and "mesh_cp_mask" not in _collate([one])


def test_the_examples_are_trls_packing() -> None:
    """:func:`packed_examples` are ``pack_dataset``'s rows, with the ``position_ids`` TRL's collator derives."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    docs, labels = documents()
    trl_rows = [dict(e) for e in pack_dataset(Dataset.from_dict({"input_ids": docs, "labels": labels}), ROW)]
    assert trl_rows == packed_examples(positions=False)
    positions = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths
    assert all(
        e["position_ids"] == positions([t["seq_lengths"]])[0].tolist()
        for e, t in zip(packed_examples()[1:], trl_rows[1:], strict=True)
    )


def test_packed_examples_keep_their_documents() -> None:
    rows = [[LENGTHS[i] for i in group] for group in GROUPS]
    packed = _collate(packed_examples(), packed=True)["mesh_cp_mask"].documents[0]
    assert [b - a for a, b in packed] == [n for row in rows for n in row]
    per_row = _collate(packed_examples())["mesh_cp_mask"].documents
    assert [[b - a for a, b in row] for row in per_row] == rows


def test_padding_of_an_example_of_one_document() -> None:
    right = {"input_ids": [*IDS[:5], 0, 0], "attention_mask": [1] * 5 + [0, 0]}
    assert _same(_collate([right, IDS]), _collate([IDS[:5], IDS]))
    left = {"input_ids": [0, 0, *IDS[:5]], "attention_mask": [0, 0] + [1] * 5, "labels": [-100, -100, *IDS[:5]]}
    batch = _collate([left])
    assert batch["mesh_cp_mask"].documents == (((2, 7),),) and int(batch["num_items_in_batch"]) == 4


BAD = {"input_ids": IDS, "seq_lengths": SPLIT}
REFUSALS = {
    "unknown key": (
        {**BAD, "text": "a b"},
        {},
        r"example 0 has \['text'\], which mesh_cp does not take .*select_columns",
    ),
    "no input_ids": ({"labels": IDS}, {}, r"example 0 has no input_ids"),
    "labels length": ({**BAD, "labels": IDS[:3]}, {}, r"example 0's labels has 3 values, its input_ids 16"),
    "float positions": ({**BAD, "position_ids": [0.0] * 16}, {}, r"position_ids must hold integers"),
    "seq_lengths sum": ({**BAD, "seq_lengths": [4, 7]}, {}, r"seq_lengths \[4, 7\] must be positive and sum to its 16"),
    "positions not from 0": (
        {"input_ids": IDS, "position_ids": list(range(1, 17))},
        {},
        r"position_ids do not start at 0",
    ),
    "positions inside a document": (
        {"input_ids": IDS, "position_ids": [0, 1, 2, 3, 0, 1, 2, 9, 4, 5, 6, 0, 1, 2, 3, 4]},
        {},
        r"position_ids are not 0, 1, \.\.\. inside each document \(first difference at index 7",
    ),
    "seq_lengths against position_ids": (
        {**BAD, "position_ids": [*range(4), *range(6), *range(6)]},
        {"packed": True},
        r"example 0's position_ids does not describe the documents of its seq_lengths \(documents \[4, 7, 5\]\): first "
        r"difference at index 10: got \[\.\.\.\[3, 4, 5, 0, 1, 2, 3\]\.\.\.\], "
        r"expected \[\.\.\.\[3, 4, 5, 6, 0, 1, 2\]",
    ),
    "cu_seq_lens against position_ids": (
        {"input_ids": IDS, "position_ids": BOUNDARIES["position_ids"], "cu_seq_lens_k": [0, 4, 16]},
        {},
        r"cu_seq_lens_k does not describe the documents of its position_ids \(documents \[4, 7, 5\]\): first "
        r"difference at index 2",
    ),
    "seq_idx against seq_lengths": ({**BAD, "seq_idx": [0] * 16}, {}, r"seq_idx does not describe .* index 4"),
    "max_length of one document": (
        {"input_ids": IDS, "max_length_k": 7},
        {},
        r"max_length_k does not describe the documents of its one document of 16 tokens",
    ),
    "cu_seq_lens not rising": ({"input_ids": IDS, "cu_seq_lens_q": [0, 9, 4, 16]}, {}, r"must rise from 0 to its 16"),
    "mask values": ({"input_ids": IDS, "attention_mask": [2] * 16}, {}, r"attention_mask must hold 0 and 1, got \[2\]"),
    "padded documents": (
        {**BAD, "attention_mask": [1] * 15 + [0]},
        {},
        r"example 0 holds 3 documents and pads .* drop its padded tokens",
    ),
    "labels on padding": (
        {"input_ids": IDS, "attention_mask": [1] * 15 + [0]},
        {"labels": True},
        r"example 0's labels on 1 padded tokens .* the first at 15 \(18\)",
    ),
    "packed padding": (
        {"input_ids": IDS, "attention_mask": [1] * 15 + [0]},
        {"packed": True},
        r"examples \[0\] pad .* packed=True lays documents back to back",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_example_keys_are_refused_by_name(case: str) -> None:
    example, options, pattern = REFUSALS[case]
    options = dict(options)
    if options.pop("labels", False):
        example = {**example, "labels": example["input_ids"]}
    res: dict = {}
    expect_error(res, case, ValueError, pattern, lambda: _collate([example], **options))
    assert res[case] is True, res[case]


def test_padding_beside_documents_is_refused() -> None:
    padded = {"input_ids": IDS[:5], "attention_mask": [1] * 4 + [0]}
    with pytest.raises(ValueError, match=r"examples \[1\] pad .* examples \[0\] hold several documents.*packed=True"):
        _collate([BAD, padded])
