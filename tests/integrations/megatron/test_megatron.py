"""Megatron-core GPT with Mesh-Attention core attention under TP x CP(a x b) x DP, against TP1 x CP1.

One process trains the reference (TP1 x CP1, the mesh spec on one rank, whose attention is checked
against plain causal SDPA); one group of 8 gloo ranks trains TP2 x CP2(1x2) x DP2, TP1 x CP4(2x2) x DP2,
TP2 x CP4(2x2) x DP1 and the head-parallel x mesh hybrid TP2 x CP4(head_parallel 2 x 2x1) x DP1 (Megatron's
``cp_comm_type="a2a+p2p"``, on Megatron's own zig-zag layout) on the same global batches, with learned absolute and RoPE position
embeddings. After each of 3 SGD steps the global loss and gradient norm, and after the last every
rank's parameter shards, equal the reference within 1e-5 (fp32). The same group checks the layout
printout, node placement of Q-groups, the CP group taken from ``pg_collection``, and every refusal.
The pretraining script runs under torchrun, saves Megatron distributed checkpoints and resumes from them in two
other layouts with the losses of not stopping in those layouts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from mesh_cp.testing import expect_error, spawn_gloo  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-5
VOCAB = 128
SEQ = 32
GLOBAL_BATCH = 4
STEPS = 3
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "rope, packed rows, window on layer 1", "rope, thd rows")
DOCUMENTS = (1, 7, 3, 12, 6)
"""Document lengths of every packed row (29 of 32 tokens; the rest is padding)."""
THD_DOCUMENTS = (6, 13, 5)
"""Document lengths of every THD row, each padded to a multiple of 2 * CP = 8: 8, 16 and 8, the row's 32 tokens."""
LAYOUTS = ((2, 2, (1, 2), 1), (1, 4, (2, 2), 1), (2, 4, (2, 2), 1), (2, 4, (2, 1), 2))
"""(TP, CP, tile, head_parallel) on 8 ranks; DP = 8 / (TP * CP). head_parallel 2: the head-parallel x mesh hybrid
through Megatron's
cp_comm_type "a2a+p2p" with hierarchical_context_parallel_sizes [2, 2] (1 K/V head per TP rank, repeated)."""


def _config(tp: int, cp: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
    )
    return TransformerConfig(**(options | overrides))


def _global_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def train(position_embedding: str, tp: int, cp: int, tile, head_parallel: int = 1) -> dict:
    """3 SGD steps of a tiny GPT under the current parallel_state; global losses, grad norms, parameters. With
    ``head_parallel > 1`` the layers get Megatron's ``cp_comm_type="a2a+p2p"`` and the layout's mesh that hybrid."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from examples.megatron import cpu_workarounds
    from mesh_cp.integrations import megatron as mcp
    from mesh_cp.integrations.megatron import training

    layout = mcp.MeshLayout.from_parallel_state(tile=tile, head_parallel=head_parallel)
    packed, thd = "packed" in position_embedding, "thd" in position_embedding
    overrides = {"window_size": (4, 0), "window_attn_skip_freq": 2} if packed else {}  # layer 1 sees 5 keys
    if head_parallel > 1:
        sizes = [head_parallel, cp // head_parallel]
        overrides |= {"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": sizes}
    torch.manual_seed(0)  # the full weights, split over TP by use_cpu_initialization
    model = GPTModel(
        config=_config(tp, cp, **overrides),
        transformer_layer_spec=layout.layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope" if packed or thd else position_embedding,
    )
    cpu_workarounds.use_cpu_rotary_embedding(model)
    # SGD with momentum: Adam would turn roundoff-sized gradients into full-size steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_replica = GLOBAL_BATCH // dp
    losses, norms = [], []
    for tokens in _global_batches():
        rows = tokens[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        total = torch.zeros((), dtype=torch.float64)
        cp_group = ps.get_context_parallel_group()
        batches = _thd_micro_batches(rows, cp_group) if thd else _micro_batches(rows, packed, training, cp_group)
        for batch, params in batches:
            per_token = model(
                batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params
            )
            count = training.global_token_count(batch["loss_mask"] * (len(rows) if packed or thd else 1))  # per row
            loss = training.loss_share(per_token, batch["loss_mask"], count)
            loss.backward()
            total += loss.detach().double()
        cpu_workarounds.reduce_gradients_cpu(model)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        losses.append(total.item())
        norms.append(float(cpu_workarounds.grad_norm_cpu(model)))
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"layout": str(layout), "losses": losses, "norms": norms, "params": params, "model": model}


def _micro_batches(rows: torch.Tensor, packed: bool, training, cp_group):
    """The replica's rows as one batch, or (packed) one packed row at a time with its ``packed_seq_params``
    (``sbhd``: the row is sharded zig-zag as one sequence; the documents' boundaries over the whole row)."""
    if not packed:
        yield training.shard_batch(rows, cp_group=cp_group), None
        return
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    loss_mask = torch.zeros(1, SEQ)
    for start, stop in zip(bounds.tolist(), bounds[1:].tolist(), strict=False):
        loss_mask[0, start : stop - 1] = 1  # no label across a document boundary, none in the padding
    params = PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=SEQ, max_seqlen_kv=SEQ
    )
    for row in rows:
        yield training.shard_batch(row[None], cp_group=cp_group, loss_mask=loss_mask), params


