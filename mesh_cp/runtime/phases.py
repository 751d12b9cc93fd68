"""The overlapped schedule's phases on one rank: the chunks held per ring offset, the partial results
reduced along the rings, and the one loop over the schedule's actions (Note [Overlapped schedule] in
:mod:`mesh_cp.core.schedule`). :class:`~mesh_cp.runtime.executors.OverlapExecutor` runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype
from mesh_cp.core.program import Program
from mesh_cp.core.schedule import RingStep
from mesh_cp.kernels.fused import attention_delta, merge_, merged
from mesh_cp.runtime.call import accumulate, add_key_grads, lay, source, write_rows
from mesh_cp.runtime.comm import ring_step

if TYPE_CHECKING:
    from mesh_cp.runtime.call import AttentionCall, Saved


class _Chunks:
    """Chunks held per ring offset, dropped after their last use unless kept for backward.

    A chunk is one tensor, or a tuple of parts of one shape (K and V; q and dO; lse and delta) that travel as one
    message each, so that the rank's own parts are sent as they are, never stacked first. A received chunk of parts
    is one ``(parts, ...)`` buffer. With ``keep`` the chunks live in one preallocated ``(n, ...)`` tensor (what
    backward reuses); otherwise each offset gets its own buffer, freed after the action that last needs it.
    """

    def __init__(self, first: Tensor | tuple[Tensor, ...], n: int, keep: bool, last_use: dict[int, int]) -> None:
        self.keep, self.last_use, self.parts = keep, last_use, isinstance(first, tuple)
        one = first[0] if self.parts else first
        self.shape = (len(first), *one.shape) if self.parts else one.shape
        self.dtype, self.device = one.dtype, one.device
        self.store = torch.empty((n, *self.shape), dtype=self.dtype, device=self.device) if keep else None
        self.held: dict[int, Tensor | tuple[Tensor, ...]] = {}
        self.put(0, first)

    def put(self, offset: int, value: Tensor | tuple[Tensor, ...] | None = None) -> Tensor | tuple[Tensor, ...]:
        """Hold ``value`` at ``offset`` (or an empty receive buffer shaped like offset 0); return it."""
        if self.store is not None:
            buf = self.store[offset]
            if value is not None:
                for part, x in zip(self.messages(buf), self.messages(value), strict=True):
                    part.copy_(x)
        elif value is not None:
            buf = value  # as it is: a ring step sends a contiguous copy only of what is not
        else:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.held[offset] = buf
        return buf

    def messages(self, chunk: Tensor | tuple[Tensor, ...]) -> list[Tensor]:
        """What a ring step sends or receives of ``chunk``: its parts, or the tensor."""
        return list(chunk) if self.parts else [chunk]

    def __getitem__(self, offset: int) -> Tensor | tuple[Tensor, ...]:
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

    def post(self, step: RingStep, sends: list[Tensor], recvs: list[Tensor]) -> tuple[list, list[Tensor]]:
        """Post a ring step; return its works and the tensors to keep alive until its wait."""
        works = ring_step(sends, recvs, self.groups[step.ring], tag=0 if step.kind == "move" else 4)
        return works, sends + recvs

    def move(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Pass the chunks of offset ``index - 1`` on and receive those of offset ``index``."""
        held = self.chunks[step.ring]
        sends = [m.contiguous() for c in held for m in c.messages(c[step.index - 1])]
        return self.post(step, sends, [m for c in held for m in c.messages(c.put(step.index))])

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
        """Run the calls of the run of compute actions from ``t`` on that share its Q offset; return the index after
        them.

        Note [Rows of the overlapped schedule]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A Q move unlocks the blocks of the new Q chunk with every KV chunk held, one after the other in the actions
        (Note [Overlapped schedule] in :mod:`mesh_cp.core.schedule`). Two or more of them without a mask are one
        call over their keys laid end to end, as the collective schedule runs a Q chunk (Note [One call per Q chunk]
        in :mod:`mesh_cp.core.blocks`); the partial row is merged once. A KV move unlocks blocks of different Q
        chunks, which stay single. The plan holds the runs (:meth:`AttentionPlan.overlap_calls`) and their programs
        (:func:`mesh_cp.core.program.run_program`), so the memory model counts the calls that run. Only kernels that
        take blocks by segments (the flash kernels) run a row as one call; on the others a chunk call is one call per
        row group and diagonal, which saves nothing over the blocks. Softcapped logits on a kernel that cannot
        softcap stay single (tile by tile, reference kernel). Every call writes straight into the phase's
        accumulator of its ring offset (:class:`_Acc`).
        """
        end, prog = self.call.run(self.call.mesh.mesh_rank, self.phase, t)
        self.compute(prog)
        return end


