"""Executors of an :class:`~mesh_cp.core.plan.AttentionPlan`.

A schedule turns the plan into communication and kernel calls. Every schedule has the same two
methods, so :class:`~mesh_cp.runtime.attention.MeshAttnFunc` does not care which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype, attention_delta, merge_
from mesh_cp.core.plan import AttentionPlan, BlockWork
from mesh_cp.core.schedule import OverlapSchedule, RingStep
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.runtime.comm import all_gather, all_to_all, ring_step
from mesh_cp.runtime.mesh import CPMesh


class Schedule(Protocol):
    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, mesh: CPMesh, plan: AttentionPlan, kernel: BlockKernel, scale: float
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Return this rank's final ``out (B, L, Hq, D)`` and ``lse (B, Hq, L)`` in the accumulator
        dtype, and the tensors its backward needs beyond q, k, v, out and lse."""
        ...

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dlse: Tensor | None,
        saved: tuple[Tensor, ...],
        *,
        mesh: CPMesh,
        plan: AttentionPlan,
        kernel: BlockKernel,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``dq, dk, dv`` for this rank's chunk, in the dtypes of ``q, k, v``.

        ``dlse (B, Hq, L)`` is the gradient of this rank's lse; ``None`` means none reaches it (the
        block kernels then take the cheaper exact path, Note [Gradient of the lse] in
        :mod:`mesh_cp.kernels.base`; every rank of the mesh must agree on ``None``).
        """
        ...


class CollectiveSchedule:
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
        self, q: Tensor, k: Tensor, v: Tensor, *, mesh: CPMesh, plan: AttentionPlan, kernel: BlockKernel, scale: float
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        rows, cols = _row_col_index(plan, mesh.rank)
        batch, seq, heads, dim = q.shape
        acc = acc_dtype(q.dtype)
        q_all = all_gather(q, mesh.q_group)  # (a, B, L, Hq, D)
        kv_all = all_gather(torch.stack((k, v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)

        a = plan.tiling.a
        o_acc = torch.zeros((a, batch, seq, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((a, batch, heads, seq), float("-inf"), dtype=acc, device=q.device)
        for w in plan.blocks(mesh.rank):
            i, j = rows[w.x], cols[w.y]
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            o, lse = kernel.forward(
                q_all[i, :, q0:q1], kv_all[j, 0, :, k0:k1], kv_all[j, 1, :, k0:k1], causal=w.causal, scale=scale
            )
            merge_(o_acc[i, :, q0:q1], lse_acc[i, :, :, q0:q1], o, lse)

        out, lse = _reduce_rows_to_owners(o_acc, lse_acc, mesh)
        saved = (q_all, kv_all) if plan.backward == "reuse" else ()
        return out, lse, saved

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dlse: Tensor | None,
        saved: tuple[Tensor, ...],
        *,
        mesh: CPMesh,
        plan: AttentionPlan,
        kernel: BlockKernel,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        rows, cols = _row_col_index(plan, mesh.rank)
        acc = acc_dtype(q.dtype)
        delta = _row_delta(do, out, dlse)
        if plan.backward == "regather":
            q_do = all_gather(torch.stack((q, do.to(q.dtype))), mesh.q_group)  # (a, 2, B, L, Hq, D)
            q_all, do_all = q_do[:, 0], q_do[:, 1]
        else:
            q_all, kv_all = saved
            do_all = all_gather(do.to(q.dtype), mesh.q_group)
        stats = all_gather(torch.stack((lse.to(acc), delta)), mesh.q_group)  # (a, 2, B, Hq, L)
        if plan.backward == "regather":
            kv_all = all_gather(torch.stack((k, v)), mesh.kv_group)  # (b, 2, B, L, Hkv, D)

        dq_acc = torch.zeros((plan.tiling.a, *q.shape), dtype=acc, device=q.device)
        dkv_acc = torch.zeros((plan.tiling.b, 2, *k.shape), dtype=acc, device=q.device)
        for w in plan.blocks(mesh.rank):
            i, j = rows[w.x], cols[w.y]
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            dq, dk, dv = kernel.backward(
                do_all[i, :, q0:q1],
                q_all[i, :, q0:q1],
                kv_all[j, 0, :, k0:k1],
                kv_all[j, 1, :, k0:k1],
                stats[i, 0, :, :, q0:q1],
                stats[i, 1, :, :, q0:q1],
                causal=w.causal,
                scale=scale,
                lse_grad=dlse is not None,
            )
            dq_acc[i, :, q0:q1] += dq
            dkv_acc[j, 0, :, k0:k1] += dk
            dkv_acc[j, 1, :, k0:k1] += dv

        dq = all_to_all(dq_acc, mesh.q_group).sum(0)
        dkv = all_to_all(dkv_acc, mesh.kv_group).sum(0)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _row_delta(do: Tensor, out: Tensor, dlse: Tensor | None) -> Tensor:
    """``delta = rowsum(dO * O) - dlse`` of this rank's rows, ``(B, Hq, L)`` in the accumulator dtype.

    A gradient on the lse enters every block as ``delta - dlse`` (``d lse_i / d s_ij = p_ij``; Note
    [Gradient of the lse] in :mod:`mesh_cp.kernels.base`).
    """
    delta = attention_delta(do, out)
    return delta if dlse is None else delta - dlse.to(delta.dtype)


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


class _Rings:
    """This rank's Q ring and KV ring, and its blocks by ring offsets."""

    def __init__(self, mesh: CPMesh, plan: AttentionPlan) -> None:
        self.groups = {"q": mesh.q_group, "kv": mesh.kv_group}
        t = plan.tiling
        self.blocks = {(i, j): plan.block_at(mesh.rank, i, j) for i in range(t.a) for j in range(t.b)}

    def block(self, i: int, j: int) -> BlockWork | None:
        """The kernel call of block ``(q offset i, kv offset j)``; ``None`` when the mask skips it."""
        return self.blocks[(i, j)]

    def post(self, step: RingStep, sends: list[Tensor], recvs: list[Tensor]) -> list:
        return ring_step(sends, recvs, self.groups[step.ring], tag=0 if step.kind == "move" else 4)


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


