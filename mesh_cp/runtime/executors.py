"""Executors of an :class:`~mesh_cp.core.plan.AttentionPlan`: the collective and the overlapped schedule.

An executor turns the plan into communication and kernel calls. Both take one frozen
:class:`~mesh_cp.runtime.call.AttentionCall` (mesh, plan, kernel, scale), which :class:`~mesh_cp.runtime.attention.MeshAttnFunc`
keeps on its ``ctx`` from forward to backward, and the tensors of the phase; neither cares how the
other runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from mesh_cp.core.blocks import BlockWork, ChunkCall, first_writes
from mesh_cp.core.numerics import acc_dtype, attention_delta
from mesh_cp.kernels.fused import merge_
from mesh_cp.runtime.call import AttentionCall, Saved, accumulate, accumulator, plan_cache, write_rows
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
    accumulator dtype. A row's first result is copied in, later ones merged (Note [LSE merge], Note [First
    writes])."""
    prog = _program(call, rank)
    a, batch, seq, heads, dim = q_all.shape
    acc, device = acc_dtype(q_all.dtype), q_all.device
    complete = prog.q_complete and seq == prog.seq  # the chunks are the plan's
    o_acc = accumulator((a, batch, seq, heads, dim), acc, device, complete)
    lse_acc = accumulator((a, batch, heads, seq), acc, device, complete, float("-inf"))
    cols = prog.cols
    for s in prog.steps:
        i, (q0, q1) = s.row, s.q_rows
        if s.col is None:
            o, lse = call.forward_chunk(s.unit, q_all[i], lambda y: kv_all[cols[y]])
        else:
            o, lse = call.forward_block(s.unit, q_all[i], kv_all[s.col])
        write_rows(o_acc[i, :, q0:q1], lse_acc[i, :, :, q0:q1], o, lse, s.first)
    return o_acc, lse_acc


def backward_blocks(
    call: AttentionCall, rank: int, q_all: Tensor, do_all: Tensor, stats: Tensor, kv_all: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward of :func:`forward_blocks` given ``do_all`` like ``q_all`` and the rows' ``stats (a, 2, B, H,
    L)`` (lse, delta): partial ``dq (a, B, L, H, D)`` and ``dk, dv (b, 2, B, L, Hkv, D)`` in the accumulator
    dtype. A piece's first gradient is copied in, later ones added (Note [First writes])."""
    prog = _program(call, rank)
    acc = acc_dtype(q_all.dtype)
    fits = q_all.shape[2] == prog.seq == kv_all.shape[3]  # the chunks are the plan's
    dq_acc = accumulator(q_all.shape, acc, q_all.device, prog.q_complete and fits)
    dkv_acc = accumulator(kv_all.shape, acc, q_all.device, prog.kv_complete and fits)
    cols = prog.cols
    for s in prog.steps:
        i, (q0, q1) = s.row, s.q_rows
        if s.col is None:
            dq, pieces = call.backward_chunk(s.unit, q_all[i], do_all[i], stats[i], lambda y: kv_all[cols[y]])
            grads = [(dk, dv) for _, _, dk, dv in pieces]
        else:
            dq, dk, dv = call.backward_block(s.unit, q_all[i], do_all[i], stats[i], kv_all[s.col])
            grads = [(dk, dv)]
        accumulate(dq_acc[i, :, q0:q1], dq, s.first)
        for (j, (k0, k1), first), (dk, dv) in zip(s.keys, grads, strict=True):
            accumulate(dkv_acc[j, 0, :, k0:k1], dk, first)
            accumulate(dkv_acc[j, 1, :, k0:k1], dv, first)
    return dq_acc, dkv_acc


@dataclass(frozen=True, eq=False)
class _Step:
    """One unit of a rank's calls, placed in the gathered chunks (Note [Host work per plan])."""

    unit: BlockWork | ChunkCall
    row: int
    """Its Q chunk's position in the gathered Q chunks."""
    q_rows: tuple[int, int]
    col: int | None
    """A block's KV chunk's position in the gathered KV chunks (``None``: a chunk call)."""
    first: bool
    """The first write of its rows in the row accumulators (Note [First writes])."""
    keys: tuple[tuple[int, tuple[int, int], bool], ...]
    """``(position, kv_rows, first write)`` of every piece of its ``dk, dv``, in the order its backward returns them."""


@dataclass(frozen=True, eq=False)
class _Program:
    """A rank's units in the gathered chunks, and whether the first writes cover the accumulators."""

    steps: tuple[_Step, ...]
    cols: dict[int, int]
    """KV chunk -> its position in the gathered KV chunks."""
    seq: int
    """Rows of a chunk."""
    q_complete: bool
    kv_complete: bool


def _program(call: AttentionCall, rank: int) -> _Program:
    """``rank``'s :class:`_Program` on ``call``'s kernel, built once per plan (Note [Host work per plan])."""
    cache = plan_cache(call.plan)
    key = ("program", rank, call.route_mode)
    if key not in cache:
        cache[key] = _build_program(call, rank)
    return cache[key]


def _build_program(call: AttentionCall, rank: int) -> _Program:
    plan, seq = call.plan, call.plan.mesh_shape.seq_local
    rows = {x: i for i, x in enumerate(plan.tiling.q_group(rank))}
    cols = {y: j for j, y in enumerate(plan.tiling.kv_group(rank))}
    units = call.units(rank)
    keys = [call.route(u).pieces if isinstance(u, ChunkCall) else ((u.y, u.kv_rows),) for u in units]
    first_q, q_complete = first_writes([(rows[u.x], u.q_rows) for u in units], len(rows), seq)
    first_kv, kv_complete = first_writes([(cols[y], k_rows) for pieces in keys for y, k_rows in pieces], len(cols), seq)
    steps, at = [], 0
    for u, pieces, first in zip(units, keys, first_q, strict=True):
        flags = first_kv[at : at + len(pieces)]
        placed = tuple((cols[y], kv_rows, f) for (y, kv_rows), f in zip(pieces, flags, strict=True))
        at += len(pieces)
        col = None if isinstance(u, ChunkCall) else cols[u.y]
        steps.append(_Step(u, rows[u.x], u.q_rows, col, first, placed))
    return _Program(tuple(steps), cols, seq, q_complete, kv_complete)


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