class _Acc:
    """The partial results of one ring offset: tensors allocated without values, and the rows written so far, so that
    a first write is a copy, a later one a merge or a sum, and only rows nothing wrote are filled (Note [First
    writes] in :mod:`mesh_cp.core.blocks`). ``views`` of ``flat`` hold their rows along ``dims``, filled with
    ``fills``."""

    def __init__(self, flat: Tensor, views: tuple[Tensor, ...], dims: tuple[int, ...], fills: tuple[float, ...]):
        self.flat, self.views, self.dims, self.fills = flat, views, dims, fills
        self.size = views[0].shape[dims[0]]
        self.spans: list[tuple[int, int]] = []

    @classmethod
    def written(cls, flat: Tensor, views: tuple[Tensor, ...], dims: tuple[int, ...]) -> _Acc:
        """An accumulator whose every row holds values (a partial received whole)."""
        acc = cls(flat, views, dims, (0.0,) * len(views))
        acc.spans = [(0, acc.size)]
        return acc

    def prepare(self, rows: tuple[int, int]) -> bool:
        """Before writing ``rows``: whether it is a first write (none of them written); otherwise the rows among them
        nothing wrote are filled with the identity, and the write merges or adds."""
        start, stop = rows
        if all(stop <= s0 or s1 <= start for s0, s1 in self.spans):
            self.spans.append(rows)
            return True
        self._fill(start, stop)
        return False

    def finish(self) -> Tensor:
        """Fill every row nothing wrote; return the whole buffer."""
        self._fill(0, self.size)
        return self.flat

    def _fill(self, start: int, stop: int) -> None:
        at = start
        for s0, s1 in sorted(self.spans):
            if s1 <= at or s0 >= stop:
                continue
            if s0 > at:
                self._fill_rows(at, s0)
            at = max(at, s1)
        if at < stop:
            self._fill_rows(at, stop)
        self.spans.append((start, stop))

    def _fill_rows(self, start: int, stop: int) -> None:
        for view, dim, fill in zip(self.views, self.dims, self.fills, strict=True):
            view.narrow(dim, start, stop - start).fill_(fill)


