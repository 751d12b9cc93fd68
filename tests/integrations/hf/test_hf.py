"""transformers models with attn_implementation="mesh_cp" against the single-process SDPA model.

Tiny random-weight Llama (MHA and GQA), Qwen2 and Mistral: at P = 4 (tiles 2x2 and 1x4) and P = 2,
logits, loss and every parameter gradient match the stock model to 1e-5 (fp32), and so do the
parameters after 3 SGD steps with momentum; so does the head-parallel x mesh hybrid (2 heads x tiles 1x2 and
2x1, packed documents, the collator's padding). Right padding is exact; left padding, model-level padding masks and
sliding windows are refused with their reason. Every keyword the attention gets is handled exactly
(``is_causal=False``, attention sinks) or refused by name (packed batches, unknown keywords); a model whose
layers bypass the attention interface is refused; autocast and ``copy.deepcopy`` of an attached model work.

The cases share one spawned group of 4 ranks (:func:`spawned`): the P = 4 cases on all of it, each test reading its
own section (:func:`world4`), then the models at P = 2 on the group of its first 2 ranks.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

pytest.importorskip("transformers")

import mesh_cp  # noqa: E402
from mesh_cp.core import factorizations  # noqa: E402
from mesh_cp.core.split import split_documents  # noqa: E402
from mesh_cp.testing import expect_error, run_sections, section_results, spawn_gloo  # noqa: E402
from mesh_cp.testing.models import VOCAB, tiny_causal_lms, tiny_config  # noqa: E402
from tests.group_sizes import by_group_size, size_results  # noqa: E402

TOL = 1e-5
SEQ = 48
BATCH = 2


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _reference(ref, input_ids, attention_mask, documents):
    """The single-process model's logits and loss for the batch the mesh trains on: packed documents each on its
    own (transformers' SDPA path does not separate documents by position_ids), padded rows with positions from 0
    at the first real token and no label where the mesh has none (not a first real token after left padding)."""
    if documents is None:
        if attention_mask is None:
            return ref(input_ids=input_ids, labels=input_ids)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[torch.arange(len(labels)), attention_mask.argmax(-1)] = -100  # a row's first real token
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return ref(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, labels=labels)
    pieces, targets, start = [], [], 0
    for n in documents[0]:
        pieces.append(ref(input_ids=input_ids[:, start : start + n]).logits)
        targets.append(torch.cat([input_ids[0, start + 1 : start + n], torch.tensor([-100])]))
        start += n
    logits = torch.cat(pieces, 1)
    loss = torch.nn.functional.cross_entropy(logits[0], torch.cat(targets), ignore_index=-100)
    padded = torch.cat([logits, logits.new_zeros(1, SEQ - start, logits.shape[-1])], 1)
    return types.SimpleNamespace(logits=padded, loss=loss)


def compare(model_name: str, config, mesh, attention_mask=None, documents=None, split=False) -> dict[str, float]:
    """Max errors of the mesh model against the stock SDPA model: logits, loss, grads, params after 3 steps.

    ``attention_mask``: left or right padding; ``documents``: one packed row of documents of these lengths;
    ``split``: the documents laid out split over the ranks (Note [Split documents])."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = hf.attach(copy.deepcopy(ref), mesh)
    ddp = hf.data_parallel(model, mesh=mesh)  # gradients summed over the CP group
    gen = torch.Generator().manual_seed(1)
    errors: dict[str, float] = {}
    # SGD with momentum: Adam would turn roundoff-sized gradients of parameters whose exact gradient is
    # zero (the k bias of Qwen2: a constant added to a whole row of scores) into full-size steps.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        input_ids = torch.randint(0, VOCAB, (1 if documents else BATCH, SEQ), generator=gen)
        out = _reference(ref, input_ids, attention_mask, documents)
        out.loss.backward()

        batch = hf.shard_batch(input_ids, mesh=mesh, attention_mask=attention_mask, documents=documents, split=split)
        extra = {} if batch.mask is None else {"mesh_cp_mask": batch.mask}
        logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, **extra).logits
        loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group)
        if step == 0:
            full, real = out.logits.detach(), None
            if attention_mask is not None or documents is not None:  # padding has no label: real tokens only
                real = attention_mask if documents is None else (torch.arange(SEQ) < sum(documents[0]))[None]
            if split:  # token g of the split row is token source[g] of the packed row
                (source,) = split_documents(documents, seq_len=SEQ, world=mesh.size)[1]
                full, real = full[:, source], real[:, source]
            shard_ref = mesh_cp.shard_sequence(full, mesh=mesh, dim=1, layout="zigzag")
            if real is not None:
                real = mesh_cp.shard_sequence(real.long(), mesh=mesh, dim=1, layout="zigzag").bool()
                errors["logits"] = _max_err(logits.detach()[real], shard_ref[real])
            else:
                errors["logits"] = _max_err(logits.detach(), shard_ref)
            errors["loss"] = abs(total.item() - out.loss.item())
            errors["grads"] = max(
                _max_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    errors["params after 3 steps"] = max(
        _max_err(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {f"{model_name} {k}": v for k, v in errors.items()}


def hf_worker(rank: int, world: int, group=None) -> dict:
    """The models on ``group`` (the world when ``None``) of ``world`` ranks."""
    import torch.distributed as dist

    from mesh_cp.integrations import hf

    group = dist.group.WORLD if group is None else group
    results: dict = {}
    tiles = [(2, 2), (1, 4)] if world == 4 else factorizations(world)
    for tile in tiles:
        mesh = mesh_cp.CPMesh.create(group, tile=tile)
        for name, config in tiny_causal_lms().items():
            for key, err in compare(name, config, mesh).items():
                results[f"{tile[0]}x{tile[1]} {key}"] = err
    mesh = mesh_cp.CPMesh.create(group, tile=(2, 2) if world == 4 else (1, world))
    if world == 4:
        right = torch.ones(BATCH, SEQ, dtype=torch.long)
        right[0, SEQ - 11 :] = 0
        right[1, SEQ - 3 :] = 0
        for key, err in compare(
            "llama-gqa right-padded", tiny_causal_lms()["llama-gqa"], mesh, attention_mask=right
        ).items():
            results[key] = err
        left_and_right = torch.ones(BATCH, SEQ, dtype=torch.long)
        left_and_right[0, :7] = 0
        left_and_right[1, SEQ - 5 :] = 0
        for key, err in compare(
            "llama-gqa left- and right-padded", tiny_causal_lms()["llama-gqa"], mesh, attention_mask=left_and_right
        ).items():
            results[key] = err
        packed = [[1, 5, 13, 2, 20, 3]]  # 44 of 48 tokens: documents of 1 token, shorter and longer than a shard
        for key, err in compare("llama-gqa packed", tiny_causal_lms()["llama-gqa"], mesh, documents=packed).items():
            results[key] = err
        split = compare("llama-gqa packed split", tiny_causal_lms()["llama-gqa"], mesh, documents=packed, split=True)
        results |= split
        checks = _refusals(mesh, hf)
        results |= checks
    return results


def _refusals(mesh, hf) -> dict:
    """Unsupported inputs raise with their reason (never silently dropped)."""
    from transformers import AutoModelForCausalLM

    checks = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    left = torch.ones(BATCH, SEQ, dtype=torch.long)
    left[0, :5] = 0

    inner = left.clone()
    inner[1, 20:22] = 0
    expect_error(
        checks,
        "inner padding refused",
        ValueError,
        "pads inside a sequence",
        lambda: hf.shard_batch(ids, mesh=mesh, attention_mask=inner),
    )
    model = hf.attach(AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"]), mesh)
    batch = hf.shard_batch(ids, mesh=mesh)
    local_mask = torch.ones_like(batch.input_ids)
    local_mask[0, 0] = 0
    expect_error(
        checks,
        "model padding mask refused",
        ValueError,
        "does not take padding masks",
        lambda: model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=local_mask),
    )
    bounds = torch.tensor([0, 20, SEQ], dtype=torch.int32)
    expect_error(
        checks,
        "packing keywords without mesh_cp_mask refused",
        NotImplementedError,
        "without the mesh_cp_mask of one packed row",
        lambda: model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds
        ),
    )
    packed = hf.shard_batch(ids[:1], mesh=mesh, documents=[[20, SEQ - 20]])
    expect_error(
        checks,
        "positions restarting without mesh_cp_mask refused",
        ValueError,
        "packed rows .* need the mesh_cp_mask",
        lambda: model(input_ids=packed.input_ids, position_ids=packed.position_ids),
    )
    examples = [{"input_ids": ids[0, :n].tolist()} for n in (5, 1, 30)]
    collated = hf.ShardingCollator(mesh, pad_token_id=0, packed=True)(examples)
    direct = hf.shard_batch(
        torch.cat([torch.tensor(e["input_ids"]) for e in examples] + [torch.zeros(4, dtype=torch.long)])[
            None
        ],  # 40 = 5 * 2P
        mesh=mesh,
        documents=[[5, 1, 30]],
    )
    checks["packed collator = shard_batch(documents=...)"] = (
        collated["mesh_cp_mask"] == direct.mask == mesh_cp.AttentionMask.from_lengths([[5, 1, 30]])
        and all(
            torch.equal(collated[k], getattr(direct, a))
            for k, a in (("input_ids", "input_ids"), ("position_ids", "position_ids"), ("shift_labels", "shift_labels"))
        )
        and collated["num_items_in_batch"].item() == direct.num_items_in_batch == 4 + 0 + 29
    )
    cu = {"cu_seq_lens_q": torch.tensor([0, 5, 6, 36]), "cu_seq_lens_k": torch.tensor([0, 5, 6, 36])}
    with torch.no_grad():
        checks["cu_seq_lens matching mesh_cp_mask accepted"] = torch.equal(
            model(**collated, **cu, max_length_q=30, max_length_k=30).logits, model(**collated).logits
        )
    expect_error(
        checks,
        "cu_seq_lens not matching mesh_cp_mask refused",
        ValueError,
        r"cu_seq_lens_q \[0, 5, 36\] does not describe the documents of mesh_cp_mask \(\[0, 5, 6, 36\]\)",
        lambda: model(**collated, cu_seq_lens_q=torch.tensor([0, 5, 36])),
    )
    split = hf.ShardingCollator(mesh, pad_token_id=0, packed=True, balance="split")(examples)
    expect_error(
        checks,
        "packing keywords with split documents refused",
        NotImplementedError,
        r"cu_seq_lens_k, cu_seq_lens_q with split documents .* drop them",
        lambda: model(**split, **cu),
    )
    model(**collated).loss.backward()  # a transformers model takes the packed batch as it is
    checks["packed batch through model(**batch)"] = all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.requires_grad
    )
    bare = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"])
    hf.register()
    bare.set_attn_implementation("mesh_cp")
    expect_error(
        checks,
        "no mesh attached",
        ValueError,
        r"call mesh_cp.integrations.hf.attach\(model, mesh\)",
        lambda: bare(input_ids=batch.input_ids, position_ids=batch.position_ids),
    )
    return checks


def world4_worker(rank: int, world: int) -> dict[int, dict]:
    """Every section on the 4 ranks, then the models on the group of the first 2, in one spawned group."""
    import transformers

    transformers.logging.set_verbosity_error()
    return by_group_size((4, 2), _sections_or_models, rank, world)


def _sections_or_models(group, rank: int, world: int) -> dict:
    return run_sections(WORLD4_SECTIONS, rank, world) if world == 4 else hf_worker(rank, world, group)


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, dict]]:
    return spawn_gloo(world4_worker, 4)


