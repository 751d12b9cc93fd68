"""``hf.tile_mlp`` (DeepSpeed's TiledMLP) and ``hf.fused_lm_head`` (TRL's fused LM head) on an attached model.

On 2 gloo ranks (tile 1x2, DDP with ``static_graph=True``), a tiny Llama (GQA) with its MLPs in 5 slices of each
rank's 48 tokens (uneven), the fused LM head, both, both under gradient checkpointing, and both with every weight but
the MLPs' frozen: for two SGD steps the loss summed over the CP group and every parameter gradient equal those of the
attached model with neither (within 1e-5, fp32) and those of the single-process stock model. Without
``static_graph`` DDP refuses the tiled MLP; a mixture of experts, dropout in a training MLP, bad ``shards``, a PEFT
adapter on the LM head and a fused call without ``num_items_in_batch`` or ``shift_labels`` are refused by name. The
tiled MLP's recomputation in backward runs under the forward's autocast, and a deep copy of a tiled model stays tiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

import mesh_cp  # noqa: E402
from mesh_cp.testing import expect_error, spawn_gloo  # noqa: E402
from mesh_cp.testing.models import VOCAB, tiny_config  # noqa: E402

TOL = 1e-5
SEQ = 96
BATCH = 2
SHARDS = 5
CASES = {  # name: (tiled MLP, fused LM head, gradient checkpointing, only the MLPs train)
    "tiled": (True, False, False, False),
    "fused": (False, True, False, False),
    "tiled+fused": (True, True, False, False),
    "tiled+fused, checkpointing": (True, True, True, False),
    "tiled+fused, MLPs only": (True, True, False, True),
}


def _config():
    return tiny_config("LlamaConfig", num_key_value_heads=2)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _train(model, ddp, mesh, batches, fused: bool) -> list[tuple[float, list]]:
    """Two SGD steps of ``ddp`` on ``batches``: per step the loss summed over the CP group and every gradient."""
    import torch.distributed as dist

    from mesh_cp.integrations import hf

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for ids in batches:
        batch = hf.shard_batch(ids, mesh=mesh)
        given = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        if fused:
            loss = ddp(**given, shift_labels=batch.shift_labels, num_items_in_batch=batch.num_items_in_batch,
                       fused_lm_head=True).loss  # fmt: skip
        else:
            loss = hf.causal_lm_loss(ddp(**given).logits, batch.shift_labels, batch.num_items_in_batch)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append((total.item(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return steps


def _reference(ref, batches, mlps_only: bool) -> list[tuple[float, list]]:
    """The same two SGD steps of the single-process stock model (its own loss on unshifted labels)."""
    ref = copy.deepcopy(ref)
    _freeze_but_mlps(ref, mlps_only)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = []
    for ids in batches:
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        steps.append((loss.item(), [None if p.grad is None else p.grad.clone() for p in ref.parameters()]))
        opt.step()
        opt.zero_grad()
    return steps


def _freeze_but_mlps(model, mlps_only: bool) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(not mlps_only or ".mlp." in name)


def _errors(got: list, want: list) -> dict[str, float]:
    errors = {"loss": max(abs(g[0] - w[0]) for g, w in zip(got, want, strict=True))}
    grad_errors = []
    for (_, gs), (_, ws) in zip(got, want, strict=True):
        for g, w in zip(gs, ws, strict=True):
            if (g is None) != (w is None):
                return {**errors, "grads": float("inf")}
            grad_errors.append(0.0 if g is None else _max_err(g, w))
    return {**errors, "grads": max(grad_errors)}


def _paths(model, mesh, ids: torch.Tensor) -> tuple[str, bool]:
    """What the model runs: the backward node of its first MLP's output, and whether a fused call gives logits."""
    from mesh_cp.integrations import hf

    x = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
    node = type(model.model.layers[0].mlp(x).grad_fn).__name__
    if not getattr(model, "mesh_cp_fused_lm_head", False):
        return node, True
    batch = hf.shard_batch(ids, mesh=mesh)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, shift_labels=batch.shift_labels,
                    num_items_in_batch=batch.num_items_in_batch, fused_lm_head=True)  # fmt: skip
    return node, "logits" in out


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2)]
    results: dict = {}
    for name, (tiled, fused, checkpointing, mlps_only) in CASES.items():
        references = {}
        for variant in ("off", "on"):
            model = hf.attach(copy.deepcopy(ref), mesh)
            _freeze_but_mlps(model, mlps_only)
            if variant == "on":
                if tiled:
                    hf.tile_mlp(model, shards=SHARDS)
                if fused:
                    hf.fused_lm_head(model)
                if checkpointing:
                    model.gradient_checkpointing_enable()
            if variant == "on":
                results[f"{name}: paths taken"] = _paths(model, mesh, batches[0])
            ddp = hf.data_parallel(model, mesh=mesh, static_graph=True)
            references[variant] = _train(model, ddp, mesh, batches, fused and variant == "on")
        stock = _reference(ref, batches, mlps_only)
        for metric, err in _errors(references["on"], references["off"]).items():
            results[f"{name}: {metric} against untiled"] = err
        for metric, err in _errors(references["on"], stock).items():
            results[f"{name}: {metric} against the stock model"] = err
    _refusals(results, ref, mesh, batches[0])
    return results