def _thd_micro_batches(rows: torch.Tensor, cp_group):
    """One THD row at a time, sharded by Megatron's THD partition (``compat.thd_batch_on_this_cp_rank``: every
    supported megatron-core; TransformerEngine's partition on CPU: ``cpu_thd_partition``): each document padded to a
    multiple of 8, positions restarting in each."""
    from examples.megatron import cpu_workarounds
    from mesh_cp.integrations.megatron import compat

    padded = [-(-n // 8) * 8 for n in THD_DOCUMENTS]
    starts = torch.tensor([0, *padded]).cumsum(0)
    cu_padded = starts.to(torch.int32)
    cu = torch.tensor([0, *THD_DOCUMENTS]).cumsum(0).to(torch.int32)
    loss_mask, positions = torch.zeros(1, SEQ), torch.zeros(1, SEQ, dtype=torch.long)
    for start, n, width in zip(starts.tolist(), THD_DOCUMENTS, padded, strict=False):
        loss_mask[0, start : start + n - 1] = 1  # no label across a document's end, none in its padding
        positions[0, start : start + width] = torch.arange(width)
    for row in rows:
        batch = {"tokens": row[None, :SEQ], "labels": row[None, 1 : SEQ + 1], "loss_mask": loss_mask.clone(),
                 "position_ids": positions.clone()}  # fmt: skip
        with cpu_workarounds.cpu_thd_partition():
            yield compat.thd_batch_on_this_cp_rank(
                batch, cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=max(padded), cp_group=cp_group
            )


def _thd_attention_vs_sdpa() -> float:
    """MeshCoreAttention on one rank with a THD row (padded documents, queries in THD order) against causal SDPA
    over each document's real tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from mesh_cp.integrations import megatron as mcp

    attn = mcp.MeshCoreAttention(
        config=_config(1, 1), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        mesh_provider=mcp.MeshProvider(tile=(1, 1)),
    )  # fmt: skip
    padded = [-(-n // 8) * 8 for n in THD_DOCUMENTS]
    cu_padded = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
    cu = torch.tensor([0, *THD_DOCUMENTS]).cumsum(0).to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(SEQ, 4, 16, generator=gen)
    k, v = torch.randn(2, SEQ, 2, 16, generator=gen)
    out = attn(q, k, v, None, packed_seq_params=params).reshape(SEQ, 4, 16)
    err = 0.0
    for start, n in zip(cu_padded.tolist(), THD_DOCUMENTS, strict=False):
        rows = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[rows].transpose(0, 1).double() for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))),
            is_causal=True,
        )
        err = max(err, (out[rows].double() - ref.transpose(0, 1)).abs().max().item())
    return err


def _packed_attention_vs_sdpa() -> float:
    """MeshCoreAttention on one rank with packed rows and a window of 5 against SDPA over each document."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from mesh_cp.integrations import megatron as mcp

    attn = mcp.MeshCoreAttention(
        config=_config(1, 1, window_size=(4, 0)),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        mesh_provider=mcp.MeshProvider(tile=(1, 1)),
    )
    bounds = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(SEQ, 1, 4, 16, generator=gen)
    k, v = torch.randn(2, SEQ, 1, 2, 16, generator=gen)
    out = attn(q, k, v, None, packed_seq_params=params).reshape(SEQ, 4, 16)
    err = 0.0
    for start, stop in zip(bounds.tolist(), bounds[1:].tolist(), strict=False):
        pos = torch.arange(stop - start)
        seen = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 5)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(
                t[start:stop, 0].transpose(0, 1).double()
                for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))
            ),
            attn_mask=seen,
        )
        err = max(err, (out[start:stop].double() - ref.transpose(0, 1)).abs().max().item())
    return max(err, out[bounds[-1] :].abs().max().item())  # padding attends nothing


def reference_worker(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    results = {"attention vs sdpa": _attention_vs_sdpa(), "mask checks": _mask_checks()}
    results["packed attention vs sdpa"] = _packed_attention_vs_sdpa()
    results["thd attention vs sdpa"] = _thd_attention_vs_sdpa()
    for pos in POSITION_EMBEDDINGS:
        run = train(pos, 1, 1, (1, 1))
        run.pop("model")
        results[pos] = run
    ps.destroy_model_parallel()
    return results


def _attention_vs_sdpa() -> float:
    """MeshCoreAttention on one rank (the reference's attention) against causal SDPA, GQA 4:2."""
    from megatron.core.transformer.enums import AttnMaskType

    from mesh_cp.integrations import megatron as mcp

    attn = mcp.MeshCoreAttention(
        config=_config(1, 1),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        mesh_provider=mcp.MeshProvider(tile=(1, 1)),
    )
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(SEQ, 2, 4, 16, generator=gen)
    k, v = torch.randn(2, SEQ, 2, 2, 16, generator=gen)
    out = attn(q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3).double() for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
        is_causal=True,
    )
    return (out.double() - ref.permute(2, 0, 1, 3).reshape(SEQ, 2, -1)).abs().max().item()


