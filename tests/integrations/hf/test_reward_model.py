"""Sequence classifiers (reward models) called with full rows under CP (``shard_classification_calls``), against
the stock single-process model, on one spawned group of 4 gloo ranks laid out as CP 4 (tile 2x2) and as DP 2 x CP 2.

Tiny Llama (one label) and Qwen3 (two labels) ``...ForSequenceClassification`` models, rows of odd lengths padded
on the right, on the left, and with ``pad_token_id == eos_token_id`` (rows ending in end-of-sequence tokens, one
inside a row): the pooled logits equal the stock SDPA model's within 1e-5 on every rank, and every parameter
gradient summed over the CP group (``grad_scale=1``) equals the stock model's. Each DP replica scores its own rows.
Refused by message: labels, inputs_embeds, position_ids, a cache, hidden states, positional arguments, a pooled token
that is padding, a batch without a pad token, rows that differ between the ranks of a CP group, a model that is no
``GenericForSequenceClassification``, sharding twice, and a plain ``attach`` of a sequence classifier.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mesh_cp.testing import expect_error, spawn_gloo

TOL = 1e-5
LENGTHS = (7, 13, 5, 10)
"""Real tokens of each row (odd lengths: the mesh pads the rows)."""
PAD, EOS = 0, 2


def rows(lengths: tuple[int, ...], *, side: str, seed: int, pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of rows of random tokens (ids >= 3) padded on ``side`` with ``pad``; with
    ``pad == EOS`` every row ends in an end-of-sequence token (a real one) and the first row holds one more inside."""
    from mesh_cp.testing.models import VOCAB

    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        tokens = torch.randint(3, VOCAB, (n,), generator=gen)
        if pad == EOS:
            tokens[-1] = EOS
            if row == 0:
                tokens[n // 2] = EOS
        span = slice(0, n) if side == "right" else slice(width - n, width)
        ids[row, span], mask[row, span] = tokens, 1
    return ids, mask


def models() -> dict:
    """The tiny classifiers, by name."""
    from mesh_cp.testing.models import tiny_config

    return {
        "llama": tiny_config("LlamaConfig", num_key_value_heads=2, num_labels=1, pad_token_id=PAD),
        "qwen3": tiny_config(
            "Qwen3Config", num_key_value_heads=2, head_dim=8, num_labels=2, pad_token_id=PAD, use_sliding_window=False
        ),
    }


def compare(reference, model, ids, mask, mesh) -> dict:
    """Pooled logits and parameter gradients (summed over the CP group) of ``model`` (sharded calls) against
    ``reference`` (one process) on the full rows: the largest differences."""
    import torch.distributed as dist

    weights = torch.linspace(-1.0, 2.0, ids.shape[0] * reference.config.num_labels).view(ids.shape[0], -1)
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
    want = reference(input_ids=ids, attention_mask=mask).logits
    (want * weights).sum().backward()
    got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    (got * weights).sum().backward()
    grads = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        summed = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(summed, group=mesh.group)
        assert q.grad is not None, name
        grads = max(grads, (summed - q.grad).abs().max().item())
    return {"logits": (got - want).abs().max().item(), "shape": tuple(got.shape) == tuple(want.shape), "grads": grads}


def layout_cases(parallel) -> dict:
    """Every model and padding on ``parallel``'s mesh; replica ``d`` scores rows of seed ``d``."""
    from transformers import AutoModelForSequenceClassification

    from mesh_cp.integrations.hf.reward import shard_classification_calls

    mesh, results = parallel.mesh, {}
    for name, config in models().items():
        for padding in ("right", "left", "pad is eos"):
            torch.manual_seed(0)
            config = copy.deepcopy(config)
            config.pad_token_id = EOS if padding == "pad is eos" else PAD
            reference = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
            model = copy.deepcopy(reference)
            shard_classification_calls(model, mesh)
            side = "left" if padding == "left" else "right"
            ids, mask = rows(LENGTHS, side=side, seed=parallel.dp_rank, pad=config.pad_token_id)
            results[f"{name} {padding}"] = compare(reference, model, ids, mask, mesh)
    return results


def refusals(mesh) -> dict:
    """The refusals of sharded classification calls, on ``mesh``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.reward import shard_classification_calls
    from mesh_cp.testing.models import tiny_config

    out: dict = {}
    config = models()["llama"]
    model = AutoModelForSequenceClassification.from_config(config)
    expect_error(out, "plain attach", NotImplementedError, r"reads across the sequence.*shard_classification_calls",
                 lambda: hf.attach(copy.deepcopy(model), mesh))  # fmt: skip
    shard_classification_calls(model, mesh)
    ids, mask = rows(LENGTHS, side="right", seed=0)
    given = {"input_ids": ids, "attention_mask": mask}
    calls = {
        "labels": ({"labels": torch.zeros(4, dtype=torch.long)}, NotImplementedError, r"labels: call the model without"),
        "inputs_embeds": ({"inputs_embeds": torch.zeros(4, 13, 32)}, NotImplementedError, r"inputs_embeds: pass input_"),
        "position_ids": ({"position_ids": torch.arange(13)[None]}, NotImplementedError, r"position_ids: leave them"),
        "cache": ({"use_cache": True}, NotImplementedError, r"use_cache=True: pass use_cache=False"),
        "hidden states": ({"output_hidden_states": True}, NotImplementedError, r"output_hidden_states=True: the hidden"),
        "other keyword": ({"token_type_ids": ids}, NotImplementedError, r"token_type_ids: mesh_cp does not split it"),
    }  # fmt: skip
    for key, (extra, exc, pattern) in calls.items():
        expect_error(out, key, exc, pattern, lambda extra=extra: model(**given, **extra))
    expect_error(out, "positional", ValueError, r"keywords only .* got 1 positional", lambda: model(ids))
    unreal = mask.clone()
    unreal[1, 12] = 0  # the pooled token of row 1 (13 tokens) is marked padding
    expect_error(out, "pooled padding", ValueError, r"in some row that token is padding \(attention_mask 0\)",
                 lambda: model(input_ids=ids, attention_mask=unreal))  # fmt: skip
    differ = ids.clone()
    differ[0, 0] += mesh.rank
    expect_error(out, "different rows", RuntimeError, r"ranks of the CP group were given different rows",
                 lambda: model(input_ids=differ, attention_mask=mask))  # fmt: skip
    expect_error(out, "twice", ValueError, r"sharded already", lambda: shard_classification_calls(model, mesh))
    nopad = copy.deepcopy(config)
    nopad.pad_token_id = None
    unpadded = AutoModelForSequenceClassification.from_config(nopad)
    shard_classification_calls(unpadded, mesh)
    expect_error(out, "no pad token", ValueError, r"Cannot handle batch sizes > 1 if no padding token",
                 lambda: unpadded(input_ids=ids))  # fmt: skip
    one = unpadded(input_ids=ids[:1]).logits  # one row without a pad token: pooled at the last position
    reference = copy.deepcopy(AutoModelForSequenceClassification.from_config(nopad, attn_implementation="sdpa"))
    reference.load_state_dict(unpadded.state_dict())
    out["one row without pad token"] = (one - reference(input_ids=ids[:1]).logits).abs().max().item()
    lm = AutoModelForCausalLM.from_config(tiny_config("LlamaConfig"))
    expect_error(out, "not a classifier", NotImplementedError, r"LlamaForCausalLM is not a transformers Generic",
                 lambda: shard_classification_calls(lm, mesh))  # fmt: skip
    return out


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mesh_cp.runtime.parallel import DataContextParallel

    results: dict = {}
    for label, cp_size, tile in (("cp4", 4, (2, 2)), ("dp2xcp2", 2, (1, 2))):
        parallel = DataContextParallel.create(dist.group.WORLD, cp_size=cp_size, tile=tile)
        results[label] = layout_cases(parallel)
        if label == "cp4":
            results["refusals"] = refusals(parallel.mesh)
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn_gloo(worker, 4)


@pytest.mark.parametrize("layout", ["cp4", "dp2xcp2"])
def test_pooled_logits_and_gradients(per_rank, layout):
    for rank, res in enumerate(per_rank):
        cases = res[layout]
        assert len(cases) == 6
        for case, got in cases.items():
            assert got["shape"], (rank, case)
            assert got["logits"] < TOL, (rank, case, got)
            assert got["grads"] < TOL, (rank, case, got)


def test_refusals(per_rank):
    for rank, res in enumerate(per_rank):
        out = res["refusals"]
        assert out.pop("one row without pad token") < TOL, rank
        assert {k: v for k, v in out.items() if v is not True} == {}, rank