class OverlappedSchedule:
    """p2p rings inside the Q-group and the KV-group, transfers overlapped with block compute.

    Runs the actions of :meth:`AttentionPlan.overlap` (Note [Overlapped schedule] in
    :mod:`mesh_cp.core.schedule`): moves pass chunks one ring step at a time while the blocks already
    held are computed; partial ``(o, lse)`` of rows travel along the Q ring and are merged on the way
    (forward); ``dq`` travels along the Q ring and ``dk, dv`` along the KV ring, summed in fp32 on the
    way (backward). Sends the same bytes as the collective schedule.
    """

    name = "overlap"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, mesh: CPMesh, plan: AttentionPlan, kernel: BlockKernel, scale: float
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        sched = plan.overlap("forward")
        rings, acc, a = _Rings(mesh, plan), acc_dtype(q.dtype), plan.tiling.a
        keep = plan.backward == "reuse"
        chunks = {
            "q": _Chunks(q, a, keep, sched.last_use("q")),
            "kv": _Chunks(torch.stack((k, v)), plan.tiling.b, keep, sched.last_use("kv")),
        }
        batch, seq, heads, dim = q.shape
        # Partial (o, lse) per row offset, created on first use and dropped once sent on.
        rows: dict[int, tuple[Tensor, Tensor]] = {}

        def row(i: int) -> tuple[Tensor, Tensor]:
            if i not in rows:
                rows[i] = (
                    torch.zeros((batch, seq, heads, dim), dtype=acc, device=q.device),
                    torch.full((batch, heads, seq), float("-inf"), dtype=acc, device=q.device),
                )
            return rows[i]

        def move(step: RingStep) -> tuple[list, list[Tensor]]:
            held = chunks[step.ring]
            sends, recvs = [held[step.index - 1]], [held.put(step.index)]
            return rings.post(step, sends, recvs), sends + recvs

        def reduce(step: RingStep) -> tuple[list, list[Tensor]]:  # send row offset s+1, receive s+2
            o, lse = row(step.index + 1)
            del rows[step.index + 1]
            packed = torch.cat((o.reshape(-1), lse.reshape(-1)))
            recv = torch.empty_like(packed)
            return rings.post(step, [packed], [recv]), [packed, recv]

        def land(step: RingStep, recv: Tensor) -> None:
            target, n_o = (step.index + 2) % a, batch * seq * heads * dim
            o, lse = recv[:n_o].view(batch, seq, heads, dim), recv[n_o:].view(batch, heads, seq)
            if target in rows:
                merge_(*rows[target], o, lse)
            else:
                rows[target] = (o, lse)

        def compute(i: int, j: int) -> None:
            w = rings.block(i, j)
            if w is None:
                return
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            kv = chunks["kv"][j]
            o, lse = kernel.forward(
                chunks["q"][i][:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=w.causal, scale=scale
            )
            o_acc, lse_acc = row(i)
            merge_(o_acc[:, q0:q1], lse_acc[:, :, q0:q1], o, lse)

        _run(sched, move=move, reduce=reduce, land=land, compute=compute, held=list(chunks.values()))
        saved = (chunks["q"].store, chunks["kv"].store) if keep else ()
        return (*row(0), saved)

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dlse: Tensor | None,
        saved: tuple[Tensor, ...],
        *,
        mesh: CPMesh,
        plan: AttentionPlan,
        kernel: BlockKernel,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        sched = plan.overlap("backward")
        rings, acc = _Rings(mesh, plan), acc_dtype(q.dtype)
        a, b = plan.tiling.a, plan.tiling.b
        delta = _row_delta(do, out, dlse)
        stats = torch.stack((lse.to(acc), delta))  # (2, B, Hq, L)
        regather = plan.backward == "regather"
        # What a Q move carries: q and dO with the rows' lse and delta (regather), or dO and the stats
        # when q is kept from forward. A KV move carries K and V (regather only).
        q_side = [torch.stack((q, do.to(q.dtype))) if regather else do.to(q.dtype).contiguous(), stats]
        last_q, last_kv = sched.last_use("q"), sched.last_use("kv")
        held = {"q": [_Chunks(t, a, False, last_q) for t in q_side]}
        if regather:
            held["kv"] = [_Chunks(torch.stack((k, v)), b, False, last_kv)]
        q_all, kv_all = (None, None) if regather else saved

        def q_chunk(i: int) -> tuple[Tensor, Tensor, Tensor]:
            main, st = held["q"][0][i], held["q"][1][i]
            return (main[0], main[1], st) if regather else (q_all[i], main, st)

        def kv_chunk(j: int) -> Tensor:
            return held["kv"][0][j] if regather else kv_all[j]

        # Partial dq per row offset and dk, dv per column offset, created on first use, dropped once sent on.
        grads: dict[str, dict[int, Tensor]] = {"q": {}, "kv": {}}
        shapes = {"q": q.shape, "kv": (2, *k.shape)}
        sizes = {"q": a, "kv": b}

        def grad(ring: str, offset: int) -> Tensor:
            if offset not in grads[ring]:
                grads[ring][offset] = torch.zeros(shapes[ring], dtype=acc, device=q.device)
            return grads[ring][offset]

        def move(step: RingStep) -> tuple[list, list[Tensor]]:
            sends = [c[step.index - 1] for c in held[step.ring]]
            recvs = [c.put(step.index) for c in held[step.ring]]
            return rings.post(step, sends, recvs), sends + recvs

        def reduce(step: RingStep) -> tuple[list, list[Tensor]]:  # send offset s+1's partial, receive s+2's
            send = grad(step.ring, step.index + 1)
            del grads[step.ring][step.index + 1]
            recv = torch.empty_like(send)
            return rings.post(step, [send], [recv]), [send, recv]

        def land(step: RingStep, recv: Tensor) -> None:
            target = (step.index + 2) % sizes[step.ring]
            if target in grads[step.ring]:
                grads[step.ring][target] += recv
            else:
                grads[step.ring][target] = recv

        def compute(i: int, j: int) -> None:
            w = rings.block(i, j)
            if w is None:
                return
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            q_i, do_i, st = q_chunk(i)
            kv = kv_chunk(j)
            dq, dk, dv = kernel.backward(
                do_i[:, q0:q1],
                q_i[:, q0:q1],
                kv[0, :, k0:k1],
                kv[1, :, k0:k1],
                st[0, :, :, q0:q1],
                st[1, :, :, q0:q1],
                causal=w.causal,
                scale=scale,
                lse_grad=dlse is not None,
            )
            grad("q", i)[:, q0:q1] += dq
            dkv = grad("kv", j)
            dkv[0, :, k0:k1] += dk
            dkv[1, :, k0:k1] += dv

        _run(sched, move=move, reduce=reduce, land=land, compute=compute, held=[c for cs in held.values() for c in cs])
        dq, dkv = grad("q", 0), grad("kv", 0)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _run(
    sched: OverlapSchedule,
    *,
    move: Callable[[RingStep], tuple[list, list[Tensor]]],
    reduce: Callable[[RingStep], tuple[list, list[Tensor]]],
    land: Callable[[RingStep, Tensor], None],
    compute: Callable[[int, int], None],
    held: list[_Chunks],
) -> None:
    """Run the actions of ``sched``: post moves and reduce steps (which return their works and the
    tensors to keep alive until the wait), wait and ``land`` received partials, compute blocks, and
    free every chunk after its last use."""
    inflight: dict[RingStep, tuple[list, list[Tensor]]] = {}
    for t, act in enumerate(sched.actions):
        if act.op == "launch":
            inflight[act.step] = (move if act.step.kind == "move" else reduce)(act.step)
        elif act.op == "wait":
            works, tensors = inflight.pop(act.step)
            for work in works:
                work.wait()
            if act.step.kind == "reduce":
                land(act.step, tensors[-1])
            del works, tensors
        else:
            compute(*act.block)
        for chunks in held:
            chunks.release(t)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (OverlappedSchedule(), CollectiveSchedule())}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]