def _mask_checks() -> dict:
    """Two layers sharing a spec's provider, 3 steps each with a new (correct) causal mask, on a device that is
    not the default (see test_device_discipline): the mask is read on the host once, then compared on the
    device once per step (not per layer); a wrong mask is still refused, on the host or on the device."""
    from megatron.core.transformer.enums import AttnMaskType

    from mesh_cp.integrations import megatron as mcp
    from tests.integrations.test_device_discipline import DEVICE, DeviceDiscipline, _patched

    provider = mcp.MeshProvider(tile=(1, 1))
    layers = [
        mcp.MeshCoreAttention(
            config=_config(1, 1), layer_number=n, attn_mask_type=AttnMaskType.causal, attention_type="self",
            mesh_provider=provider,
        )
        for n in (1, 2)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(SEQ, 1, 4, 16, generator=gen).to(DEVICE), torch.randn(SEQ, 1, 2, 16, generator=gen).to(DEVICE)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)  # True = masked
    device_checks = []
    real_assert = torch._assert_async
    with _patched(torch, "_assert_async", lambda *a: (device_checks.append(a[1]), real_assert(*a))):
        with DeviceDiscipline() as tracker:
            tracker.armed = True
            for _ in range(3):
                mask = causal.clone().to(DEVICE)  # a new tensor every step, as from a data loader
                outs = [layer(q, k, k, mask) for layer in layers]
        out: dict = {
            "host reads": tracker.reads,
            "violations": tracker.violations,
            "device checks": len(device_checks),
            "same as no mask": max((o - layers[0](q, k, k, None)).abs().max().item() for o in outs),
        }
        expect_error(out, "wrong mask later", NotImplementedError, r"not the causal mask",
                     lambda: layers[1](q, k, k, ~causal))  # fmt: skip
        expect_error(out, "wrong mask of a new kind", NotImplementedError, r"not the causal mask",
                     lambda: layers[0](q, k, k, causal.float().flip(-1)))  # fmt: skip
    return out


def _shard_of(param: torch.nn.Parameter, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def mesh_worker(rank: int, world: int, reference: dict) -> dict:
    from megatron.core import parallel_state as ps

    results: dict = {}
    for tp, cp, tile, u in LAYOUTS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        tp_rank = ps.get_tensor_model_parallel_rank()
        mesh = f"head_parallel {u} x " if u > 1 else ""
        name = f"TP{tp} x CP{cp}({mesh}{tile[0]}x{tile[1]}) x DP{world // (tp * cp)}"
        for pos in POSITION_EMBEDDINGS:
            run, ref = train(pos, tp, cp, tile, u), reference[pos]
            model = run["model"]
            results[(name, pos)] = {
                "layout": run["layout"],
                "losses": run["losses"],
                "norms": run["norms"],
                "loss err": max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)),
                "norm err": max(abs(a - b) for a, b in zip(run["norms"], ref["norms"], strict=True)),
                "param err": max(
                    (p.detach() - _shard_of(p, ref["params"][n], tp, tp_rank)).abs().max().item()
                    for n, p in model.named_parameters()
                ),
            }
        if (tp, cp, u) == (2, 4, 1):
            results |= _checks(rank, world)
        ps.destroy_model_parallel()
    return results


