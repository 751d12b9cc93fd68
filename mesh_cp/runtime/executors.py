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

from mesh_cp.core.numerics import acc_dtype
from mesh_cp.kernels.fused import attention_delta, merge_, merged
from mesh_cp.runtime.call import (
    AttentionCall,
    Saved,
    accumulate,
    add_key_grads,
    fill_unwritten,
    lay,
    source,
    write_rows,
)
from mesh_cp.runtime.comm import all_gather, all_gather_parts, all_gather_stacked, all_to_all, all_to_all_parts
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.phases import BackwardPhase, ForwardPhase


class Executor(Protocol):
    name: str

    def forward(
        self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Return this rank's final ``out (B, L, Hq, D)`` in the dtype of ``q`` and ``lse (B, Hq, L)`` in the
        accumulator dtype, and :attr:`Saved.gathered`."""
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
        kv = [all_gather_stacked((k, v), mesh.kv_group)]  # (b, 2, B, L, Hkv, D)
        gathered = (q_all, kv[0]) if plan.backward == "reuse" else ()
        if plan.partials == "input":  # Note [Partials as computed]
            o, lse = _forward_as_computed(call, mesh.mesh_rank, q_all, kv)
            out, lse = _merged_parts(all_to_all_parts(o, mesh.q_group), all_to_all_parts(lse, mesh.q_group), q.dtype)
            return out, lse, gathered
        packed = _forward_packed(call, mesh.mesh_rank, q_all, kv)
        out, lse = _reduce_rows_to_owners(packed, q_all.shape, mesh, q.dtype)
        return out, lse, gathered

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        mesh, plan, q, k = call.mesh, call.plan, saved.q, saved.k
        acc = acc_dtype(q.dtype)
        delta = attention_delta(do, saved.out, dlse)
        if plan.backward == "regather":
            q_all, do_all = all_gather_parts((q, do.to(q.dtype)), mesh.q_group)  # (a, B, L, Hq, D) each
        else:
            q_all, kv = saved.gathered[0], [saved.gathered[1]]
            do_all = all_gather(do.to(q.dtype), mesh.q_group)
        stats = all_gather_stacked((saved.lse.to(acc), delta), mesh.q_group)  # (a, 2, B, Hq, L)
        if plan.backward == "regather":
            kv = [all_gather_stacked((k, saved.v), mesh.kv_group)]  # (b, 2, B, L, Hkv, D)
        as_computed = plan.partials == "input"  # Note [Partials as computed]
        dq_acc, dkv_acc = _backward_accumulators(call, mesh.mesh_rank, q_all, do_all, stats, kv, as_computed)
        dq = _sum_into((all_to_all_parts if as_computed else all_to_all)(dq_acc, mesh.q_group), q.dtype)
        dkv = _sum_into(all_to_all(dkv_acc, mesh.kv_group), k.dtype)
        return dq, dkv[0], dkv[1]


def _sum_into(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """The sum of ``parts`` over their first dim, summed in their dtype and written once in ``dtype``."""
    return torch.sum(parts, 0, out=torch.empty(parts.shape[1:], dtype=dtype, device=parts.device))


def forward_blocks(call: AttentionCall, rank: int, q_all: Tensor, kv_all: Tensor) -> tuple[Tensor, Tensor]:
    """Mesh rank ``rank``'s kernel calls on the gathered Q chunks ``q_all (a, B, L, H, D)`` and stacked K, V chunks
    ``kv_all (b, 2, B, L, Hkv, D)``: the row partials ``o (a, B, L, H, D)`` and ``lse (a, B, H, L)`` in the
    accumulator dtype. A row's first result is copied in, later ones merged (Note [LSE merge], Note [First writes]);
    the keys of calls over several chunks are laid once (Note [Keys in global order] in
    :mod:`mesh_cp.core.key_layout`)."""
    return _unpack(_forward_packed(call, rank, q_all, [kv_all]), q_all.shape)


def _laid_keys(prog, kv: list[Tensor]) -> tuple[Tensor | None, Tensor | None]:
    """The phase's laid keys and the gathered K, V chunks, which ``kv`` (a list of them) gives up when every call
    reads the layout: held nowhere else (``backward="regather"``), they are freed once laid."""
    laid = lay(kv[0].__getitem__, prog)
    if laid is not None and all(c.laid for c in prog.calls):
        kv.clear()
        return laid, None
    return laid, kv[0]


def _forward_packed(call: AttentionCall, rank: int, q_all: Tensor, kv: list[Tensor]) -> Tensor:
    """:func:`forward_blocks`'s partials in one ``(a, B L H (D + 1))`` buffer, ``o`` then ``lse`` per Q chunk: what
    the all-to-all to the rows' owners sends, with no packing."""
    prog = call.program(rank)
    laid, kv_all = _laid_keys(prog, kv)
    a, batch, seq, heads, dim = q_all.shape
    packed = torch.empty((a, batch * seq * heads * (dim + 1)), dtype=acc_dtype(q_all.dtype), device=q_all.device)
    o_acc, lse_acc = _unpack(packed, q_all.shape)
    fills = prog.q_fills if seq == prog.seq else None  # the chunks are the plan's
    fill_unwritten(((o_acc, 1, 0.0), (lse_acc, 2, float("-inf"))), fills)
    for c in prog.calls:
        o, lse = call.forward(c, q_all[c.slot], source(c, laid, lambda j: kv_all[j]))
        (q0, q1) = c.q_rows
        write_rows(o_acc[c.slot, :, q0:q1], lse_acc[c.slot, :, :, q0:q1], o, lse, c.first)
        del o, lse  # before the next call's outputs exist
    return packed


def _forward_as_computed(call: AttentionCall, rank: int, q_all: Tensor, kv: list[Tensor]) -> tuple[list, list]:
    """The row partials of a program of one call per Q chunk (Note [Partials as computed]): each chunk's ``o`` and
    ``lse`` as the kernel returns them; a chunk no call reaches gets ``(0, -inf)``."""
    prog = call.program(rank)
    laid, kv_all = _laid_keys(prog, kv)
    a, batch, seq, heads, _ = q_all.shape
    o: list[Tensor | None] = [None] * a
    lse: list[Tensor | None] = [None] * a
    acc = acc_dtype(q_all.dtype)
    for c in prog.calls:
        o_c, lse_c = call.forward(c, q_all[c.slot], source(c, laid, lambda j: kv_all[j]))
        o[c.slot] = _whole_rows(o_c, c.q_rows, 1, 0.0, q_all.shape[1:], q_all.dtype)
        lse[c.slot] = _whole_rows(lse_c, c.q_rows, 2, float("-inf"), (batch, heads, seq), acc)
    for i in (i for i in range(a) if o[i] is None):
        o[i] = torch.zeros_like(q_all[i])
        lse[i] = torch.full((batch, heads, seq), float("-inf"), dtype=acc, device=q_all.device)
    return o, lse


def _whole_rows(x: Tensor, rows: tuple[int, int], dim: int, identity: float, shape, dtype: torch.dtype) -> Tensor:
    """A call's output over ``rows`` of a chunk, as the chunk's: itself when it covers every row, else written into
    a chunk of ``dtype`` whose other rows hold ``identity``."""
    start, stop = rows
    if (start, stop) == (0, shape[dim]):
        return x
    whole = torch.empty(shape, dtype=dtype, device=x.device)
    whole.narrow(dim, 0, start).fill_(identity)
    whole.narrow(dim, stop, shape[dim] - stop).fill_(identity)
    whole.narrow(dim, start, stop - start).copy_(x)
    return whole


def _unpack(packed: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
    """The ``o (a, B, L, H, D)`` and ``lse (a, B, H, L)`` views of one ``(a, B L H (D + 1))`` buffer."""
    a, batch, seq, heads, dim = shape
    n_o = batch * seq * heads * dim
    return packed[:, :n_o].view(shape), packed[:, n_o:].view(a, batch, heads, seq)


def backward_blocks(
    call: AttentionCall, rank: int, q_all: Tensor, do_all: Tensor, stats: Tensor, kv_all: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward of :func:`forward_blocks` given ``do_all`` like ``q_all`` and the rows' ``stats (a, 2, B, H,
    L)`` (lse, delta): partial ``dq (a, B, L, H, D)`` and ``dk, dv (b, 2, B, L, Hkv, D)`` in the accumulator
    dtype. Every call's gradients go straight into them: a first write is a copy, later ones add (Note [First
    writes])."""
    return _backward_accumulators(call, rank, q_all, do_all, stats, [kv_all])


def _backward_accumulators(
    call, rank: int, q_all, do_all, stats, kv: list[Tensor], as_computed: bool = False
) -> tuple[Tensor | list[Tensor], Tensor]:
    """:func:`backward_blocks`; with ``as_computed`` (Note [Partials as computed]) ``dq`` is the list of every Q chunk's
    ``dq`` as its one call returns it (zeros for a chunk no call reaches)."""
    prog = call.program(rank)
    acc, kv_shape = acc_dtype(q_all.dtype), kv[0].shape
    fits = q_all.shape[2] == prog.seq == kv_shape[3]  # the chunks are the plan's
    if as_computed:
        dq_acc: Tensor | list = [None] * q_all.shape[0]
    else:
        dq_acc = torch.empty(q_all.shape, dtype=acc, device=q_all.device)
        fill_unwritten(((dq_acc, 1, 0.0),), prog.q_fills if fits else None)
    laid, kv_all = _laid_keys(prog, kv)
    dkv_acc = torch.empty(kv_shape, dtype=acc, device=q_all.device)
    fill_unwritten(((dkv_acc, 2, 0.0),), prog.kv_fills if fits else None)
    for c in prog.calls:
        i, (q0, q1) = c.slot, c.q_rows
        dq, dk, dv = call.backward(c, q_all[i], do_all[i], stats[i], source(c, laid, lambda j: kv_all[j]))
        if as_computed:
            dq_acc[i] = _whole_rows(_as_computed(dq, q_all.dtype, call), c.q_rows, 1, 0.0, q_all.shape[1:], q_all.dtype)
        else:
            accumulate(dq_acc[i, :, q0:q1], dq, c.first)
        add_key_grads(lambda j: dkv_acc[j], c, dk, dv, c.first_kv)
        del dq, dk, dv
    if as_computed:
        dq_acc = [torch.zeros_like(q_all[i]) if g is None else g for i, g in enumerate(dq_acc)]
    return dq_acc, dkv_acc


def _as_computed(dq: Tensor, dtype: torch.dtype, call: AttentionCall) -> Tensor:
    """A call's ``dq`` sent as it is: in the input dtype, as the kernel declares (``dq_in_input_dtype``)."""
    if dq.dtype != dtype:
        raise RuntimeError(
            f"kernel {call.kernel.name!r} declares dq_in_input_dtype but returned dq in {dq.dtype} for {dtype} "
            f"inputs; fix its capabilities (dq_in_input_dtype=False sends dq in fp32)"
        )
    return dq


