"""The overlapped schedule's phases on one rank: the chunks held per ring offset, the partial results
reduced along the rings, and the one loop over the schedule's actions (Note [Overlapped schedule] in
:mod:`mesh_cp.core.schedule`). :class:`~mesh_cp.runtime.executors.OverlapExecutor` runs them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mesh_cp.core.numerics import acc_dtype
from mesh_cp.core.program import Program
from mesh_cp.core.schedule import RingStep
from mesh_cp.kernels.fused import added, attention_delta, merged
from mesh_cp.runtime.call import lay, source
from mesh_cp.runtime.comm import ring_step
from mesh_cp.runtime.partials import Partial

if TYPE_CHECKING:
    from collections.abc import Callable

    from mesh_cp.runtime.call import AttentionCall, Pair, Saved


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
        self.programs = call.overlap_programs(call.mesh.mesh_rank, phase)
        self.laid: tuple[Tensor, Tensor] | None = None
        """The phase's layout of keys, laid as the runs need them (Note [Keys laid once per phase] in
        :mod:`mesh_cp.core.program`), dropped after the last run that reads it."""

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

    def lay(self, kv_of: Callable[[int], Pair], prog: Program) -> Pair | None:
        """The keys ``prog``'s calls read: the phase's layout with the rows ``prog`` lays copied in, kept for the next
        runs (a view of one chunk is not kept: it would keep the chunk)."""
        laid = lay(kv_of, prog, self.laid)
        self.laid = None if prog.view else laid
        return laid

    def _computes(self, t: int) -> int:
        """Run the calls of the run of compute actions from ``t`` on that share its Q offset; return the index after
        them.

        Note [Rows of the overlapped schedule]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A Q move unlocks the blocks of the new Q chunk with every KV chunk held, one after the other in the actions
        (Note [Overlapped schedule] in :mod:`mesh_cp.core.schedule`). Two or more of them without a mask are one call
        over a view of the phase's layout of keys, as the collective schedule runs a Q chunk (Note [One call per Q
        chunk] in :mod:`mesh_cp.core.blocks`; Note [Keys laid once per phase] in :mod:`mesh_cp.core.program`); the
        partial row is merged once. A KV move unlocks blocks of different Q chunks, which stay single. The plan holds
        the runs (:meth:`AttentionPlan.overlap_calls`) and their programs (:func:`mesh_cp.core.program.run_program`), so
        the memory model counts the calls that run. Only kernels that take blocks by segments (the flash kernels) run a
        row as one call; on the others a chunk call is one call per row group and diagonal, which saves nothing over the
        blocks. Softcapped logits on a kernel that cannot softcap stay single (tile by tile, reference kernel). Every
        call's outputs go to the partial of its ring offset (:class:`~mesh_cp.runtime.partials.Partial`).
        """
        end, prog = self.programs.runs[t]
        self.compute(prog)
        span = self.programs.layout_span
        if span is not None and end - 1 == span[1]:
            self.laid = None
        return end


class ForwardPhase(OverlapPhase):
    """Forward: Q and K, V chunks move; partial ``(o, lse)`` of rows travel along the Q ring (one buffer each, sent as
    it is) and are merged on the way (Note [Partials as pieces] in :mod:`mesh_cp.runtime.partials`)."""

    def __init__(self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor) -> None:
        super().__init__(call, "forward")
        keep = call.plan.backward == "reuse"
        self.chunks["q"] = [_Chunks(q, self.sizes["q"], keep, self.sched.last_use("q"))]
        self.chunks["kv"] = [_Chunks((k, v), self.sizes["kv"], keep, self.programs.kv_last_use)]
        self.shape, self.acc, self.device = q.shape, acc_dtype(q.dtype), q.device
        self.rows: dict[int, Partial] = {}
        """Partial (o, lse) per row offset, created on first use and dropped once sent on."""
        self.arrived: Tensor | None = None
        """The partial of this rank's own rows from the rest of the ring, merged with its own at the end."""

    def _views(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        return _row_views(self.shape, flat)

    def row(self, i: int) -> Partial:
        if i not in self.rows:
            alloc = functools.partial(_row_buffer, self.shape, self.acc, self.device)  # no cycle through the phase
            self.rows[i] = Partial("merge", alloc, (1, 2), (0.0, float("-inf")), self.shape[1])
        return self.rows[i]

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """This rank's own rows, merged: ``(o, lse)``, ``o`` written in ``dtype`` by the last merge (the lse a tensor
        of its own, so that keeping it for backward does not keep the fp32 rows)."""
        own = self.rows.get(0)
        if self.arrived is None:  # no ring, or every row its own (a row no call reaches holds the identity)
            own = self.row(0)
            o, lse = own.whole_piece() or self._views(own.buffer())
            return o.to(dtype).contiguous(), lse.clone()  # a kernel's output may be a strided view
        arrived = self._views(self.arrived)
        if own is None:  # no block of its own rows is computed here
            return arrived[0].to(dtype), arrived[1].clone()
        piece = own.whole_piece()
        if piece is None:
            own.land(self.arrived, arrived)
            o, lse = own.views
            return o.to(dtype), lse.clone()
        return merged(*piece, *arrived, dtype)

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send row offset ``s + 1``, receive offset ``s + 2``."""
        flat = self.row(step.index + 1).buffer()
        del self.rows[step.index + 1]
        return self.post(step, [flat], [torch.empty_like(flat)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        target = (step.index + 2) % self.sizes["q"]
        if target == 0:
            self.arrived = recv
        elif target in self.rows:
            self.rows[target].land(recv, self._views(recv))
        else:
            self.row(target).adopt(recv, self._views(recv))

    def compute(self, prog: Program) -> None:
        kv = self.chunks["kv"][0]
        laid = self.lay(kv.__getitem__, prog)
        for c in prog.calls:
            o, lse = self.call.forward(c, self.chunks["q"][0][c.slot], source(c, laid, kv.__getitem__))
            self.row(c.slot).write(c.q_rows, (o, lse))
            del o, lse  # before the next call's outputs exist (unless held as a piece)

    def gathered(self) -> tuple[Tensor, ...]:
        keep = self.call.plan.backward == "reuse"
        return (self.chunks["q"][0].store, self.chunks["kv"][0].store) if keep else ()


class BackwardPhase(OverlapPhase):
    """Backward: a Q move carries q and dO (or only dO when q is kept from forward) with the rows' lse and
    delta, a KV move K and V (regather only); ``dq`` travels along the Q ring and ``dk, dv`` along the KV
    ring, summed in fp32 on the way (Note [Partials as pieces] in :mod:`mesh_cp.runtime.partials`)."""

    def __init__(self, call: AttentionCall, do: Tensor, dlse: Tensor | None, saved: Saved) -> None:
        super().__init__(call, "backward")
        q, k = saved.q, saved.k
        acc = acc_dtype(q.dtype)
        stats = (saved.lse.to(acc), attention_delta(do, saved.out, dlse))  # (B, Hq, L) each
        self.regather = call.plan.backward == "regather"
        q_side = (q, do.to(q.dtype)) if self.regather else do.to(q.dtype)
        last_q, last_kv = self.sched.last_use("q"), self.programs.kv_last_use
        self.chunks["q"] = [_Chunks(t, self.sizes["q"], False, last_q) for t in (q_side, stats)]
        if self.regather:
            self.chunks["kv"] = [_Chunks((k, saved.v), self.sizes["kv"], False, last_kv)]
        self.gathered = saved.gathered
        self.shapes, self.acc, self.device = {"q": q.shape, "kv": (2, *k.shape)}, acc, q.device
        self.grads: dict[str, dict[int, Partial]] = {"q": {}, "kv": {}}
        """Partial dq per row offset and dk, dv per column offset, created on first use, dropped once sent on."""
        self.arrived: dict[str, Tensor] = {}
        """Per ring, the partial of this rank's own rows or columns from the rest of the ring, added at the end."""

    def _views(self, ring: str, flat: Tensor) -> tuple[Tensor, ...]:
        return _grad_views(ring, flat)

    def grad(self, ring: str, offset: int) -> Partial:
        if offset not in self.grads[ring]:
            alloc = functools.partial(_grad_buffer, ring, self.shapes[ring], self.acc, self.device)
            views = 1 if ring == "q" else 2
            self.grads[ring][offset] = Partial("sum", alloc, (1,) * views, (0.0,) * views, self.shapes["q"][1])
        return self.grads[ring][offset]

    def result(self, ring: str, dtype: torch.dtype) -> Tensor | tuple[Tensor, ...]:
        """This rank's own ``dq`` (``ring="q"``) or ``dk, dv`` (``"kv"``), summed and written once in ``dtype``."""
        own, arrived = self.grads[ring].get(0), self.arrived.get(ring)
        if arrived is None or own is None:  # one side only (a row no call reaches holds zeros)
            own = self.grad(ring, 0) if arrived is None else None
            values = self._views(ring, arrived) if own is None else own.whole_piece()
            values = values or self._views(ring, own.buffer())
            return _one(tuple(v.to(dtype).contiguous() for v in values))  # a kernel's output may be strided
        piece = own.whole_piece()
        if piece is None:
            own.land(arrived, self._views(ring, arrived))
            return _one(tuple(v.to(dtype) for v in own.views))
        return _one(tuple(added(x, y, dtype) for x, y in zip(piece, self._views(ring, arrived), strict=True)))

    def reduce(self, step: RingStep) -> tuple[list, list[Tensor]]:
        """Send offset ``s + 1``'s partial, receive ``s + 2``'s."""
        send = self.grad(step.ring, step.index + 1).buffer()
        del self.grads[step.ring][step.index + 1]
        return self.post(step, [send], [torch.empty_like(send)])

    def land(self, step: RingStep, recv: Tensor) -> None:
        target = (step.index + 2) % self.sizes[step.ring]
        if target == 0:
            self.arrived[step.ring] = recv
        elif target in self.grads[step.ring]:
            self.grads[step.ring][target].land(recv, self._views(step.ring, recv))
        else:
            self.grad(step.ring, target).adopt(recv, self._views(step.ring, recv))

    def compute(self, prog: Program) -> None:
        kv = self.chunks["kv"][0] if self.regather else self.gathered[1]
        laid = self.lay(kv.__getitem__, prog)
        for c in prog.calls:
            main, stats = self.chunks["q"][0][c.slot], self.chunks["q"][1][c.slot]
            q_i, do_i = (main[0], main[1]) if self.regather else (self.gathered[0][c.slot], main)
            dq, dk, dv = self.call.backward(c, q_i, do_i, stats, source(c, laid, kv.__getitem__))
            self.grad("q", c.slot).write(c.q_rows, (dq,))
            for col, _, (k0, k1), at in c.pieces:
                self.grad("kv", col).write((k0, k1), (dk[:, at : at + k1 - k0], dv[:, at : at + k1 - k0]))
            del dq, dk, dv


def _row_views(shape: torch.Size, flat: Tensor) -> tuple[Tensor, Tensor]:
    """The ``o (B, L, H, D)`` and ``lse (B, H, L)`` views of a row partial's one buffer (sent as one message)."""
    batch, seq, heads, dim = shape
    n_o = batch * seq * heads * dim
    return flat[:n_o].view(batch, seq, heads, dim), flat[n_o:].view(batch, heads, seq)


def _row_buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    batch, seq, heads, dim = shape
    flat = torch.empty(batch * seq * heads * (dim + 1), dtype=dtype, device=device)
    return flat, _row_views(shape, flat)


def _grad_views(ring: str, flat: Tensor) -> tuple[Tensor, ...]:
    """``(dq,)``, or ``(dk, dv)`` of one ``(2, ...)`` buffer."""
    return (flat,) if ring == "q" else (flat[0], flat[1])


def _grad_buffer(ring: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, tuple]:
    flat = torch.empty(shape, dtype=dtype, device=device)
    return flat, _grad_views(ring, flat)


def _one(values: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """A result of one part as the tensor, of two as the pair."""
    return values[0] if len(values) == 1 else values