def _checks(rank: int, world: int) -> dict:
    """Layout printout, node placement, pg_collection, and every refusal (under TP2 x CP4)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from examples.megatron import cpu_workarounds
    from mesh_cp.integrations import megatron as mcp
    from mesh_cp.integrations.megatron import training

    out: dict = {}
    layout = mcp.MeshLayout.from_parallel_state(ranks_per_node=4)
    out["layout str"] = str(layout)
    cp_ranks = layout.mesh.global_ranks
    out["q-group nodes"] = [cp_ranks[r] // 4 for r in layout.tiling.q_group(layout.mesh.rank)]
    # 2 GPUs per node hold 1 CP rank each: the square tile would cross nodes, the node-local one is 1x4.
    out["tile at 2 per node"] = mcp.build_mesh(ps.get_context_parallel_group(), ranks_per_node=2).tile

    def attention(config=None, mask_type=AttnMaskType.causal, provider=None, **kw):
        return mcp.MeshCoreAttention(
            config=config or _config(2, 4),
            layer_number=1,
            attn_mask_type=mask_type,
            attention_type="self",
            mesh_provider=provider or mcp.MeshProvider(mesh=layout.mesh),
            **kw,
        )

    # pg_collection.cp is used when given: here the whole world as one CP group of 8.
    world_pg = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=dist.group.WORLD)
    on_world = attention(_config(2, 8), provider=mcp.MeshProvider(tile=(2, 4)), pg_collection=world_pg)
    out["pg_collection cp ranks"] = list(on_world.mesh.global_ranks)

    # Megatron-LM: --spec mesh_cp.integrations.megatron gpt_layer_mesh_spec, looked up the way it does.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    spec = import_module(("mesh_cp.integrations.megatron", "gpt_layer_mesh_spec"))
    lm = GPTModel(config=_config(2, 4), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    cpu_workarounds.use_cpu_rotary_embedding(lm)
    cores = [m for m in lm.modules() if isinstance(m, mcp.MeshCoreAttention)]
    out["--spec meshes"] = [c.mesh.tile for c in cores] + [len({id(c.mesh) for c in cores})]
    sharded = training.shard_batch(torch.arange(SEQ + 1).unsqueeze(0) % VOCAB, cp_group=ps.get_context_parallel_group())
    out["--spec loss finite"] = bool(
        lm(sharded["tokens"], sharded["position_ids"], None, labels=sharded["labels"]).isfinite().all()
    )

    attn = attention()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(SEQ // 4, 1, 2, 16, generator=gen)
    k = torch.randn(SEQ // 4, 1, 1, 16, generator=gen)
    positions = torch.arange(SEQ)
    causal = training.shard_batch(torch.zeros(1, SEQ + 1, dtype=torch.long), cp_group=ps.get_context_parallel_group())
    rows = causal["position_ids"][0]
    causal_mask = (rows[:, None] < positions[None, :]).view(1, 1, SEQ // 4, SEQ)
    out["causal mask accepted"] = (attn(q, k, k, causal_mask) - attn(q, k, k, None)).abs().max().item()

    expect_error(
        out,
        "dropout",
        NotImplementedError,
        r"attention dropout 0\.1.*attention_dropout=0",
        lambda: attention(_config(2, 4, attention_dropout=0.1)),
    )
    expect_error(
        out,
        "window without causal",
        NotImplementedError,
        r"window_size \(8, 0\) with attn_mask_type no_mask: mesh_cp computes left windows under causal attention only",
        lambda: attention(_config(2, 4, window_size=(8, 0)), mask_type=AttnMaskType.no_mask),
    )
    expect_error(
        out,
        "padding mask type",
        NotImplementedError,
        r"attn_mask_type padding",
        lambda: attention(mask_type=AttnMaskType.padding),
    )
    _comm_type_checks(out, attention, layout)
    expect_error(out, "cp size", ValueError, r"context_parallel_size 2 differs .* 4", lambda: attention(_config(2, 2)))
    expect_error(
        out,
        "other mesh",
        ValueError,
        r"this layer's CP group",
        lambda: attention(provider=mcp.MeshProvider(mesh=on_world.mesh)),
    )
    expect_error(
        out, "bad tile", ValueError, r"3", lambda: mcp.build_mesh(ps.get_context_parallel_group(), tile=(3, 1))
    )
    expect_error(
        out,
        "packed thd",
        NotImplementedError,
        r"qkv_format='thd' needs cu_seqlens_q",
        lambda: attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
    )
    real, padded = torch.tensor([0, 9, 16], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    expect_error(
        out,
        "thd real past padded",
        ValueError,
        r"cu_seqlens_q \[0, 9, 16\] does not fit cu_seqlens_q_padded \[0, 8, 16\]",
        lambda: attn(q, k, k, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded)),
    )  # fmt: skip
    expect_error(
        out,
        "thd max_seqlen",
        ValueError,
        r"max_seqlen_q/kv \(3, 3\) with qkv_format='thd' must be at least the longest document, 8 tokens",
        lambda: attn(q, k, k, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=padded, cu_seqlens_kv=padded, max_seqlen_q=3, max_seqlen_kv=3)),
    )  # fmt: skip
    expect_error(
        out,
        "hybrid cp",
        NotImplementedError,
        r"local_cp_size=2, cp_group ranks None: mesh_cp shards every sample over its mesh of 4 ranks",
        lambda: attn(q, k, k, None, packed_seq_params=PackedSeqParams(
            qkv_format="sbhd", cu_seqlens_q=padded, cu_seqlens_kv=padded, local_cp_size=2)),
    )  # fmt: skip
    unpadded = torch.tensor([0, 6, 32], dtype=torch.int32)
    expect_error(
        out,
        "thd unpadded",
        ValueError,
        r"documents padded to a multiple of 2\*CP = 8 \(got lengths \[6, 26\]\)",
        lambda: attn(
            q,
            k,
            k,
            None,
            packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded),
        ),
    )
    expect_error(
        out,
        "bias",
        NotImplementedError,
        r"attention_bias of shape",
        lambda: attn(q, k, k, None, attention_bias=torch.zeros(1)),
    )
    expect_error(
        out, "arbitrary mask", NotImplementedError, r"not the causal mask", lambda: attn(q, k, k, ~causal_mask)
    )
    expect_error(
        out,
        "mask shape",
        NotImplementedError,
        r"attention_mask of shape \(1, 1, 32, 32\)",
        lambda: attn(q, k, k, torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)),
    )
    expect_error(
        out,
        "seq len",
        ValueError,
        r"sequence length \(tokens - 1\) 30 must be a positive multiple of 2\*CP = 8 \(CP 4\) for Megatron's zig-zag "
        r"layout, which cuts each sequence into 8 chunks; the nearest valid lengths are 24 or 32",
        lambda: training.shard_batch(torch.zeros(1, 31, dtype=torch.long), cp_group=ps.get_context_parallel_group()),
    )
    _parallel_state_checks(out, attention)
    return out


def _parallel_state_checks(out: dict, attention) -> None:
    """What Megatron's parallel_state sees against the mesh (TP2 x CP4): the example's --seq-len is checked before
    any group is made; a batch cut over another group than parallel_state's CP group is refused; a layer whose
    parallel_state was destroyed, or initialized again in another layout (TP1 x CP4), is refused at its first step.
    Leaves parallel_state initialized in that other layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from examples.megatron import pretrain_gpt
    from mesh_cp.integrations.megatron import training

    expect_error(out, "example --seq-len", ValueError,
                 r"--seq-len 1001 must be a positive multiple of 2\*CP = 8 \(CP 4\) .* nearest valid lengths are "
                 r"1000 or 1008",
                 lambda: pretrain_gpt.run(pretrain_gpt.parse_args(["--tp", "2", "--seq-len", "1001"]), torch.device("cpu")))  # fmt: skip
    expect_error(out, "batch over the world", ValueError,
                 r"cp_group holds global ranks \[0, 1, 2, 3, 4, 5, 6, 7\] but Megatron's parallel_state CP group of "
                 r"rank \d is \[\d, \d, \d, \d\]; pass cp_group=parallel_state.get_context_parallel_group\(\)",
                 lambda: training.shard_batch(torch.zeros(1, SEQ + 1, dtype=torch.long), cp_group=dist.group.WORLD))  # fmt: skip
    layer = attention()
    q, k = torch.zeros(SEQ // 4, 1, 2, 16), torch.zeros(SEQ // 4, 1, 1, 16)
    ps.destroy_model_parallel()
    expect_error(out, "parallel_state destroyed", ValueError,
                 r"Megatron's parallel_state is not initialized, but this layer's mesh was built over its CP group",
                 lambda: layer(q, k, k, None))  # fmt: skip
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=4)
    expect_error(out, "parallel_state in another layout", ValueError,
                 r"parallel_state CP group of rank \d is \[\d, \d, \d, \d\] \(world 8\), but this layer's mesh "
                 r"tiles \[\d, \d, \d, \d\]: parallel_state was initialized again",
                 lambda: layer(q, k, k, None))  # fmt: skip


