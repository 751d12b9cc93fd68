"""transformers models with attn_implementation="mesh_cp" against the single-process SDPA model.

Tiny random-weight Llama (MHA and GQA), Qwen2 and Mistral: at P = 4 (tiles 2x2 and 1x4) and P = 2,
logits, loss and every parameter gradient match the stock model to 1e-5 (fp32), and so do the
parameters after 3 SGD steps with momentum. Right padding is exact; left padding, model-level padding masks and
sliding windows are refused with their reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import mesh_cp  # noqa: E402
from mesh_cp.core import factorizations  # noqa: E402
from tests.distributed.harness import expect_error, run_distributed  # noqa: E402

TOL = 1e-5
SEQ = 48
BATCH = 2
VOCAB = 96


def configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    return {
        "llama": LlamaConfig(**common, num_key_value_heads=4),
        "llama-gqa": LlamaConfig(**common, num_key_value_heads=2),
        "qwen2": Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=False),
        "mistral": MistralConfig(**common, num_key_value_heads=2, sliding_window=None),
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def compare(model_name: str, config, mesh, attention_mask=None) -> dict[str, float]:
    """Max errors of the mesh model against the stock SDPA model: logits, loss, grads, params after 3 steps."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = hf.attach(copy.deepcopy(ref), mesh)
    gen = torch.Generator().manual_seed(1)
    errors: dict[str, float] = {}
    # SGD with momentum: Adam would turn roundoff-sized gradients of parameters whose exact gradient is
    # zero (the k bias of Qwen2: a constant added to a whole row of scores) into full-size steps.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        out = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()

        batch = hf.shard_batch(input_ids, mesh=mesh, attention_mask=attention_mask)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
        loss.backward()
        hf.reduce_gradients(model, mesh)
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group)
        if step == 0:
            shard_ref = mesh_cp.shard_sequence(out.logits.detach(), mesh=mesh, dim=1, layout="zigzag")
            if attention_mask is not None:  # padded positions have no label: compare real tokens only
                real = mesh_cp.shard_sequence(attention_mask, mesh=mesh, dim=1, layout="zigzag").bool()
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


def hf_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mesh_cp.integrations import hf

    results: dict = {}
    tiles = [(2, 2), (1, 4)] if world == 4 else factorizations(world)
    for tile in tiles:
        mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=tile)
        for name, config in configs().items():
            for key, err in compare(name, config, mesh).items():
                results[f"{tile[0]}x{tile[1]} {key}"] = err
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2) if world == 4 else (1, world))
    if world == 4:
        right = torch.ones(BATCH, SEQ, dtype=torch.long)
        right[0, SEQ - 11 :] = 0
        right[1, SEQ - 3 :] = 0
        for key, err in compare("llama-gqa right-padded", configs()["llama-gqa"], mesh, attention_mask=right).items():
            results[key] = err
        checks = _refusals(mesh, hf)
        results |= checks
    return results


def _refusals(mesh, hf) -> dict:
    """Unsupported inputs raise with their reason (never silently dropped)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    checks = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    left = torch.ones(BATCH, SEQ, dtype=torch.long)
    left[0, :5] = 0

    expect_error(
        checks,
        "left padding refused",
        ValueError,
        "right padding only",
        lambda: hf.shard_batch(ids, mesh=mesh, attention_mask=left),
    )
    model = hf.attach(AutoModelForCausalLM.from_config(configs()["llama"]), mesh)
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
    windowed = MistralConfig(**{**configs()["mistral"].to_dict(), "sliding_window": 16})
    windowed_model = hf.attach(AutoModelForCausalLM.from_config(windowed), mesh)
    expect_error(
        checks,
        "sliding window refused",
        NotImplementedError,
        "sliding_window=16 is not supported",
        lambda: windowed_model(input_ids=batch.input_ids, position_ids=batch.position_ids),
    )
    bare = AutoModelForCausalLM.from_config(configs()["llama"])
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


@pytest.mark.parametrize("world", [4, 2])
def test_hf_models_match_single_process_sdpa(world: int) -> None:
    for rank, res in enumerate(run_distributed(hf_worker, world)):
        assert res, f"rank {rank} ran nothing"
        refusals = {k: v for k, v in res.items() if isinstance(v, (bool, str))}
        assert all(v is True for v in refusals.values()), f"rank {rank}: {refusals}"
        errors = {k: v for k, v in res.items() if not isinstance(v, (bool, str))}
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"
        tiles = ["2x2", "1x4"] if world == 4 else [f"{a}x{b}" for a, b in factorizations(world)]
        metrics = ("logits", "loss", "grads", "params after 3 steps")
        expected = {f"{t} {m} {metric}" for t in tiles for m in configs() for metric in metrics}
        if world == 4:
            expected |= {f"llama-gqa right-padded {metric}" for metric in metrics}
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
        ref = AutoModelForCausalLM.from_config(configs()["llama-gqa"], attn_implementation="sdpa")
        model = hf.attach(copy.deepcopy(ref), layout.mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(layout.dp_size)]
            ref_loss = sum(ref(input_ids=b, labels=b).loss for b in batches) / len(batches)
            ref_loss.backward()
            batch = hf.shard_batch(batches[layout.dp_rank], mesh=layout.mesh)
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch).backward()
            layout.reduce_gradients(model)
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


def test_dp_by_cp_averages_over_dp_and_sums_over_cp() -> None:
    per_rank = run_distributed(dp_cp_worker, 4)
    for rank, res in enumerate(per_rank):
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
    ref = AutoModelForCausalLM.from_config(configs()["llama"], attn_implementation="sdpa")
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


def test_collator_pads_shards_and_gives_the_models_own_loss() -> None:
    for rank, res in enumerate(run_distributed(collator_worker, 4)):
        assert res["shape"] == (3, 10), res  # 37 tokens padded to 40 (a multiple of 2P = 8), 10 per rank
        assert res["items"] == res["meta items"] == 36 + 20 + 29, res
        assert res["devices"] == ["meta"] and res["meta shapes"] is True, res
        assert res["loss error"] <= TOL, (rank, res)
