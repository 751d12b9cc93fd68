"""What the Hugging Face adapter cannot compute exactly from a rank's shard is refused by name, on 2 gloo ranks:
length-dependent RoPE over rows with documents, an MoE router's auxiliary loss, a ``compute_loss_func`` (it would
get labels already shifted), labels on padding, left padding with learned absolute positions, full attention without
the mask of its padding (with it, a row the mesh pads equals the stock model), labels without ``shift_labels`` or
``num_items_in_batch`` (mesh_cp's batch: the stock model's loss and gradients; also GPT2LMHeadModel, whose class name
matches no loss_type), pooled heads (token classification: exact logits, labels refused), and a second model built
from the attached one's config object keeps its attention. The default collator honours ``attention_mask`` and
refuses other keys. (Hybrid state-space / linear-attention models: ``test_hybrid.py``.)
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from mesh_cp.testing import expect_error, spawn_gloo

SEQ = 32


def checks_worker(rank: int, world: int) -> dict:
    import copy

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
    moe = hf.attach(AutoModelForCausalLM.from_config(mixtral), mesh)  # training mode, as from_config leaves it
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
    moe.eval()  # no loss made: the per-token router logits are exact
    out["router logits without a loss"] = len(moe(**routed).router_logits)
    expect_error(
        out, "router loss (labels)", NotImplementedError, r"output_router_logits=True",
        lambda: moe(**routed, labels=whole.input_ids),
    )  # fmt: skip

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
    gpt2_reference = AutoModelForCausalLM.from_config(configs["gpt2 (learned absolute positions)"]).eval()
    gpt2 = hf.attach(copy.deepcopy(gpt2_reference), mesh)
    left = torch.ones_like(ids)
    left[1, :5] = 0
    padded = hf.shard_batch(ids, mesh=mesh, attention_mask=left)
    expect_error(
        out, "left padding with absolute positions", NotImplementedError,
        r"learned absolute positions \(transformer.wpe\) and rows \[1\] are padded on the left",
        lambda: gpt2(input_ids=padded.input_ids, position_ids=padded.position_ids, mesh_cp_mask=padded.mask),
    )  # fmt: skip
    right = hf.shard_batch(ids, mesh=mesh, attention_mask=left.flip(1))
    out["right padding with absolute positions"] = gpt2(
        input_ids=right.input_ids, position_ids=right.position_ids
    ).logits.shape[1]
    labelled = gpt2(**hf.ShardingCollator.batch_dict(hf.shard_batch(ids, mesh=mesh))).loss.detach().clone()
    dist.all_reduce(labelled)  # GPT2LMHeadModel: no loss_type, transformers' default loss
    out["loss of a head without loss_type error"] = (
        (labelled - gpt2_reference(input_ids=ids, labels=ids).loss).abs().item()
    )
    out |= _full_attention(mesh, configs["llama rope linear"], VOCAB)
    out |= _attach_cases(mesh, configs["llama rope linear"], VOCAB)
    return out


def _attach_cases(mesh, config, vocab: int) -> dict:
    """What :func:`hf.attach` refuses or keeps exact beyond the attention: labels given the one-process way or
    without ``num_items_in_batch`` are refused, mesh_cp's batch is exact (loss and gradient against the stock model on
    the whole sequence); pooled heads are refused, token classification's logits are exact and its labels refused; a
    second model built from the same config object keeps its stock attention."""
    import copy

    import torch.distributed as dist
    import transformers as tf

    import mesh_cp
    from mesh_cp.integrations import hf

    out: dict = {}
    ids = torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))
    shared = copy.deepcopy(config)
    shared._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = tf.LlamaForCausalLM(shared)  # a policy and its reference, built from one config object
    policy = tf.LlamaForCausalLM(shared)
    policy.load_state_dict(reference.state_dict())
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()
    hf.attach(policy, mesh)
    sharded = hf.shard_batch(ids, mesh=mesh)
    batch = hf.ShardingCollator.batch_dict(sharded)
    ddp = hf.data_parallel(policy, mesh=mesh)  # gradients summed over the CP group
    got = ddp(**batch)
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss)
    out["loss of mesh_cp's batch error"] = (loss - want.loss).abs().item()
    grads = [
        (p.grad - q.grad).abs().max().item() for p, q in zip(policy.parameters(), reference.parameters(), strict=True)
    ]
    out["gradient of mesh_cp's batch error"] = max(grads)
    again = reference(input_ids=ids).logits  # the other model still runs its stock attention on whole sequences
    out["other model's attention"] = reference.config._attn_implementation
    out["other model's logits error"] = (again - want.logits).abs().max().item()
    whole = mesh_cp.shard_sequence(want.logits, mesh=mesh, dim=1, layout="zigzag")
    out["attached model's logits error"] = (got.logits - whole).abs().max().item()
    plain = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    own_labels = mesh_cp.shard_sequence(ids, mesh=mesh, dim=1, layout="zigzag")
    expect_error(
        out, "labels of one process", ValueError,
        r"given labels without shift_labels: transformers would shift this rank's shard of the labels itself",
        lambda: policy(**plain, labels=own_labels),
    )  # fmt: skip
    expect_error(
        out, "labels without num_items_in_batch", ValueError, r"given labels without num_items_in_batch",
        lambda: policy(**{k: batch[k] for k in ("input_ids", "position_ids", "labels", "shift_labels")}),
    )  # fmt: skip
    for head in (tf.LlamaForSequenceClassification, tf.LlamaForQuestionAnswering):
        expect_error(
            out, f"attach {head.__name__}", NotImplementedError,
            rf"{head.__name__} has a head that reads across the sequence \({head.__name__}",
            lambda head=head: hf.attach(head(copy.deepcopy(config)), mesh),
        )  # fmt: skip
    bert = tf.BertConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    expect_error(
        out, "attach a base model with a pooler", NotImplementedError,
        r"BertModel has a head that reads across the sequence \(pooler \(BertPooler\)\).*add_pooling_layer=False",
        lambda: hf.attach(tf.BertModel(bert), mesh),
    )  # fmt: skip
    tagger = tf.LlamaForTokenClassification(copy.deepcopy(config)).eval()
    tagged = tagger(input_ids=ids).logits
    hf.attach(tagger, mesh)
    shard = mesh_cp.shard_sequence(tagged, mesh=mesh, dim=1, layout="zigzag")
    out["token classification logits error"] = (tagger(**plain).logits - shard).abs().max().item()
    expect_error(
        out, "token classification labels", NotImplementedError,
        r"LlamaForTokenClassification was given labels, and its loss \(ForTokenClassification\) takes no shift_labels",
        lambda: tagger(**plain, labels=own_labels),
    )  # fmt: skip
    return out


def _full_attention(mesh, config, vocab: int) -> dict:
    """Full (non-causal) attention over a 7-token row the mesh pads to 8: exact against the stock model with the
    batch sharded ``causal=False`` (the padding is in the mask), refused without that mask."""
    import copy

    from transformers import AutoModelForCausalLM

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.collate import shard_collated

    out: dict = {}
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = hf.attach(copy.deepcopy(reference), mesh)
    ids = torch.randint(3, vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    want = reference(input_ids=ids, attention_mask=torch.ones_like(ids), is_causal=False).logits
    batch = shard_collated({"input_ids": ids, "labels": ids}, mesh=mesh, pad_token_id=0, causal=False)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "mesh_cp_mask")}
    got = model(**inputs, is_causal=False).logits
    padded = torch.nn.functional.pad(want, (0, 0, 0, got.shape[1] * mesh.size - 7))
    shard = mesh_cp.shard_sequence(padded, mesh=mesh, dim=1, layout="zigzag")
    real = mesh_cp.position_ids(got.shape[1] * mesh.size, mesh=mesh, layout="zigzag") < 7
    out["full attention error"] = (got - shard)[:, real].abs().max().item()
    unmasked = hf.shard_batch(torch.nn.functional.pad(ids, (0, 1)), mesh=mesh)
    expect_error(
        out, "full attention without its mask", NotImplementedError,
        r"full \(non-causal\) attention without the batch's mesh_cp_mask would attend to padding",
        lambda: model(input_ids=unmasked.input_ids, position_ids=unmasked.position_ids, is_causal=False),
    )  # fmt: skip
    return out


def test_refused_by_name_on_two_ranks() -> None:
    for rank, out in enumerate(spawn_gloo(checks_worker, 2)):
        refused = {k: v for k, v in out.items() if isinstance(v, bool | str) and k != "other model's attention"}
        assert len(refused) == 14 and all(v is True for v in refused.values()), (rank, refused)
        errors = [k for k in out if k.endswith("error")]
        assert len(errors) == 7 and all(out[k] <= 1e-5 for k in errors), (rank, {k: out[k] for k in errors})
        assert out["other model's attention"] == "sdpa", (rank, out)
        assert out["router logits without a loss"] == 2, (rank, out)  # one per layer
        assert out["right padding with absolute positions"] == SEQ // 2, (rank, out)
        assert out["longrope without documents"] == out["router loss off by keyword"] == SEQ // 2, (rank, out)
        assert out["labels -100 on padding"] == 2 * (SEQ - 1) - 12, (rank, out)  # 19 + 31 shifted labels


def test_default_collator_honours_the_mask_and_refuses_other_keys() -> None:
    from mesh_cp.integrations.hf.collate import PadExamples

    collate = PadExamples(pad_token_id=0, model_inputs=("input_ids", "token_type_ids", "position_ids"))
    batch = collate([{"input_ids": [5, 6, 7, 0, 0], "attention_mask": [1, 1, 1, 0, 0]}, {"input_ids": [8, 9]}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, -100, -100, -100]]
    with pytest.raises(ValueError, match=r"examples have \['token_type_ids'\], which mesh_cp's default collator"):
        collate([{"input_ids": [1, 2], "token_type_ids": [0, 0], "index": 3}])
    assert set(collate([{"input_ids": [1, 2], "index": 3}])) == set(PadExamples.KEYS)  # not a model input: left out