@pytest.fixture(scope="module")
def world4(spawned) -> list[dict[str, dict]]:
    return size_results(spawned, 4)


section = section_results


@pytest.mark.parametrize("world", [4, 2])
def test_hf_models_match_single_process_sdpa(world: int, request: pytest.FixtureRequest) -> None:
    if world == 4:
        per_rank = section(request.getfixturevalue("world4"), "models")
    else:
        per_rank = size_results(request.getfixturevalue("spawned"), 2)
    for rank, res in enumerate(per_rank):
        assert res, f"rank {rank} ran nothing"
        refusals = {k: v for k, v in res.items() if isinstance(v, (bool, str))}
        assert all(v is True for v in refusals.values()), f"rank {rank}: {refusals}"
        errors = {k: v for k, v in res.items() if not isinstance(v, (bool, str))}
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"
        tiles = ["2x2", "1x4"] if world == 4 else [f"{a}x{b}" for a, b in factorizations(world)]
        metrics = ("logits", "loss", "grads", "params after 3 steps")
        expected = {f"{t} {m} {metric}" for t in tiles for m in tiny_causal_lms() for metric in metrics}
        if world == 4:
            padded = ("llama-gqa right-padded", "llama-gqa left- and right-padded", "llama-gqa packed")
            padded += ("llama-gqa packed split",)
            expected |= {f"{name} {metric}" for name in padded for metric in metrics}
        assert set(errors) == expected, sorted(set(errors) ^ expected)


