"""Executors of an :class:`~mesh_cp.core.plan.AttentionPlan`: the collective and the overlapped schedule.

An executor turns the plan into communication and kernel calls. Both take one frozen
:class:`~mesh_cp.runtime.call.AttentionCall` (mesh, plan, kernel, scale), which :class:`~mesh_cp.runtime.attention.MeshAttnFunc`
keeps on its ``ctx`` from forward to backward, and the tensors of the phase; neither cares how the
other runs.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from mesh_cp.core.blocks import ChunkCall
from mesh_cp.core.numerics import acc_dtype, attention_delta, merge_
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.runtime.call import AttentionCall, Saved
from mesh_cp.runtime.comm import all_gather, all_to_all
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.phases import BackwardPhase, ForwardPhase


class Executor(Protocol):
    name: str

    def forward(
        self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Return this rank's final ``out (B, L, Hq, D)`` and ``lse (B, Hq, L)`` in the accumulator dtype, and
        :attr:`Saved.gathered`."""
        ...

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``dq, dk, dv`` for this rank's chunk, in the dtypes of ``q, k, v``. ``dlse (B, Hq, L)`` is
        the gradient of this rank's lse, ``None`` when none can reach it (``call.lse_grad`` is false)."""
        ...


class CollectiveExecutor:
    """All-gather within the groups, compute every owned block, reduce to the owners.

    Forward: all-gather Q in the Q-group and K,V in the KV-group; run the rank's blocks, merging
    each Q row's partials with the LSE merge; all-to-all the partial ``(o, lse)`` of each row to the
    rank that owns it (group rank ``i`` of a Q-group owns its ``i``-th row), which merges them.
    Backward mirrors it: gather Q and dO (or reuse the forward's Q), the rows' global ``lse`` and
    ``delta``, and K,V (or reuse); run the block backwards; all-to-all ``dq`` partials within the
    Q-group and ``dk, dv`` partials within the KV-group and sum them at their owners (fp32).
    """

    name = "collective"

    def forward(
        self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        mesh, plan = call.mesh, call.plan
        q_all = all_gather(q, mesh.q_group)  # (a, B, L, Hq, D)
        kv_all = all_gather(torch.stack((k, v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)
        o_acc, lse_acc = forward_blocks(call, mesh.mesh_rank, q_all, kv_all)
        out, lse = _reduce_rows_to_owners(o_acc, lse_acc, mesh)
        return out, lse, (q_all, kv_all) if plan.backward == "reuse" else ()

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        mesh, plan, q, k = call.mesh, call.plan, saved.q, saved.k
        acc = acc_dtype(q.dtype)
        delta = attention_delta(do, saved.out, dlse)
        if plan.backward == "regather":
            q_do = all_gather(torch.stack((q, do.to(q.dtype))), mesh.q_group)  # (a, 2, B, L, Hq, D)
            q_all, do_all = q_do[:, 0], q_do[:, 1]
        else:
            q_all, kv_all = saved.gathered
            do_all = all_gather(do.to(q.dtype), mesh.q_group)
        stats = all_gather(torch.stack((saved.lse.to(acc), delta)), mesh.q_group)  # (a, 2, B, Hq, L)
        if plan.backward == "regather":
            kv_all = all_gather(torch.stack((k, saved.v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)
        dq_acc, dkv_acc = backward_blocks(call, mesh.mesh_rank, q_all, do_all, stats, kv_all)
        dq = all_to_all(dq_acc, mesh.q_group).sum(0)
        dkv = all_to_all(dkv_acc, mesh.kv_group).sum(0)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(saved.v.dtype)


def forward_blocks(call: AttentionCall, rank: int, q_all: Tensor, kv_all: Tensor) -> tuple[Tensor, Tensor]:
    """Mesh rank ``rank``'s kernel calls on the gathered Q chunks ``q_all (a, B, L, H, D)`` and stacked K, V chunks
    ``kv_all (b, 2, B, L, Hkv, D)``: the row partials ``o (a, B, L, H, D)`` and ``lse (a, B, H, L)`` in the
    accumulator dtype. A row's first result is copied in, later ones merged (Note [LSE merge])."""
    rows, cols = _row_col_index(call.plan, rank)
    a, batch, seq, heads, dim = q_all.shape
    acc = acc_dtype(q_all.dtype)
    o_acc = torch.zeros((a, batch, seq, heads, dim), dtype=acc, device=q_all.device)
    lse_acc = torch.full((a, batch, heads, seq), float("-inf"), dtype=acc, device=q_all.device)
    fresh = set(range(a))
    for u in call.units(rank):
        i, (q0, q1) = rows[u.x], u.q_rows
        if isinstance(u, ChunkCall):
            o, lse = call.forward_chunk(u, q_all[i], lambda y: kv_all[cols[y]])
        else:
            o, lse = call.forward_block(u, q_all[i], kv_all[cols[u.y]])
        if i in fresh:
            fresh.discard(i)
            o_acc[i, :, q0:q1].copy_(o)
            lse_acc[i, :, :, q0:q1].copy_(lse)
        else:
            merge_(o_acc[i, :, q0:q1], lse_acc[i, :, :, q0:q1], o, lse)
    return o_acc, lse_acc


def backward_blocks(
    call: AttentionCall, rank: int, q_all: Tensor, do_all: Tensor, stats: Tensor, kv_all: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward of :func:`forward_blocks` given ``do_all`` like ``q_all`` and the rows' ``stats (a, 2, B, H,
    L)`` (lse, delta): partial ``dq (a, B, L, H, D)`` and ``dk, dv (b, 2, B, L, Hkv, D)`` in the accumulator
    dtype."""
    rows, cols = _row_col_index(call.plan, rank)
    acc = acc_dtype(q_all.dtype)
    dq_acc = torch.zeros(q_all.shape, dtype=acc, device=q_all.device)
    dkv_acc = torch.zeros(kv_all.shape, dtype=acc, device=q_all.device)
    for u in call.units(rank):
        i, (q0, q1) = rows[u.x], u.q_rows
        if isinstance(u, ChunkCall):
            dq, pieces = call.backward_chunk(u, q_all[i], do_all[i], stats[i], lambda y: kv_all[cols[y]])
        else:
            dq, dk, dv = call.backward_block(u, q_all[i], do_all[i], stats[i], kv_all[cols[u.y]])
            pieces = [(u.y, u.kv_rows, dk, dv)]
        dq_acc[i, :, q0:q1] += dq
        for y, (k0, k1), dk, dv in pieces:
            dkv_acc[cols[y], 0, :, k0:k1] += dk
            dkv_acc[cols[y], 1, :, k0:k1] += dv
    return dq_acc, dkv_acc


def _row_col_index(plan: AttentionPlan, rank: int) -> tuple[dict[int, int], dict[int, int]]:
    """Chunk index -> position in the gathered Q rows / KV columns of ``rank``."""
    rows = {x: i for i, x in enumerate(plan.tiling.q_group(rank))}
    cols = {y: j for j, y in enumerate(plan.tiling.kv_group(rank))}
    return rows, cols


def _reduce_rows_to_owners(o_acc: Tensor, lse_acc: Tensor, mesh: CPMesh) -> tuple[Tensor, Tensor]:
    """``(a, B, L, H, D)`` / ``(a, B, H, L)`` row partials -> this rank's merged row, by all-to-all."""
    a = o_acc.shape[0]
    if a == 1:
        return o_acc[0], lse_acc[0]
    n_o = o_acc[0].numel()
    packed = torch.cat((o_acc.reshape(a, -1), lse_acc.reshape(a, -1)), dim=1)
    received = all_to_all(packed, mesh.q_group)
    o_parts = received[:, :n_o].view(o_acc.shape)
    lse_parts = received[:, n_o:].view(lse_acc.shape)
    out, lse = o_parts[0].clone(), lse_parts[0].clone()
    for j in range(1, a):
        merge_(out, lse, o_parts[j], lse_parts[j])
    return out, lse


class OverlapExecutor:
    """p2p rings inside the Q-group and the KV-group, transfers overlapped with block compute.

    Runs the actions of :meth:`AttentionPlan.overlap` (Note [Overlapped schedule] in
    :mod:`mesh_cp.core.schedule`): moves pass chunks one ring step at a time while the blocks already
    held are computed; partial ``(o, lse)`` of rows travel along the Q ring and are merged on the way
    (forward); ``dq`` travels along the Q ring and ``dk, dv`` along the KV ring, summed in fp32 on the
    way (backward). Sends the same bytes as the collective schedule.
    """

    name = "overlap"

    def forward(
        self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        phase = ForwardPhase(call, q, k, v)
        phase.run()
        return (*phase.row(0), phase.gathered())

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        phase = BackwardPhase(call, do, dlse, saved)
        phase.run()
        dq, dkv = phase.grad("q", 0), phase.grad("kv", 0)
        return dq.to(saved.q.dtype), dkv[0].to(saved.k.dtype), dkv[1].to(saved.v.dtype)


EXECUTORS: dict[str, Executor] = {e.name: e for e in (OverlapExecutor(), CollectiveExecutor())}
"""Executor per ``schedule`` name (:data:`mesh_cp.core.options.SCHEDULES`)."""