def _comm_type_checks(out: dict, attention, layout) -> None:
    """Megatron's cp_comm_type under TP2 x CP4: "a2a+p2p" with hierarchical sizes [u, m] is the hybrid with
    head_parallel=u (and must agree with a given mesh), "a2a" is head_parallel=CP (refused here: 2 heads per TP rank
    do not split over 4); what has no exact mapping is refused by name with the fix."""
    import torch.distributed as dist

    from mesh_cp.integrations import megatron as mcp

    a2a_p2p = _config(2, 4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    hybrid = attention(a2a_p2p, provider=mcp.MeshProvider(tile=(1, 2)), cp_comm_type="a2a+p2p")
    mesh = hybrid.mesh
    out["a2a+p2p mesh"] = (mesh.head_parallel, mesh.tile, dist.get_process_group_ranks(mesh.head_group))
    expect_error(out, "a2a+p2p against a plain mesh", ValueError,
                 r"cp_comm_type 'a2a\+p2p' with hierarchical_context_parallel_sizes \[2, 2\] asks for head_parallel=2 "
                 r"but the mesh it was given has head_parallel=1; build it with head_parallel=2",
                 lambda: attention(a2a_p2p, cp_comm_type="a2a+p2p"))  # fmt: skip
    expect_error(out, "a2a+p2p against provider head_parallel", ValueError,
                 r"asks for head_parallel=2 but the layer spec's MeshProvider has head_parallel=4",
                 lambda: attention(a2a_p2p, provider=mcp.MeshProvider(head_parallel=4), cp_comm_type="a2a+p2p"))  # fmt: skip
    wrong_sizes = _config(2, 4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 4])
    expect_error(out, "a2a+p2p sizes", NotImplementedError, r"needs hierarchical_context_parallel_sizes \[a2a, p2p\] with "
                 r"a2a \* p2p = CP size 4, got \[2, 4\]",
                 lambda: attention(wrong_sizes, cp_comm_type="a2a+p2p"))  # fmt: skip
    expect_error(out, "a2a heads", ValueError, r"head_parallel=4 does not divide the 2 query heads",
                 lambda: attention(provider=mcp.MeshProvider(), cp_comm_type="a2a"))  # fmt: skip
    expect_error(out, "hierarchical sizes without a2a+p2p", NotImplementedError,
                 r"hierarchical_context_parallel_sizes \[2, 2\] is read by cp_comm_type 'a2a\+p2p' only",
                 lambda: attention(_config(2, 4, hierarchical_context_parallel_sizes=[2, 2])))  # fmt: skip
    expect_error(out, "cp_comm_type", NotImplementedError, r"cp_comm_type 'all_gather' selects TransformerEngine",
                 lambda: attention(cp_comm_type="all_gather"))  # fmt: skip
    expect_error(out, "head_parallel 3", ValueError,
                 r"head_parallel=3 does not divide the CP group size P=4; choose one of \[1, 2, 4\]",
                 lambda: mcp.build_mesh(layout.mesh.group, head_parallel=3))  # fmt: skip