def dp_cp_worker(rank: int, world: int) -> dict:
    """DP 2 x CP 2 (tile 1x2 and 2x1): each replica trains on its own batch; the DP-averaged update must
    equal the single-process model trained on the mean of the replicas' losses."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    results: dict = {}
    for tile in ((1, 2), (2, 1)):
        layout = hf.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile=tile)
        results[f"{tile} layout"] = (layout.dp_size, layout.dp_rank, list(layout.mesh.global_ranks))
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
        model = hf.attach(copy.deepcopy(ref), layout.mesh)
        ddp = layout.data_parallel(model)  # summed over CP, averaged over DP
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(layout.dp_size)]
            ref_loss = sum(ref(input_ids=b, labels=b).loss for b in batches) / len(batches)
            ref_loss.backward()
            batch = hf.shard_batch(batches[layout.dp_rank], mesh=layout.mesh)
            logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        results[f"{tile} params after 3 steps"] = max(
            _max_err(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
    try:
        hf.DataContextParallel.create(dist.group.WORLD, cp_size=3, tile=(1, 3))
    except ValueError as err:
        results["cp_size refused"] = "must divide the 4 ranks" in str(err) or str(err)
    else:
        results["cp_size refused"] = "did not raise"
    return results


def test_dp_by_cp_averages_over_dp_and_sums_over_cp(world4) -> None:
    for rank, res in enumerate(section(world4, "dp_cp")):
        assert res["cp_size refused"] is True, res["cp_size refused"]
        for tile in ((1, 2), (2, 1)):
            assert res[f"{tile} layout"] == (2, rank // 2, [2 * (rank // 2), 2 * (rank // 2) + 1])
            assert res[f"{tile} params after 3 steps"] <= TOL, (rank, tile, res)


def collator_worker(rank: int, world: int) -> dict:
    """Ragged examples through ShardingCollator: the model's own loss (shift_labels, num_items_in_batch)
    summed over the CP group equals the stock model's mean loss on the right-padded batch."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    gen = torch.Generator().manual_seed(4)
    examples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in (37, 21, 30)]
    batch = hf.ShardingCollator(mesh, pad_token_id=0)(examples)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"], attn_implementation="sdpa")
    model = hf.attach(copy.deepcopy(ref), mesh)
    loss = model(**batch).loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.group)
    padded = torch.zeros(3, 40, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, e in enumerate(examples):
        padded[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[row, : len(e["input_ids"])] = 1
    ref_loss = ref(input_ids=padded, attention_mask=mask, labels=padded.masked_fill(mask == 0, -100)).loss
    # device=: every tensor of the batch goes where the training loop runs (meta stands in for an accelerator).
    on_meta = hf.ShardingCollator(mesh, pad_token_id=0, device="meta")(examples)
    sharded = hf.shard_batch(padded, mesh=mesh, attention_mask=mask, device="meta")
    return {
        "devices": sorted(
            {str(t.device) for t in (*on_meta.values(), sharded.input_ids, sharded.position_ids, sharded.shift_labels)}
        ),
        "meta shapes": {k: tuple(t.shape) for k, t in on_meta.items()} == {k: tuple(t.shape) for k, t in batch.items()},
        "meta items": sharded.num_items_in_batch,
        "shape": tuple(batch["input_ids"].shape),
        "loss error": abs(total.item() - ref_loss.item()),
        "items": int(batch["num_items_in_batch"]),
    }


def test_collator_pads_shards_and_gives_the_models_own_loss(world4) -> None:
    for rank, res in enumerate(section(world4, "collator")):
        assert res["shape"] == (3, 10), res  # 37 tokens padded to 40 (a multiple of 2P = 8), 10 per rank
        assert res["items"] == res["meta items"] == 36 + 20 + 29, res
        assert res["devices"] == ["meta"] and res["meta shapes"] is True, res
        assert res["loss error"] <= TOL, (rank, res)


def _mesh_against_reference(ref, model, mesh, ids: torch.Tensor, **kwargs) -> dict[str, float]:
    """Errors of ``model`` (attached) against ``ref`` on ``ids`` with keyword arguments ``kwargs`` for both: this
    rank's logits, and every parameter gradient of the mean next-token loss (summed over the CP group)."""
    from mesh_cp.integrations import hf

    logits = ref(input_ids=ids, use_cache=False, **kwargs).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    batch = hf.shard_batch(ids, mesh=mesh, causal=kwargs.get("is_causal", True))
    masked = {} if batch.mask is None else {"mesh_cp_mask": batch.mask}
    ddp = hf.data_parallel(model, mesh=mesh)  # gradients summed over the CP group (kept until backward)
    local = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **masked, **kwargs).logits
    hf.causal_lm_loss(local, batch.shift_labels, batch.num_items_in_batch).backward()
    shard = mesh_cp.shard_sequence(logits.detach(), mesh=mesh, dim=1, layout="zigzag")
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    assert all((a is None) == (b is None) for a, b in pairs), "gradients missing on one side"
    return {
        "logits": _max_err(local.detach(), shard),
        "grads": max(_max_err(a, b) for a, b in pairs if a is not None),
    }


def keywords_section(rank: int, world: int) -> dict:
    """Keywords of the attention call: exact (is_causal=False, attention sinks) or refused by name."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, GptOssConfig

    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    results: dict = {}
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    model = hf.attach(copy.deepcopy(ref), mesh)
    # is_causal given as a keyword wins over the module's attribute, as in transformers' sdpa path.
    for key, err in _mesh_against_reference(ref, model, mesh, ids, is_causal=False).items():
        results[f"is_causal=False {key}"] = err
    with torch.no_grad():
        results["is_causal=False differs from causal"] = _max_err(ref(ids, is_causal=False).logits, ref(ids).logits)

    # Attention sinks (gpt-oss's s_aux), every layer full attention; the reference is transformers' eager path.
    sinks_config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention", "full_attention"],
        attention_dropout=0.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(sinks_config, attn_implementation="eager")
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model = hf.attach(copy.deepcopy(ref), mesh)
    for key, err in _mesh_against_reference(ref, model, mesh, ids).items():
        results[f"attention sinks {key}"] = err

    torch.manual_seed(0)
    model = hf.attach(AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"]), mesh)
    batch = hf.shard_batch(ids, mesh=mesh)
    # Two documents of SEQ / 2 tokens packed in each row: positions restart; transformers would mask them apart.
    packed = torch.cat([torch.arange(SEQ // 2)] * 2).unsqueeze(0).expand(BATCH, -1)
    packed_local = mesh_cp.shard_sequence(packed, mesh=mesh, dim=1, layout="zigzag")
    expect_error(
        results,
        "packed position_ids refused",
        ValueError,
        r"packed rows \(positions restarting per document\) need the mesh_cp_mask",
        lambda: model(input_ids=batch.input_ids, position_ids=packed_local),
    )
    # After a good forward, positions of the same shape are compared on the device (no host read): still refused.
    model(input_ids=batch.input_ids, position_ids=batch.position_ids)
    expect_error(
        results,
        "packed position_ids refused after a checked step",
        ValueError,
        r"packed rows \(positions restarting per document\) need the mesh_cp_mask",
        lambda: model(input_ids=batch.input_ids, position_ids=packed_local.clone()),
    )
    cu = torch.tensor([0, SEQ // 2, SEQ], dtype=torch.int32)
    expect_error(
        results,
        "cu_seq_lens without mesh_cp_mask refused",
        NotImplementedError,
        r"got cu_seq_lens_k, cu_seq_lens_q, max_length_k, max_length_q without the mesh_cp_mask of one packed row",
        lambda: model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=SEQ // 2,
            max_length_k=SEQ // 2,
        ),
    )
    expect_error(
        results,
        "unknown keyword refused",
        NotImplementedError,
        r"keyword\(s\) \['window_stride'\] it does not handle",
        lambda: model(input_ids=batch.input_ids, position_ids=batch.position_ids, window_stride=2),
    )
    expect_error(
        results,
        "missing position_ids refused",
        ValueError,
        "called without position_ids",
        lambda: model(input_ids=batch.input_ids),
    )
    # A layer called directly (not through the model's forward) with positions numbered from 0.
    hidden = model.model.embed_tokens(batch.input_ids)
    from_zero = torch.arange(SEQ // 4).unsqueeze(0)
    expect_error(
        results,
        "shard numbered from 0 refused",
        ValueError,
        "are not this rank.s positions of a sequence of 48 tokens.*a shard numbered from 0 would be silently wrong",
        lambda: model.model.layers[0](
            hidden, position_embeddings=model.model.rotary_emb(hidden, from_zero), position_ids=from_zero
        ),
    )
    # A padding mask on an accelerator is refused without reading it (meta tensors cannot be read).
    expect_error(
        results,
        "accelerator mask refused without a sync",
        NotImplementedError,
        "does not take attention_mask in the model call \\(got one on meta\\)",
        lambda: hf.mesh_cp_mask(
            batch_size=BATCH, q_length=12, kv_length=12, attention_mask=torch.ones(BATCH, 12, device="meta")
        ),
    )
    return results


def test_attention_keywords_are_exact_or_refused_by_name(world4) -> None:
    for rank, res in enumerate(section(world4, "keywords")):
        refusals = {k: v for k, v in res.items() if isinstance(v, (bool, str))}
        assert refusals and all(v is True for v in refusals.values()), f"rank {rank}: {refusals}"
        assert res["is_causal=False differs from causal"] > 1e-2, res
        errors = {k: v for k, v in res.items() if isinstance(v, float) and "differs" not in k}
        assert set(errors) == {
            f"{case} {m}" for case in ("is_causal=False", "attention sinks") for m in ("logits", "grads")
        }
        assert all(v <= TOL for v in errors.values()), f"rank {rank}: {errors}"


def switch_section(rank: int, world: int) -> dict:
    """attach refuses a model that keeps its own attention, and a layer that does not call the mesh."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, FalconConfig

    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    results: dict = {}
    falcon = AutoModelForCausalLM.from_config(
        FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    )
    expect_error(
        results,
        "model without the attention interface refused",
        NotImplementedError,
        r"FalconForCausalLM \('sdpa'\).* kept its attention implementation .* AttentionInterface",
        lambda: hf.attach(falcon, mesh),
    )
    model = hf.attach(hf.attach(AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"]), mesh), mesh)
    results["attaching again replaces the hooks"] = (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)
    attention = model.model.layers[1].self_attn

    def own_attention(hidden_states, *args, **kwargs):  # a layer that attends without the attention interface
        return attention.o_proj(attention.v_proj(hidden_states)), None

    attention.forward = own_attention
    batch = hf.shard_batch(torch.randint(0, VOCAB, (BATCH, SEQ)), mesh=mesh)
    expect_error(
        results,
        "layer bypassing the interface refused",
        NotImplementedError,
        r"model\.layers\.1\.self_attn \(LlamaAttention\) did not call mesh_cp attention",
        lambda: model(input_ids=batch.input_ids, position_ids=batch.position_ids),
    )
    return results


def test_attach_refuses_models_that_do_not_switch(world4) -> None:
    for rank, res in enumerate(section(world4, "switch")):
        assert len(res) == 3 and all(v is True for v in res.values()), f"rank {rank}: {res}"


def _host_reads(model, batch) -> int:
    """Values read on the host (what synchronises an accelerator) during one forward of ``model``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.is_nonzero.default,
    }

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func in reads
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(input_ids=batch.input_ids, position_ids=batch.position_ids.clone())
    return Count.n


def runtime_section(rank: int, world: int) -> dict:
    """Autocast, copy.deepcopy of an attached model, and no host reads per layer."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    results: dict = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    batch = hf.shard_batch(ids, mesh=mesh)

    # Autocast with fp32 weights: RoPE leaves q, k in fp32 and v in bf16; the mesh must match the stock model under
    # the same autocast as closely as that model matches fp32 (flash-attn's rule: within 2x, plus a floor).
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    model = hf.attach(copy.deepcopy(ref), mesh)
    reference = copy.deepcopy(ref)

    def loss_and_grads(m, autocast: bool, sharded: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ddp = hf.data_parallel(m, mesh=mesh) if sharded else None  # gradients summed over the CP group
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if sharded:
                logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
                loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
            else:
                logits = m(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
                )
        loss.backward()
        if not sharded:
            logits = mesh_cp.shard_sequence(logits, mesh=mesh, dim=1, layout="zigzag")
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return logits.detach(), grads

    logits32, grads32 = loss_and_grads(reference, autocast=False, sharded=False)
    logits16, grads16 = loss_and_grads(ref, autocast=True, sharded=False)
    mesh16, mesh_grads16 = loss_and_grads(model, autocast=True, sharded=True)
    results["autocast dtype"] = str(mesh16.dtype)
    results["autocast mesh logits error"] = _max_err(mesh16, logits32)
    results["autocast sdpa logits error"] = _max_err(logits16, logits32)
    results["autocast mesh grads error"] = max(_max_err(a, b) for a, b in zip(mesh_grads16, grads32, strict=True))
    results["autocast sdpa grads error"] = max(_max_err(a, b) for a, b in zip(grads16, grads32, strict=True))

    # copy.deepcopy of an attached model: a second model on the same mesh, with its own attachment.
    clone = copy.deepcopy(model)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    out_clone = clone(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    layer, layer_clone = model.model.layers[0].self_attn, clone.model.layers[0].self_attn
    results["deepcopy same logits"] = bool(torch.equal(out, out_clone))
    results["deepcopy own attachment"] = (
        layer_clone.mesh_cp_attached is not layer.mesh_cp_attached
        and layer_clone.mesh_cp_attached is clone.model.layers[1].self_attn.mesh_cp_attached
        and layer_clone.mesh_cp_attached.mesh is mesh
        and layer_clone.mesh_cp_attached.layers[0][1] is layer_clone
    )

    # Host reads per forward do not grow with the number of layers (the position check runs once per forward).
    reads = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        config = LlamaConfig(**{**tiny_causal_lms()["llama-gqa"].to_dict(), "num_hidden_layers": layers})
        deep = hf.attach(AutoModelForCausalLM.from_config(config), mesh)
        deep(input_ids=batch.input_ids, position_ids=batch.position_ids)  # the first forward checks the switch
        reads[layers] = _host_reads(deep, batch)
    results["host reads (2 layers, 4 layers)"] = (reads[2], reads[4])
    return results


def test_autocast_deepcopy_and_host_reads(world4) -> None:
    for rank, res in enumerate(section(world4, "runtime")):
        assert res["autocast dtype"] == "torch.bfloat16", res
        for m in ("logits", "grads"):
            assert res[f"autocast mesh {m} error"] <= 2 * res[f"autocast sdpa {m} error"] + 1e-4, (rank, m, res)
        assert res["deepcopy same logits"] is True and res["deepcopy own attachment"] is True, (rank, res)
        two, four = res["host reads (2 layers, 4 layers)"]
        assert two == four == 0, f"rank {rank}: host reads per step: {two} with 2 layers, {four} with 4"


def head_parallel_section(rank: int, world: int) -> dict:
    """The head-parallel x mesh hybrid (CP 4 = head_parallel 2 x 2 mesh ranks) through DataContextParallel: MHA (K/V heads
    split) on tile 1x2 and packed GQA on tile 2x1 match the stock model; the collator pads to 2P as for a plain mesh;
    a model whose heads do not split is refused at attach."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    results: dict = {}
    for tile, name, documents in (((1, 2), "llama", None), ((2, 1), "llama-gqa", [[1, 5, 13, 2, 20, 3]])):
        parallel = hf.DataContextParallel.create(dist.group.WORLD, cp_size=4, tile=tile, head_parallel=2)
        label = f"{name}{' packed' if documents else ''} head_parallel 2 x {tile[0]}x{tile[1]}"
        results |= compare(label, tiny_causal_lms()[name], parallel.mesh, documents=documents)
    mesh = parallel.mesh
    # 34 tokens: the hybrid pads to 2P = 8 as the plain mesh does (40, 10 per rank).
    gen = torch.Generator().manual_seed(7)
    examples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in (34, 21)]
    batch = hf.ShardingCollator(mesh, pad_token_id=0)(examples)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    loss = hf.attach(copy.deepcopy(ref), mesh)(**batch).loss.detach()
    dist.all_reduce(loss, group=mesh.group)
    padded = torch.zeros(2, 40, dtype=torch.long)
    real = torch.zeros_like(padded)
    for row, e in enumerate(examples):
        padded[row, : len(e["input_ids"])], real[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"]), 1
    ref_loss = ref(input_ids=padded, attention_mask=real, labels=padded.masked_fill(real == 0, -100)).loss
    results["collator shape"] = tuple(batch["input_ids"].shape)
    results["collator loss"] = abs(loss.item() - ref_loss.item())
    ulysses = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, 1), head_parallel=4)
    two_heads = tiny_config("LlamaConfig", num_attention_heads=2, num_key_value_heads=2)
    expect_error(
        results,
        "heads that do not split refused",
        ValueError,
        r"model\.layers\.0\.self_attn \(LlamaAttention\): head_parallel=4 does not divide the 2 query heads",
        lambda: hf.attach(AutoModelForCausalLM.from_config(two_heads), ulysses),
    )
    return results


def test_head_parallel_hybrid_matches_single_process_sdpa(world4) -> None:
    for rank, res in enumerate(section(world4, "head_parallel")):
        assert res.pop("collator shape") == (2, 10), res
        assert res.pop("heads that do not split refused") is True, res
        metrics = ("logits", "loss", "grads", "params after 3 steps")
        cases = ("llama head_parallel 2 x 1x2", "llama-gqa packed head_parallel 2 x 2x1")
        assert set(res) == {f"{c} {m}" for c in cases for m in metrics} | {"collator loss"}, sorted(res)
        bad = {k: v for k, v in res.items() if not v <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


WORLD4_SECTIONS = {
    "models": hf_worker,
    "head_parallel": head_parallel_section,
    "dp_cp": dp_cp_worker,
    "collator": collator_worker,
    "keywords": keywords_section,
    "switch": switch_section,
    "runtime": runtime_section,
}