class ForwardPhase(OverlapPhase):
    """Forward: Q and stacked K, V chunks move; partial ``(o, lse)`` of rows travel along the Q ring (one buffer each,
    sent as it is) and are merged on the way."""

    def __init__(self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor) -> None:
        super().__init__(call, "forward")
        keep = call.plan.backward == "reuse"
        self.chunks["q"] = [_Chunks(q, self.sizes["q"], keep, self.sched.last_use("q"))]
        self.chunks["kv"] = [_Chunks((k, v), self.sizes["kv"], keep, self.sched.last_use("kv"))]
        self.shape, self.acc, self.device = q.shape, acc_dtype(q.dtype), q.device
        self.rows: dict[int, _Acc] = {}
        """Partial (o, lse) per row offset, created on first use and dropped once sent on."""
        self.arrived: Tensor | None = None
        """The partial of this rank's own rows from the rest of the ring, merged with its own at the end."""

    def _views(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        batch, seq, heads, dim = self.shape
        n_o = batch * seq * heads * dim
        return flat[:n_o].view(batch, seq, heads, dim), flat[n_o:].view(batch, heads, seq)

    def row(self, i: int) -> _Acc:
        if i not in self.rows:
            batch, seq, heads, dim = self.shape
            flat = torch.empty(batch * seq * heads * (dim + 1), dtype=self.acc, device=self.device)
            self.rows[i] = _Acc(flat, self._views(flat), (1, 2), (0.0, float("-inf")))
        return self.rows[i]

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """This rank's own rows, merged: ``(o, lse)``, ``o`` written in ``dtype`` by the last merge (the lse a tensor
        of its own, so that keeping it for backward does not keep the fp32 rows)."""
        if self.arrived is not None and 0 not in self.rows:  # no block of its own rows is computed here
            o, lse = self._views(self.arrived)
            return o.to(dtype), lse.clone()
        o, lse = self._views(self.row(0).finish())
        if self.arrived is None:
            return o.to(dtype), lse.clone()
        return merged(o, lse, *self._views(self.arrived), dtype)

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send row offset ``s + 1``, receive offset ``s + 2``."""
        flat = self.row(step.index + 1).finish()
        del self.rows[step.index + 1]
        return self.post(step, [flat], [torch.empty_like(flat)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        target = (step.index + 2) % self.sizes["q"]
        if target == 0:
            self.arrived = recv
        elif target in self.rows:
            row = self.rows[target]
            row.finish()
            merge_(*row.views, *self._views(recv))
        else:
            self.rows[target] = _Acc.written(recv, self._views(recv), (1, 2))

    def compute(self, prog: Program) -> None:
        kv = self.chunks["kv"][0]
        laid = lay(kv.__getitem__, prog)
        for c in prog.calls:
            o, lse = self.call.forward(c, self.chunks["q"][0][c.slot], source(c, laid, kv.__getitem__))
            row, (q0, q1) = self.row(c.slot), c.q_rows
            o_acc, lse_acc = row.views
            write_rows(o_acc[:, q0:q1], lse_acc[:, :, q0:q1], o, lse, row.prepare(c.q_rows))
            del o, lse  # before the next call's outputs exist

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
        stats = (saved.lse.to(acc), attention_delta(do, saved.out, dlse))  # (B, Hq, L) each
        self.regather = call.plan.backward == "regather"
        q_side = (q, do.to(q.dtype)) if self.regather else do.to(q.dtype).contiguous()
        last_q, last_kv = self.sched.last_use("q"), self.sched.last_use("kv")
        self.chunks["q"] = [_Chunks(t, self.sizes["q"], False, last_q) for t in (q_side, stats)]
        if self.regather:
            self.chunks["kv"] = [_Chunks((k, saved.v), self.sizes["kv"], False, last_kv)]
        self.gathered = saved.gathered
        self.shapes, self.acc, self.device = {"q": q.shape, "kv": (2, *k.shape)}, acc, q.device
        self.grads: dict[str, dict[int, _Acc]] = {"q": {}, "kv": {}}
        """Partial dq per row offset and dk, dv per column offset, created on first use, dropped once sent on."""
        self.arrived: dict[str, Tensor] = {}
        """Per ring, the partial of this rank's own rows or columns from the rest of the ring, added at the end."""

    def grad(self, ring: str, offset: int) -> _Acc:
        if offset not in self.grads[ring]:
            flat = torch.empty(self.shapes[ring], dtype=self.acc, device=self.device)
            self.grads[ring][offset] = _Acc(flat, (flat,), (1 if ring == "q" else 2,), (0.0,))
        return self.grads[ring][offset]

    def result(self, ring: str, dtype: torch.dtype) -> Tensor:
        """This rank's own ``dq`` (``ring="q"``) or stacked ``dk, dv`` (``"kv"``), summed and written once in
        ``dtype``."""
        arrived = self.arrived.get(ring)
        if arrived is not None and 0 not in self.grads[ring]:  # no block of its own rows or columns is computed here
            return arrived.to(dtype)
        own = self.grad(ring, 0).finish()
        if arrived is None:
            return own.to(dtype)
        return torch.add(own, arrived, out=torch.empty(own.shape, dtype=dtype, device=own.device))

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send offset ``s + 1``'s partial, receive ``s + 2``'s."""
        send = self.grad(step.ring, step.index + 1).finish()
        del self.grads[step.ring][step.index + 1]
        return self.post(step, [send], [torch.empty_like(send)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        target = (step.index + 2) % self.sizes[step.ring]
        grads = self.grads[step.ring]
        if target == 0:
            self.arrived[step.ring] = recv
        elif target in grads:
            grads[target].finish().add_(recv)
        else:
            grads[target] = _Acc.written(recv, (recv,), (1 if step.ring == "q" else 2,))

    def compute(self, prog: Program) -> None:
        kv = self.chunks["kv"][0] if self.regather else self.gathered[1]
        laid = lay(kv.__getitem__, prog)
        for c in prog.calls:
            main, stats = self.chunks["q"][0][c.slot], self.chunks["q"][1][c.slot]
            q_i, do_i = (main[0], main[1]) if self.regather else (self.gathered[0][c.slot], main)
            dq, dk, dv = self.call.backward(c, q_i, do_i, stats, source(c, laid, kv.__getitem__))
            g = self.grad("q", c.slot)
            accumulate(g.flat[:, c.q_rows[0] : c.q_rows[1]], dq, g.prepare(c.q_rows))
            first = tuple(self.grad("kv", col).prepare(rows) for col, _, rows, _ in c.pieces)
            add_key_grads(lambda j: self.grad("kv", j).flat, c, dk, dv, first)
            del dq, dk, dv