@pytest.fixture(scope="module")
def reference() -> dict:
    return spawn_gloo(reference_worker, 1)[0]


@pytest.fixture(scope="module")
def mesh_results(reference) -> list[dict]:
    ref = {pos: {k: reference[pos][k] for k in ("losses", "norms", "params")} for pos in POSITION_EMBEDDINGS}
    return spawn_gloo(mesh_worker, 8, ref)


def test_reference_attention_is_sdpa(reference) -> None:
    assert reference["attention vs sdpa"] <= TOL
    assert reference["packed attention vs sdpa"] <= TOL
    assert reference["thd attention vs sdpa"] <= TOL
    assert reference["rope"]["losses"][-1] < reference["rope"]["losses"][0]


def test_mask_is_checked_without_a_host_sync_per_layer_or_step(reference) -> None:
    checks = reference["mask checks"]
    assert checks["violations"] == {}, checks  # no read of the device on the host repeats
    mask_reads = [n for site, n in checks["host reads"].items() if "integrations/megatron" in site]
    assert mask_reads == [1], checks  # the first mask, on the host; then none
    assert checks["device checks"] == 2, checks  # steps 2 and 3, once each for both layers
    assert checks["same as no mask"] == 0.0
    assert checks["wrong mask later"] is True and checks["wrong mask of a new kind"] is True, checks


def test_layouts_equal_tp1_cp1(reference, mesh_results) -> None:
    head = f"{'layout':<34}{'pos. emb.':<18}{'loss step 1..3':<30}{'grad norm step 1..3':<30}"
    lines = [head + "max |loss err| |norm err| |param err|"]
    for pos in POSITION_EMBEDDINGS:
        ref = reference[pos]
        lines.append(f"{'TP1 x CP1 (reference)':<34}{pos:<18}{_fmt(ref['losses']):<30}{_fmt(ref['norms']):<30}-")
    for key in sorted({k for k in mesh_results[0] if isinstance(k, tuple)}):
        runs = [r[key] for r in mesh_results]
        errs = {e: max(r[e] for r in runs) for e in ("loss err", "norm err", "param err")}
        row = f"{key[0]:<34}{key[1]:<18}{_fmt(runs[0]['losses']):<30}{_fmt(runs[0]['norms']):<30}"
        lines.append(row + " ".join(f"{v:.1e}" for v in errs.values()))
        assert all(v <= TOL for v in errs.values()), (key, errs)
    print("\n" + "\n".join(lines))
    assert len(lines) == 1 + len(POSITION_EMBEDDINGS) * (1 + len(LAYOUTS))


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.6f}" for v in values)


def test_layout_placement_and_refusals(mesh_results) -> None:
    for rank, res in enumerate(mesh_results):
        # TP2 x CP4: CP group of rank r holds ranks r % 2 + 2 * cp; with 4 GPUs per node, 2 CP ranks per node.
        assert res["layout str"].startswith(f"TP(2)-CP(2x2)-DP(1) rank {rank}: Q-group "), res["layout str"]
        assert len(set(res["q-group nodes"])) == 1, res["q-group nodes"]
        assert res["tile at 2 per node"] == (1, 4)
        assert res["pg_collection cp ranks"] == list(range(8))
        assert res["causal mask accepted"] == 0.0
        assert res["--spec meshes"] == [(2, 2), (2, 2), 1]  # both layers share one mesh over the CP group
        assert res["--spec loss finite"] is True
        refusals = {
            k: v for k, v in res.items() if isinstance(v, bool | str) and k not in ("layout str", "--spec loss finite")
        }
        failed = {k: v for k, v in refusals.items() if v is not True}
        assert len(refusals) == 26 and not failed, failed
        cp_ranks = [rank % 2 + 2 * c for c in range(4)]  # TP2 x CP4: head groups of CP ranks {0, 1} and {2, 3}
        first = rank // 2 // 2 * 2
        assert res["a2a+p2p mesh"] == (2, (1, 2), cp_ranks[first : first + 2]), res["a2a+p2p mesh"]
    # rank 5 = tp 1 + 2 * cp 2 under head_parallel 2 x 2x1: head group CP ranks {2, 3}, mesh group CP ranks {0, 2}.
    hybrid = mesh_results[5][("TP2 x CP4(head_parallel 2 x 2x1) x DP1", "rope")]["layout"]
    expected = "TP(2)-CP(head_parallel 2 x 2x1)-DP(1) rank 5: head group [5, 7], Q-group [1, 5], KV-group [5]"
    assert hybrid == expected, hybrid
    # rank 5 = tp 1 + 2 * cp 2: CP group [1, 3, 5, 7], Q-group CP ranks {2, 3}, KV-group CP ranks {0, 2}.
    assert (
        mesh_results[5]["layout str"] == "TP(2)-CP(2x2)-DP(1) rank 5: Q-group [5, 7], KV-group [1, 5], 4 ranks per node"
    )