def _refusals(results: dict, ref, mesh, ids: torch.Tensor) -> None:
    """What is refused on a CP rank: the tiled MLP under DDP without a static graph, fused calls without the labels'
    normalisation."""
    from mesh_cp.integrations import hf

    batch = hf.shard_batch(ids, mesh=mesh)
    model = hf.tile_mlp(hf.attach(copy.deepcopy(ref), mesh), shards=SHARDS)
    ddp = hf.data_parallel(model, mesh=mesh)

    def dynamic_graph() -> None:
        logits = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch).backward()

    expect_error(results, "DDP without static_graph refused", RuntimeError, "marked as ready twice", dynamic_graph)
    fused = hf.fused_lm_head(hf.attach(copy.deepcopy(ref), mesh))
    given = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "fused_lm_head": True}
    expect_error(
        results,
        "fused without num_items_in_batch refused",
        ValueError,
        "without num_items_in_batch",
        lambda: fused(**given, shift_labels=batch.shift_labels),
    )
    expect_error(
        results,
        "fused without shift_labels refused",
        ValueError,
        "without shift_labels",
        lambda: fused(**given, labels=batch.shift_labels, num_items_in_batch=batch.num_items_in_batch),
    )


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return spawn_gloo(worker, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_mlp_and_fused_head_equal_untiled_and_stock(spawned, case: str) -> None:
    for rank, res in enumerate(spawned):
        for against in ("untiled", "the stock model"):
            for metric in ("loss", "grads"):
                key = f"{case}: {metric} against {against}"
                assert res[key] <= TOL, (rank, key, res[key])
        tiled, fused = CASES[case][:2]
        node, logits = res[f"{case}: paths taken"]
        assert (node == "TiledMLPBackward") is tiled, (case, node)
        assert logits is not fused, (case, "logits in the fused output" if fused else "no logits")


def test_refused_on_a_cp_rank(spawned) -> None:
    for res in spawned:
        for key in ("DDP without static_graph refused", "fused without num_items_in_batch refused"):
            assert res[key] is True, (key, res[key])
        assert res["fused without shift_labels refused"] is True, res["fused without shift_labels refused"]


def test_refused_by_name() -> None:
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    for shards in (0, 2.0, True):
        with pytest.raises(ValueError, match="shards must be an int >= 1"):
            hf.tile_mlp(model, shards=shards)
    moe = AutoModelForCausalLM.from_config(tiny_config("MixtralConfig", num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(NotImplementedError, match="is a mixture of experts"):
        hf.tile_mlp(moe, shards=2)
    dropped = hf.tile_mlp(copy.deepcopy(model), shards=2)
    dropped.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(NotImplementedError, match="has dropout"):
        dropped(input_ids=ids)
    dropped.eval()
    assert dropped(input_ids=ids).logits.shape == (1, 8, VOCAB)  # no dropout drawn in eval
    untiled = hf.tile_mlp(hf.tile_mlp(copy.deepcopy(model), shards=3), shards=1)
    assert all("forward" not in mlp.__dict__ for _, mlp in hf.tiled.decoder_mlps(untiled))
    patched = copy.deepcopy(model)
    patched.model.layers[1].mlp.forward = lambda x: x
    with pytest.raises(NotImplementedError, match="model.layers.1.mlp .* already has a forward of its own"):
        hf.tile_mlp(patched, shards=2)
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(NotImplementedError, match="is a PEFT adapter"):
        hf.fused_lm_head(adapted.get_base_model())


def test_recompute_keeps_autocast_and_copies_stay_tiled() -> None:
    """TiledMLP recomputes in backward, where autocast is off: the slices are recomputed under the forward's autocast
    all the same (bf16 products), and a deep copy of a tiled model tiles its own MLPs."""
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    model = hf.tile_mlp(AutoModelForCausalLM.from_config(_config()), shards=3)
    dtypes: list[torch.dtype] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert dtypes == [torch.bfloat16] * 6, dtypes  # 3 slices in forward, 3 recomputed in backward
    copied = copy.deepcopy(model)
    mlp = copied.model.layers[0].mlp
    assert mlp.forward.__self__ is mlp and getattr(mlp, hf.tiled.TILES_ATTRIBUTE) == 3
