"""What the Hugging Face adapter cannot compute exactly from a rank's shard is refused by name, on 2 gloo ranks:
length-dependent RoPE over rows with documents, an MoE router's auxiliary loss, a ``compute_loss_func`` (it would
get labels already shifted), labels on padding. The default collator honours ``attention_mask`` and refuses other
keys. (Hybrid state-space / linear-attention models: ``test_hf_architectures.py``.)
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from mesh_cp.testing import expect_error, spawn_gloo

SEQ = 32


def checks_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, TrainingArguments

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.collate import shard_collated
    from tests.integrations.hf.test_hf_architectures import VOCAB, architectures

    out: dict = {}
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    configs = architectures()
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))

    longrope = hf.attach(
        AutoModelForCausalLM.from_config(configs["phi3 rope longrope (sequence 32 > original max 24)"]), mesh
    )
    packed = hf.shard_batch(ids, mesh=mesh, documents=[[16, 16], [20, 12]])
    expect_error(
        out, "longrope with documents", NotImplementedError,
        r"rope_type 'longrope'\) picks its frequencies from the longest position of the call",
        lambda: longrope(input_ids=packed.input_ids, position_ids=packed.position_ids, mesh_cp_mask=packed.mask),
    )  # fmt: skip
    whole = hf.shard_batch(ids, mesh=mesh)
    out["longrope without documents"] = longrope(
        input_ids=whole.input_ids, position_ids=whole.position_ids
    ).logits.shape[1]

    mixtral = configs["mixtral (MoE)"]
    moe = hf.attach(AutoModelForCausalLM.from_config(mixtral), mesh)
    routed = {"input_ids": whole.input_ids, "position_ids": whole.position_ids}
    expect_error(
        out, "router loss (keyword)", NotImplementedError, r"output_router_logits=True: its router auxiliary loss",
        lambda: moe(**routed, output_router_logits=True),
    )  # fmt: skip
    moe.config.output_router_logits = True
    expect_error(
        out, "router loss (config)", NotImplementedError, r"output_router_logits=True",
        lambda: moe(**routed),
    )  # fmt: skip
    out["router loss off by keyword"] = moe(**routed, output_router_logits=False).logits.shape[1]

    layout = mesh_cp.DataContextParallel.create(dist.group.WORLD, cp_size=world, tile=(1, world))
    llama = AutoModelForCausalLM.from_config(configs["llama rope linear"])
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], per_device_train_batch_size=1)
        expect_error(
            out, "compute_loss_func", NotImplementedError, r"compute_loss_func would get this rank's shard of labels",
            lambda: hf.mesh_cp_trainer_class()(
                model=llama, args=args, train_dataset=[{"input_ids": [1, 2, 3]}], parallel=layout, pad_token_id=0,
                compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
            ),
        )  # fmt: skip
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    expect_error(
        out, "labels on padding", ValueError,
        r"labels on 12 padded positions \(attention_mask 0\) are not -100, the first at row 1, column 20",
        lambda: shard_collated({"input_ids": ids, "labels": ids, "attention_mask": mask}, mesh=mesh, pad_token_id=0),
    )  # fmt: skip
    kept = shard_collated(
        {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask},
        mesh=mesh,
        pad_token_id=0,
    )
    out["labels -100 on padding"] = kept["num_items_in_batch"] if "num_items_in_batch" in kept else None
    return out


def test_refused_by_name_on_two_ranks() -> None:
    for rank, out in enumerate(spawn_gloo(checks_worker, 2)):
        refused = {k: v for k, v in out.items() if isinstance(v, bool | str)}
        assert len(refused) == 5 and all(v is True for v in refused.values()), (rank, refused)
        assert out["longrope without documents"] == out["router loss off by keyword"] == SEQ // 2, (rank, out)
        assert out["labels -100 on padding"] == 2 * (SEQ - 1) - 12, (rank, out)  # 19 + 31 shifted labels


def test_default_collator_honours_the_mask_and_refuses_other_keys() -> None:
    from mesh_cp.integrations.hf.collate import PadExamples

    collate = PadExamples(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7, 0, 0], "attention_mask": [1, 1, 1, 0, 0]}, {"input_ids": [8, 9]}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, -100, -100, -100]]
    with pytest.raises(ValueError, match=r"examples have \['token_type_ids'\], which mesh_cp's default collator"):
        collate([{"input_ids": [1, 2], "token_type_ids": [0, 0]}])