def torchrun_pretrain(runs: list[tuple[str, ...]], out: Path, port: int, nproc: int = 8) -> list[dict]:
    """``pretrain_gpt.py`` with each of ``runs``' flags in turn (configs/megatron_cpu_test.yaml, the flags override
    it), one after another in the processes of one torchrun launch on ``nproc`` CPU processes (launched_runs.py: by
    path, without the repository on ``PYTHONPATH``); each run's final JSON line, with ``"steps"`` made
    ``{step: (loss, grad norm)}``. Torchrun's port is ``port``, run ``i``'s store ``port + 1 + i``."""
    from examples.common import read_result
    from tests.integrations.clients import launched_runs

    script = ROOT / "examples" / "megatron" / "pretrain_gpt.py"
    config = ["--config", str(ROOT / "configs" / "megatron_cpu_test.yaml")]
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    ports = range(port + 1, port + 1 + len(runs))
    outputs = launched_runs(
        torchrun, [(script, [*config, *args]) for args in runs], out, ports, env=env, cwd=ROOT, timeout=900
    )
    results = []
    for output in outputs:
        result = read_result(output)
        assert result["example"] == "megatron" and result["world"] == nproc, result
        pairs = zip(result["losses"], result["grad_norms"], strict=True)
        results.append(result | {"steps": {result["first_step"] + i: pair for i, pair in enumerate(pairs)}})
    return results


RESHARD_LAYOUTS = {
    "TP2 x CP4(2x2) x DP1": ("--tp", "2", "--cp", "4", "--tile", "2x2", "--micro-batch", "2"),
    "TP1 x CP4(1x4) x DP2": ("--tp", "1", "--cp", "4", "--tile", "1x4", "--micro-batch", "1"),
    "TP2 x CP2(head_parallel 2 x 1x1) x DP2": (
        "--tp",
        "2",
        "--cp",
        "2",
        "--head-parallel",
        "2",
        "--tile",
        "1x1",
        "--micro-batch",
        "1",
    ),
}
"""The layouts of the resharding test on 8 ranks; each trains on the same global batch of 2 sequences."""


def test_pretrain_script_resumes_distributed_checkpoints_in_other_layouts(tmp_path: Path) -> None:
    """Megatron distributed checkpoints: saved at TP2 x CP4(2x2) x DP1, resumed at TP1 x CP4(1x4) x DP2 and at
    TP2 x CP2(hybrid) x DP2; the losses and gradient norms after resuming equal an uninterrupted run in the new
    layout. The saving run also learns and matches the others' uninterrupted losses."""
    data = ["--data-dir", str(tmp_path / "data"), "--steps", "4", "--save-every", "2"]
    source, *targets = RESHARD_LAYOUTS
    saved = tmp_path / "saved"
    runs = {(source, "straight"): (*RESHARD_LAYOUTS[source], *data, "--checkpoint-dir", str(saved))}
    for target in targets:
        runs[(target, "straight")] = (*RESHARD_LAYOUTS[target], *data)
        # Stop after step 2 of the saving run: resume from its checkpoint in the new layout.
        folder = tmp_path / target.replace(" ", "")
        folder.mkdir()
        (folder / "step_2").symlink_to(saved / "step_2", target_is_directory=True)  # written by the first run
        (folder / "latest").write_text("2")
        runs[(target, "resumed")] = (*RESHARD_LAYOUTS[target], *data, "--checkpoint-dir", str(folder))
    results = dict(zip(runs, torchrun_pretrain(list(runs.values()), tmp_path / "runs", port=29611), strict=True))
    straight = {layout: results[(layout, "straight")] for layout in RESHARD_LAYOUTS}
    losses = straight[source]["steps"]
    assert sorted(losses) == [1, 2, 3, 4] and straight[source]["resumed_from"] is None, straight
    assert losses[4][0] < losses[1][0]  # it learns
    layout_5 = "TP(2)-CP(2x2)-DP(1) rank 5: Q-group [5, 7], KV-group [1, 5], 8 ranks per node"
    assert straight[source]["layouts"][5] == layout_5, straight[source]["layouts"]
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step_2", "step_4"]
    assert (saved / "step_2" / "metadata.json").exists()  # Megatron's torch_dist format
    for target in targets:
        resumed = results[(target, "resumed")]
        assert resumed["resumed_from"] == 2 and sorted(resumed["steps"]) == [3, 4], resumed
        for step in (3, 4):
            assert resumed["steps"][step] == pytest.approx(straight[target]["steps"][step], abs=TOL), (target, step)
    for target in targets:
        for step in (1, 2, 3, 4):
            assert straight[target]["steps"][step] == pytest.approx(losses[step], abs=TOL), (target, step)


