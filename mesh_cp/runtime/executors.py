"""Executors of an :class:`~mesh_cp.core.plan.AttentionPlan`: the collective and the overlapped schedule.

An executor turns the plan into communication and kernel calls. Both take one frozen
:class:`AttentionCall` (mesh, plan, kernel, scale), which :class:`~mesh_cp.runtime.attention.MeshAttnFunc`
keeps on its ``ctx`` from forward to backward, and the tensors of the phase; neither cares how the
other runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype, attention_delta, merge_
from mesh_cp.core.plan import AttentionPlan, BlockWork
from mesh_cp.core.schedule import RingStep
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.runtime.comm import all_gather, all_to_all, ring_step
from mesh_cp.runtime.mesh import CPMesh


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What one attention call runs with, the same in forward and backward."""

    mesh: CPMesh
    plan: AttentionPlan
    kernel: BlockKernel
    scale: float
    lse_grad: bool = False
    """The lse may receive a gradient (``return_lse``): the block kernels take the exact path for any
    ``dlse`` (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`). Equal on every rank."""

    @property
    def executor(self) -> Executor:
        return EXECUTORS[self.plan.schedule]

    def forward_block(self, w: BlockWork, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The kernel's ``(o, lse)`` of block ``w`` from the whole Q chunk ``q (B, L, H, D)`` and the stacked
        K, V chunk ``kv (2, B, L, Hkv, D)``."""
        (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
        return self.kernel.forward(q[:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=w.causal, scale=self.scale)

    def backward_block(
        self, w: BlockWork, q: Tensor, do: Tensor, stats: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel's ``dq, dk, dv`` of block ``w`` from whole chunks; ``stats (2, B, H, L)`` holds the rows'
        lse and delta."""
        (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
        return self.kernel.backward(
            do[:, q0:q1],
            q[:, q0:q1],
            kv[0, :, k0:k1],
            kv[1, :, k0:k1],
            stats[0, :, :, q0:q1],
            stats[1, :, :, q0:q1],
            causal=w.causal,
            scale=self.scale,
            lse_grad=self.lse_grad,
        )


@dataclass(frozen=True)
class Saved:
    """What forward keeps for backward."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    """This rank's output in the input dtype."""
    lse: Tensor
    """This rank's lse in the accumulator dtype."""
    gathered: tuple[Tensor, ...] = ()
    """``backward="reuse"``: the Q chunks ``(a, ...)`` and stacked K, V chunks ``(b, 2, ...)`` gathered in forward."""


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


def _row_delta(do: Tensor, out: Tensor, dlse: Tensor | None) -> Tensor:
    """``delta = rowsum(dO * O) - dlse`` of this rank's rows, ``(B, Hq, L)`` in the accumulator dtype.

    A gradient on the lse enters every block as ``delta - dlse`` (``d lse_i / d s_ij = p_ij``; Note
    [Gradient of the lse] in :mod:`mesh_cp.kernels.base`).
    """
    delta = attention_delta(do, out)
    return delta if dlse is None else delta - dlse.to(delta.dtype)


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
        rows, cols = _row_col_index(plan, mesh.rank)
        batch, seq, heads, dim = q.shape
        acc = acc_dtype(q.dtype)
        q_all = all_gather(q, mesh.q_group)  # (a, B, L, Hq, D)
        kv_all = all_gather(torch.stack((k, v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)
        a = plan.tiling.a
        o_acc = torch.zeros((a, batch, seq, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((a, batch, heads, seq), float("-inf"), dtype=acc, device=q.device)
        for w in plan.blocks(mesh.rank):
            i, (q0, q1) = rows[w.x], w.q_rows
            o, lse = call.forward_block(w, q_all[i], kv_all[cols[w.y]])
            merge_(o_acc[i, :, q0:q1], lse_acc[i, :, :, q0:q1], o, lse)
        out, lse = _reduce_rows_to_owners(o_acc, lse_acc, mesh)
        return out, lse, (q_all, kv_all) if plan.backward == "reuse" else ()

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        mesh, plan, q, k = call.mesh, call.plan, saved.q, saved.k
        rows, cols = _row_col_index(plan, mesh.rank)
        acc = acc_dtype(q.dtype)
        delta = _row_delta(do, saved.out, dlse)
        if plan.backward == "regather":
            q_do = all_gather(torch.stack((q, do.to(q.dtype))), mesh.q_group)  # (a, 2, B, L, Hq, D)
            q_all, do_all = q_do[:, 0], q_do[:, 1]
        else:
            q_all, kv_all = saved.gathered
            do_all = all_gather(do.to(q.dtype), mesh.q_group)
        stats = all_gather(torch.stack((saved.lse.to(acc), delta)), mesh.q_group)  # (a, 2, B, Hq, L)
        if plan.backward == "regather":
            kv_all = all_gather(torch.stack((k, saved.v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)
        dq_acc = torch.zeros((plan.tiling.a, *q.shape), dtype=acc, device=q.device)
        dkv_acc = torch.zeros((plan.tiling.b, 2, *k.shape), dtype=acc, device=q.device)
        for w in plan.blocks(mesh.rank):
            i, j = rows[w.x], cols[w.y]
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            dq, dk, dv = call.backward_block(w, q_all[i], do_all[i], stats[i], kv_all[j])
            dq_acc[i, :, q0:q1] += dq
            dkv_acc[j, 0, :, k0:k1] += dk
            dkv_acc[j, 1, :, k0:k1] += dv
        dq = all_to_all(dq_acc, mesh.q_group).sum(0)
        dkv = all_to_all(dkv_acc, mesh.kv_group).sum(0)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(saved.v.dtype)


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


class _Chunks:
    """Chunks held per ring offset, dropped after their last use unless kept for backward.

    With ``keep`` the chunks live in one preallocated ``(n, ...)`` tensor (what backward reuses);
    otherwise each offset gets its own buffer, freed after the action that last needs it.
    """

    def __init__(self, first: Tensor, n: int, keep: bool, last_use: dict[int, int]) -> None:
        self.keep, self.last_use = keep, last_use
        self.shape, self.dtype, self.device = first.shape, first.dtype, first.device
        self.store = torch.empty((n, *first.shape), dtype=first.dtype, device=first.device) if keep else None
        self.held: dict[int, Tensor] = {}
        self.put(0, first)

    def put(self, offset: int, value: Tensor | None = None) -> Tensor:
        """Hold ``value`` at ``offset`` (or an empty receive buffer shaped like offset 0); return it."""
        if self.store is not None:
            buf = self.store[offset]
            if value is not None:
                buf.copy_(value)
        elif value is not None:
            buf = value.contiguous()
        else:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.held[offset] = buf
        return buf

    def __getitem__(self, offset: int) -> Tensor:
        return self.held[offset]

    def release(self, action: int) -> None:
        if not self.keep:
            for offset in [o for o in self.held if self.last_use.get(o, -1) == action]:
                del self.held[offset]


class _OverlapPhase:
    """One phase of the overlapped schedule on this rank: the chunks it holds per ring offset, the partial
    results it reduces, and the loop over the schedule's actions.

    A subclass says what a reduce step sends (:meth:`reduce`), where a received partial lands
    (:meth:`land`) and what a block computes (:meth:`compute`); moves pass the held chunks of a ring on.
    """

    def __init__(self, call: AttentionCall, phase: str) -> None:
        self.call = call
        self.sched = call.plan.overlap(phase)
        self.sizes = {"q": call.plan.tiling.a, "kv": call.plan.tiling.b}
        self.groups = {"q": call.mesh.q_group, "kv": call.mesh.kv_group}
        self.chunks: dict[str, list[_Chunks]] = {"q": [], "kv": []}

    def post(self, step: RingStep, sends: list[Tensor], recvs: list[Tensor]) -> tuple[list, list[Tensor]]:
        """Post a ring step; return its works and the tensors to keep alive until its wait."""
        works = ring_step(sends, recvs, self.groups[step.ring], tag=0 if step.kind == "move" else 4)
        return works, sends + recvs

    def move(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Pass the chunks of offset ``index - 1`` on and receive those of offset ``index``."""
        held = self.chunks[step.ring]
        return self.post(step, [c[step.index - 1] for c in held], [c.put(step.index) for c in held])

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        raise NotImplementedError

    def land(self, step: RingStep, recv: Tensor) -> None:
        raise NotImplementedError

    def compute(self, i: int, j: int, w: BlockWork) -> None:
        raise NotImplementedError

    def run(self) -> None:
        """Run the actions: post moves and reduce steps, wait for them (landing received partials), compute
        the blocks the mask keeps, and free every chunk after its last use."""
        rank, plan = self.call.mesh.rank, self.call.plan
        inflight: dict[RingStep, tuple[list, list[Tensor]]] = {}
        held = self.chunks["q"] + self.chunks["kv"]
        for t, act in enumerate(self.sched.actions):
            if act.op == "launch":
                inflight[act.step] = (self.move if act.step.kind == "move" else self.reduce)(act.step)
            elif act.op == "wait":
                works, tensors = inflight.pop(act.step)
                for work in works:
                    work.wait()
                if act.step.kind == "reduce":
                    self.land(act.step, tensors[-1])
                del works, tensors
            else:
                w = plan.block_at(rank, *act.block)
                if w is not None:
                    self.compute(*act.block, w)
            for chunks in held:
                chunks.release(t)


class _ForwardPhase(_OverlapPhase):
    """Forward: Q and stacked K, V chunks move; partial ``(o, lse)`` of rows travel along the Q ring and are
    merged on the way."""

    def __init__(self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor) -> None:
        super().__init__(call, "forward")
        keep = call.plan.backward == "reuse"
        self.chunks["q"] = [_Chunks(q, self.sizes["q"], keep, self.sched.last_use("q"))]
        self.chunks["kv"] = [_Chunks(torch.stack((k, v)), self.sizes["kv"], keep, self.sched.last_use("kv"))]
        self.shape, self.acc, self.device = q.shape, acc_dtype(q.dtype), q.device
        self.rows: dict[int, tuple[Tensor, Tensor]] = {}
        """Partial (o, lse) per row offset, created on first use and dropped once sent on."""

    def row(self, i: int) -> tuple[Tensor, Tensor]:
        if i not in self.rows:
            batch, seq, heads, dim = self.shape
            self.rows[i] = (
                torch.zeros((batch, seq, heads, dim), dtype=self.acc, device=self.device),
                torch.full((batch, heads, seq), float("-inf"), dtype=self.acc, device=self.device),
            )
        return self.rows[i]

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send row offset ``s + 1`` (packed), receive offset ``s + 2``."""
        o, lse = self.row(step.index + 1)
        del self.rows[step.index + 1]
        packed = torch.cat((o.reshape(-1), lse.reshape(-1)))
        return self.post(step, [packed], [torch.empty_like(packed)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        batch, seq, heads, dim = self.shape
        target, n_o = (step.index + 2) % self.sizes["q"], batch * seq * heads * dim
        o, lse = recv[:n_o].view(batch, seq, heads, dim), recv[n_o:].view(batch, heads, seq)
        if target in self.rows:
            merge_(*self.rows[target], o, lse)
        else:
            self.rows[target] = (o, lse)

    def compute(self, i: int, j: int, w: BlockWork) -> None:
        o, lse = self.call.forward_block(w, self.chunks["q"][0][i], self.chunks["kv"][0][j])
        o_acc, lse_acc = self.row(i)
        (q0, q1) = w.q_rows
        merge_(o_acc[:, q0:q1], lse_acc[:, :, q0:q1], o, lse)

    def gathered(self) -> tuple[Tensor, ...]:
        keep = self.call.plan.backward == "reuse"
        return (self.chunks["q"][0].store, self.chunks["kv"][0].store) if keep else ()


class _BackwardPhase(_OverlapPhase):
    """Backward: a Q move carries q and dO (or only dO when q is kept from forward) with the rows' lse and
    delta, a KV move K and V (regather only); ``dq`` travels along the Q ring and ``dk, dv`` along the KV
    ring, summed in fp32 on the way."""

    def __init__(self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved) -> None:
        super().__init__(call, "backward")
        q, k = saved.q, saved.k
        acc = acc_dtype(q.dtype)
        stats = torch.stack((saved.lse.to(acc), _row_delta(do, saved.out, dlse)))  # (2, B, Hq, L)
        self.regather = call.plan.backward == "regather"
        q_side = torch.stack((q, do.to(q.dtype))) if self.regather else do.to(q.dtype).contiguous()
        last_q, last_kv = self.sched.last_use("q"), self.sched.last_use("kv")
        self.chunks["q"] = [_Chunks(t, self.sizes["q"], False, last_q) for t in (q_side, stats)]
        if self.regather:
            self.chunks["kv"] = [_Chunks(torch.stack((k, saved.v)), self.sizes["kv"], False, last_kv)]
        self.gathered = saved.gathered
        self.shapes, self.acc, self.device = {"q": q.shape, "kv": (2, *k.shape)}, acc, q.device
        self.grads: dict[str, dict[int, Tensor]] = {"q": {}, "kv": {}}
        """Partial dq per row offset and dk, dv per column offset, created on first use, dropped once sent on."""

    def grad(self, ring: str, offset: int) -> Tensor:
        if offset not in self.grads[ring]:
            self.grads[ring][offset] = torch.zeros(self.shapes[ring], dtype=self.acc, device=self.device)
        return self.grads[ring][offset]

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send offset ``s + 1``'s partial, receive ``s + 2``'s."""
        send = self.grad(step.ring, step.index + 1)
        del self.grads[step.ring][step.index + 1]
        return self.post(step, [send], [torch.empty_like(send)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        target = (step.index + 2) % self.sizes[step.ring]
        grads = self.grads[step.ring]
        if target in grads:
            grads[target] += recv
        else:
            grads[target] = recv

    def compute(self, i: int, j: int, w: BlockWork) -> None:
        main, stats = self.chunks["q"][0][i], self.chunks["q"][1][i]
        q_i, do_i = (main[0], main[1]) if self.regather else (self.gathered[0][i], main)
        kv = self.chunks["kv"][0][j] if self.regather else self.gathered[1][j]
        dq, dk, dv = self.call.backward_block(w, q_i, do_i, stats, kv)
        (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
        self.grad("q", i)[:, q0:q1] += dq
        dkv = self.grad("kv", j)
        dkv[0, :, k0:k1] += dk
        dkv[1, :, k0:k1] += dv


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
        phase = _ForwardPhase(call, q, k, v)
        phase.run()
        return (*phase.row(0), phase.gathered())

    def backward(
        self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved
    ) -> tuple[Tensor, Tensor, Tensor]:
        phase = _BackwardPhase(call, do, dlse, saved)
        phase.run()
        dq, dkv = phase.grad("q", 0), phase.grad("kv", 0)
        return dq.to(saved.q.dtype), dkv[0].to(saved.k.dtype), dkv[1].to(saved.v.dtype)


EXECUTORS: dict[str, Executor] = {e.name: e for e in (OverlapExecutor(), CollectiveExecutor())}
"""Executor per ``schedule`` name (:data:`mesh_cp.core.options.SCHEDULES`)."""