def _reduce_rows_to_owners(
    packed: Tensor, shape: torch.Size, mesh: CPMesh, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Row partials in one buffer (:func:`_forward_packed`, ``shape`` the gathered Q chunks') -> this rank's merged
    row, ``out`` in ``dtype``, by one all-to-all of the buffer (:func:`_merged_parts`)."""
    if shape[0] == 1:
        o_acc, lse_acc = _unpack(packed, shape)
        return o_acc[0].to(dtype), lse_acc[0].clone()
    return _merged_parts(*_unpack(all_to_all(packed, mesh.q_group), shape), dtype)


def _merged_parts(o_parts: Tensor, lse_parts: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The row partials ``o_parts (a, ...)``, ``lse_parts`` received from the Q-group merged: the first two into new
    tensors, the next ones into them, and the last one into ``out`` written in ``dtype`` (what is returned holds none
    of the buffers)."""
    a = o_parts.shape[0]
    if a == 1:
        return o_parts[0].to(dtype).contiguous(), lse_parts[0].clone()
    out, lse = o_parts[0], lse_parts[0]
    for j in range(1, a):
        if j == 1 or j == a - 1:
            out, lse = merged(out, lse, o_parts[j], lse_parts[j], dtype if j == a - 1 else None)
        else:
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
        return (*phase.result(q.dtype), phase.gathered())

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        phase = BackwardPhase(call, do, dlse, saved)
        phase.run()
        dkv = phase.result("kv", saved.k.dtype)
        return phase.result("q", saved.q.dtype), dkv[0], dkv[1]


EXECUTORS: dict[str, Executor] = {e.name: e for e in (OverlapExecutor(), CollectiveExecutor())}
"""Executor per ``schedule`` name (:data:`mesh_cp.core.options.SCHEDULES`)."""