def test_pretrain_script_takes_head_parallel_beside_tile(tmp_path: Path, capsys) -> None:
    """``--head-parallel`` / config key ``head_parallel`` (the head-parallel x mesh hybrid), 1 unless given; the
    former ``--cp-heads`` / ``cp_heads`` are refused, naming the new spelling."""
    from examples.megatron import pretrain_gpt

    config = tmp_path / "hybrid.yaml"
    config.write_text("cp: 4\nhead_parallel: 2\ntile: 1x2\n")
    assert pretrain_gpt.parse_args([]).head_parallel == 1
    assert pretrain_gpt.parse_args(["--config", str(config)]).head_parallel == 2
    assert pretrain_gpt.parse_args(["--config", str(config), "--head-parallel", "4"]).head_parallel == 4
    with pytest.raises(SystemExit):
        pretrain_gpt.parse_args(["--cp-heads", "2"])
    assert "--cp-heads was renamed --head-parallel" in capsys.readouterr().err
    old = tmp_path / "old.yaml"
    old.write_text("cp: 4\ncp_heads: 2\n")
    with pytest.raises(ValueError, match=r"key cp_heads was renamed head_parallel"):
        pretrain_gpt.parse_args(["--config", str(old)])


def test_former_heads_keyword_is_refused_naming_head_parallel() -> None:
    """``heads=`` (now only the query-head count) as the degree of the spec or the layout is refused, before any
    process group is needed, naming ``head_parallel``."""
    from mesh_cp.integrations import megatron as mcp

    renamed = r"'heads' was renamed 'head_parallel'.*pass head_parallel=2"
    with pytest.raises(ValueError, match=rf"get_gpt_layer_mesh_spec: {renamed}"):
        mcp.get_gpt_layer_mesh_spec(heads=2)
    with pytest.raises(ValueError, match=rf"MeshLayout.from_parallel_state: {renamed}"):
        mcp.MeshLayout.from_parallel_state(tile=(1, 2), heads=2)


def test_checkpoint_refusals(tmp_path: Path) -> None:
    """What the distributed checkpoint cannot hold is refused by name, before any collective; a Megatron optimizer
    is asked for its own sharded state, as a save or as a load."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from mesh_cp.integrations.megatron import checkpoint

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="only for Adam and AdamW, got SGD"):
        checkpoint.init_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        checkpoint.init_optimizer_state(torch.optim.AdamW(model.parameters(), amsgrad=True))
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.init_optimizer_state(optimizer)
    assert len(optimizer.state) == 2
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in optimizer.state.values())
    with pytest.raises(CheckpointingException, match="is not a Megatron distributed checkpoint"):
        checkpoint.load(tmp_path, model, optimizer)

    class MegatronLikeOptimizer:  # Megatron's optimizers (CUDA only) shard their own state, told when it is a load
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def sharded_state_dict(self, model_sharded, is_loading=False):
            self.calls.append(is_loading)
            return {"sharded": model_sharded}

    megatron_like = MegatronLikeOptimizer()
    for loading in (False, True):
        got = checkpoint.optimizer_sharded_state_dict(megatron_like, model, {"w": 1}, loading=loading)
        assert got == {"sharded": {"w": 1}}
    assert megatron_like.calls == [False, True]


def test_packed_documents_are_read_again_when_any_field_changes() -> None:
    """A reading of ``packed_seq_params`` is reused only for the same tensors (unmodified) and the same other fields:
    a params object that shares one boundary tensor with an accepted one is still checked."""
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from mesh_cp.integrations.megatron.packed import PackedDocuments

    mesh, cpu = SimpleNamespace(size=2, rank=0), torch.device("cpu")
    documents = PackedDocuments()
    padded = torch.tensor([0, 8, 16], dtype=torch.int32)

    def thd(real, kv=None):
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real if kv is None else kv,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)  # fmt: skip

    full = thd(padded)
    first = documents.thd(full, mesh, cpu, causal=False)
    assert documents.thd(full, mesh, cpu, causal=False) is first  # read once
    real = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"without a causal mask over padded documents"):
        documents.thd(thd(real), mesh, cpu, causal=False)
    with pytest.raises(NotImplementedError, match=r"cu_seqlens_kv equal to cu_seqlens_q"):
        documents.thd(thd(padded, kv=real), mesh, cpu, causal=True)
    bounds = torch.tensor([0, 10, 32], dtype=torch.int32)
    row = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    mask = documents(row, 32, 1, mesh)
    assert documents(row, 32, 1, mesh) is mask
    for params, seq, batch, match in (
        (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=real), 32, 1, r"cu_seqlens_kv"),
        (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=22), 32, 1,
         r"max_seqlen_q/kv \(22, None\)"),
        (row, 32, 4, r"for a batch of 4"),
        (row, 16, 1, r"at most the row's 16 tokens"),
    ):  # fmt: skip
        with pytest.raises((NotImplementedError, ValueError), match=match):
            documents(params, seq, batch, mesh)
    bounds[1] = 12  # modified in place: read again
    assert documents(row, 32, 1, mesh).documents == (((0, 12), (12, 32)),)
