"""The overlapped schedule's phases on one rank: the chunks held per ring offset, the partial results
reduced along the rings, and the one loop over the schedule's actions (Note [Overlapped schedule] in
:mod:`mesh_cp.core.schedule`). :class:`~mesh_cp.runtime.executors.OverlapExecutor` runs them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mesh_cp.core.blocks import BlockWork, ChunkCall
from mesh_cp.core.numerics import acc_dtype, attention_delta
from mesh_cp.core.schedule import RingStep
from mesh_cp.kernels import takes
from mesh_cp.kernels.fused import merge_
from mesh_cp.runtime.call import by_segments
from mesh_cp.runtime.comm import ring_step

if TYPE_CHECKING:
    from mesh_cp.runtime.call import AttentionCall, Saved


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


class OverlapPhase:
    """One phase of the overlapped schedule on this rank: the chunks it holds per ring offset, the partial
    results it reduces, and the loop over the schedule's actions.

    A subclass defines what a reduce step sends (``reduce(step)``), where a received partial lands
    (``land(step, recv)``) and what a block computes (``compute(i, j, w)``); moves pass the held chunks of a
    ring on.
    """

    def __init__(self, call: AttentionCall, phase: str) -> None:
        self.call = call
        self.sched, self.phase = call.plan.overlap(phase), phase
        self.sizes = {"q": call.plan.tiling.a, "kv": call.plan.tiling.b}
        self.groups = {"q": call.mesh.q_group, "kv": call.mesh.kv_group}
        self.chunks: dict[str, list[_Chunks]] = {"q": [], "kv": []}

    @functools.cached_property
    def chunked(self) -> bool:
        """The blocks of one Q chunk run as one call: on a kernel that takes them by segments (one varlen call; on
        the others a chunk call is a call per row group and diagonal, no fewer than the blocks), and not softcapped
        logits that go tile by tile to the reference kernel (:meth:`AttentionCall.units`)."""
        kernel = self.call.kernel
        return by_segments(kernel) and (self.call.softcap is None or takes(kernel, "softcap"))

    def post(self, step: RingStep, sends: list[Tensor], recvs: list[Tensor]) -> tuple[list, list[Tensor]]:
        """Post a ring step; return its works and the tensors to keep alive until its wait."""
        works = ring_step(sends, recvs, self.groups[step.ring], tag=0 if step.kind == "move" else 4)
        return works, sends + recvs

    def move(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Pass the chunks of offset ``index - 1`` on and receive those of offset ``index``."""
        held = self.chunks[step.ring]
        return self.post(step, [c[step.index - 1] for c in held], [c.put(step.index) for c in held])

    def run(self) -> None:
        """Run the actions: post moves and reduce steps, wait for them (landing received partials), compute
        the blocks the mask keeps (the blocks of one Q chunk that follow each other as one call: Note [Rows of
        the overlapped schedule]), and free every chunk after its last use."""
        inflight: dict[RingStep, tuple[list, list[Tensor]]] = {}
        held = self.chunks["q"] + self.chunks["kv"]
        actions, t = self.sched.actions, 0
        while t < len(actions):
            act, end = actions[t], t + 1
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
                end = self._computes(t)
            for done in range(t, end):
                for chunks in held:
                    chunks.release(done)
            t = end

    def _computes(self, t: int) -> int:
        """Compute the blocks of the compute actions from ``t`` on that share its Q offset; return the index after
        them.

        Note [Rows of the overlapped schedule]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A Q move unlocks the blocks of the new Q chunk with every KV chunk held, one after the other in the actions
        (Note [Overlapped schedule] in :mod:`mesh_cp.core.schedule`). Two or more of them without a mask are one
        call over their keys laid end to end, as the collective schedule runs a Q chunk (Note [One call per Q chunk]
        in :mod:`mesh_cp.core.blocks`); the partial row is merged once. A KV move unlocks blocks of different Q
        chunks, which stay single. The plan holds the runs (:meth:`AttentionPlan.overlap_calls`), so the memory model
        counts the calls that run. Only kernels that take blocks by segments (the flash kernels) run a row as one
        call; on the others a chunk call is one call per row group and diagonal, which saves nothing over the
        blocks. Softcapped logits on a kernel that cannot softcap stay single (tile by tile, reference kernel).
        """
        rank, plan, actions = self.call.mesh.mesh_rank, self.call.plan, self.sched.actions
        end, call = plan.overlap_calls(rank, self.phase)[t]
        i = actions[t].block[0]
        blocks = [(a.block[1], w) for a in actions[t:end] if (w := plan.block_at(rank, *a.block)) is not None]
        if call is not None and self.chunked:
            self.compute_row(i, {w.y: j for j, w in blocks}, call)
        else:
            for j, w in blocks:
                self.compute(i, j, w)
        return end


class ForwardPhase(OverlapPhase):
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

    def compute_row(self, i: int, offsets: dict[int, int], c: ChunkCall) -> None:
        """The chunk call ``c`` of Q offset ``i``; ``offsets`` maps its KV chunks to their ring offsets."""
        kv = self.chunks["kv"][0]
        o, lse = self.call.forward_chunk(c, self.chunks["q"][0][i], lambda y: kv[offsets[y]])
        o_acc, lse_acc = self.row(i)
        (q0, q1) = c.q_rows
        merge_(o_acc[:, q0:q1], lse_acc[:, :, q0:q1], o, lse)

    def gathered(self) -> tuple[Tensor, ...]:
        keep = self.call.plan.backward == "reuse"
        return (self.chunks["q"][0].store, self.chunks["kv"][0].store) if keep else ()


class BackwardPhase(OverlapPhase):
    """Backward: a Q move carries q and dO (or only dO when q is kept from forward) with the rows' lse and
    delta, a KV move K and V (regather only); ``dq`` travels along the Q ring and ``dk, dv`` along the KV
    ring, summed in fp32 on the way."""

    def __init__(self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved) -> None:
        super().__init__(call, "backward")
        q, k = saved.q, saved.k
        acc = acc_dtype(q.dtype)
        stats = torch.stack((saved.lse.to(acc), attention_delta(do, saved.out, dlse)))  # (2, B, Hq, L)
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

    def compute_row(self, i: int, offsets: dict[int, int], c: ChunkCall) -> None:
        """The backward of :meth:`ForwardPhase.compute_row`."""
        main, stats = self.chunks["q"][0][i], self.chunks["q"][1][i]
        q_i, do_i = (main[0], main[1]) if self.regather else (self.gathered[0][i], main)
        kv = self.chunks["kv"][0] if self.regather else self.gathered[1]
        dq, pieces = self.call.backward_chunk(c, q_i, do_i, stats, lambda y: kv[offsets[y]])
        (q0, q1) = c.q_rows
        self.grad("q", i)[:, q0:q1] += dq
        for y, (k0, k1), dk, dv in pieces:
            dkv = self.grad("kv", offsets[y])
            dkv[0, :, k0:k1] += dk
            dkv[1, :, k0:k1] += dv
