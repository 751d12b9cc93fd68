"""One attention call as the executors see it: the mesh, the plan, the kernel, the scale, and the rank programs
they replay (Note [Rank programs] in :mod:`mesh_cp.core.program`): which kernel calls run, over which rows and keys,
into which accumulators.

Note [Host work per plan]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every layer calls the attention with the same plan (cached by :func:`~mesh_cp.core.plan.make_plan`) and makes the
same kernel calls. They are decided on the host once per plan, rank, schedule step and what the kernel takes, as a
:class:`~mesh_cp.core.program.Program` the plan keeps; a layer runs only the tensor ops of its calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import visibility
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.core.program import (
    Call,
    KernelMode,
    OverlapPrograms,
    Program,
    overlap_programs,
    rank_program,
    run_program,
    units,
)
from mesh_cp.core.row_partials import rows_as_computed
from mesh_cp.kernels import capabilities_of
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.kernels.fused import merge_
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.runtime.mesh import CPMesh

_REFERENCE = ReferenceKernel()


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What one attention call runs with, the same in forward and backward (kept on the autograd ``ctx``): the
    mesh, the plan of the whole call (head exchange and blocks), the kernel and the scale. The executor of the
    blocks is chosen by the plan's ``schedule`` (:data:`mesh_cp.runtime.executors.EXECUTORS`)."""

    mesh: CPMesh
    plan: AttentionPlan
    kernel: BlockKernel
    scale: float
    lse_grad: bool = False
    """The lse may receive a gradient (``return_lse``): the block kernels take the exact path for any
    ``dlse`` (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`). Equal on every rank."""
    softcap: float | None = None
    """Logits ``softcap * tanh(s / softcap)``: blocks go to the kernel when it takes ``"softcap"``, else tile by tile
    to the reference kernel."""
    doc_ids: Tensor | None = None
    """``(B, S)`` document of every global position (``-1``: padding) when the plan has a mask and the kernel builds dense
    masks (``None`` for a kernel that takes every masked block as segments)."""

    @functools.cached_property
    def mode(self) -> KernelMode:
        """What the calls depend on beside the plan: the kernel's keywords and gaps, and the softcap."""
        caps = capabilities_of(self.kernel)
        return KernelMode(caps.keywords, self.softcap, caps.gaps)

    def program(self, rank: int) -> Program:
        """``rank``'s calls in the collective schedule (Note [Rank programs])."""
        return rank_program(self.plan, rank, self.mode)

    def run(self, rank: int, phase: str, t: int) -> tuple[int, Program]:
        """The run of compute actions of the overlapped schedule from action ``t`` of ``phase``: ``(end,
        program)``."""
        return run_program(self.plan, rank, phase, t, self.mode)

    def overlap_programs(self, rank: int, phase: str) -> OverlapPrograms:
        """The programs of every run of ``phase`` of the overlapped schedule on ``rank``, over one layout of the
        phase."""
        return overlap_programs(self.plan, rank, phase, self.mode)

    def units(self, rank: int) -> tuple:
        """``rank``'s blocks and chunk calls in the collective schedule (Note [One call per Q chunk])."""
        return units(self.plan, rank, self.mode)

    def kernel_calls(self, rank: int) -> int:
        """Kernel ``forward`` calls of ``rank``'s forward in the collective schedule (each phase makes as many)."""
        return len(self.program(rank).calls)

    def forward(self, c: Call, q: Tensor, kv: Pair) -> tuple[Tensor, Tensor]:
        """``(o, lse)`` of call ``c`` from its whole Q chunk ``q (B, L, H, D)`` and its key source ``kv``, K and V
        ``(B, N, Hkv, D)`` (the phase's layout, or its KV chunk)."""
        (q0, q1), (k0, k1) = c.q_rows, c.keys
        kernel = _REFERENCE if c.reference else self.kernel
        k, v = rows(kv, 1, k0, k1)
        return kernel.forward(q[:, q0:q1], k, v, causal=c.causal, scale=self.scale, **self._extra(c))

    def backward(self, c: Call, q: Tensor, do: Tensor, stats: Pair, kv: Pair) -> tuple[Tensor, Tensor, Tensor]:
        """``dq`` of its rows and ``dk, dv`` of its keys for call ``c``; ``stats`` the rows' lse and delta ``(B, H,
        L)``."""
        (q0, q1), (k0, k1) = c.q_rows, c.keys
        kernel = _REFERENCE if c.reference else self.kernel
        (k, v), (lse, delta) = rows(kv, 1, k0, k1), rows(stats, 2, q0, q1)
        options = {"causal": c.causal, "scale": self.scale, "lse_grad": self.lse_grad}
        return kernel.backward(do[:, q0:q1], q[:, q0:q1], k, v, lse, delta, **options, **self._extra(c))

    def _extra(self, c: Call) -> dict:
        """The keywords of call ``c``: its program's, and a tile's mask, built now from the document ids."""
        if not c.mask:
            return c.extra
        ((_, y, kv_rows, _),) = c.pieces
        return {**c.extra, "mask": self._tile_mask(c.x, y, c.q_rows, kv_rows)}

    def _tile_mask(self, x: int, y: int, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> Tensor:
        q_pos, k_pos = self._global_positions(x, q_rows), self._global_positions(y, kv_rows)
        return visibility(self.doc_ids, q_pos, k_pos, causal=self.plan.causal, window=self.plan.mask.window)

    def _global_positions(self, chunk: int, rows: tuple[int, int]) -> Tensor:
        """Global positions of the local rows ``rows`` of ``chunk``, on the device of :attr:`doc_ids`."""
        plan = self.plan
        positions = _chunk_positions(plan.seq_len, plan.tiling.world, chunk, plan.layout, self.doc_ids.device)
        return positions[rows[0] : rows[1]]


@functools.lru_cache(maxsize=256)
def _chunk_positions(seq_len: int, world: int, chunk: int, layout: str, device: torch.device) -> Tensor:
    """The global positions of ``chunk``'s rows on ``device``, built once: they depend on the call shape, not on the
    mask, so a new packing on every step (a new :class:`AttentionCall` in every layer) copies none to the device. Do
    not write to it."""
    return torch.tensor(local_positions(seq_len, world, chunk, layout), dtype=torch.int64, device=device)


def by_segments(kernel: BlockKernel) -> bool:
    """The kernel takes ``segments`` and no dense ``mask``, as the flash kernels do: a chunk call is one varlen call
    and a masked block one call of its documents or its runs. A kernel that also takes masks (the reference kernel)
    runs chunk calls group by group with its own causal flag and masked tiles with masks it builds on the device from
    :attr:`AttentionCall.doc_ids`, so no dense mask is built from segments on the host."""
    return KernelMode(capabilities_of(kernel).keywords).by_segments


def row_partials(plan: AttentionPlan, kernel: BlockKernel, softcap: float | None) -> str:
    """The plan's ``partials`` for ``kernel``: ``"input"`` where the collective schedule sends row partials as the
    kernel returns them (Note [Partials as computed] in :mod:`mesh_cp.core.row_partials`): every rank computes each
    Q chunk in one call of a kernel that returns ``dq`` in the input dtype, and no gradient reaches the lse (whose
    exact path may return ``dq`` wider)."""
    caps = capabilities_of(kernel)
    if plan.schedule != "collective" or not caps.dq_in_input_dtype or plan.return_lse:
        return "accumulator"
    return "input" if rows_as_computed(plan, KernelMode(caps.keywords, softcap, caps.gaps)) else "accumulator"


def write_rows(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor, first: bool) -> None:
    """Write a partial ``(o, lse)`` into accumulator rows: a copy for a first write (Note [First writes]), else the
    LSE merge."""
    if first:
        o_acc.copy_(o)
        lse_acc.copy_(lse)
    else:
        merge_(o_acc, lse_acc, o, lse)


def accumulate(acc: Tensor, x: Tensor, first: bool) -> None:
    """Add a partial gradient into accumulator rows in place: a copy for a first write (Note [First writes])."""
    if first:
        acc.copy_(x)
    else:
        acc.add_(x)


def fill_unwritten(
    views: tuple[tuple[Tensor, int, float], ...], fills: tuple[tuple[int, int, int], ...] | None
) -> None:
    """Fill the rows of accumulators allocated without values that no first write covers (Note [First writes]):
    ``views`` ``(acc, dim, identity)``, ``acc`` indexed by slot, its rows along ``dim`` of a slot; ``fills`` the
    program's ``(slot, start, stop)`` (``None``: every row, for chunks that are not the plan's)."""
    for acc, dim, identity in views:
        if fills is None:
            acc.fill_(identity)
            continue
        for slot, start, stop in fills:
            acc[slot].narrow(dim, start, stop - start).fill_(identity)


Pair = Tensor | tuple[Tensor, Tensor]
"""Two tensors of one shape read as ``pair[0]``, ``pair[1]`` (K and V, lse and delta): a tuple, or a ``(2, ...)`` tensor
(stacked, or a view of two parts gathered into one buffer, :func:`mesh_cp.runtime.comm.all_gather_stacked`)."""


def rows(pair: Pair, dim: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """The rows ``start:stop`` along ``dim`` of both tensors of ``pair``."""
    return pair[0].narrow(dim, start, stop - start), pair[1].narrow(dim, start, stop - start)


def lay(kv_of: Callable[[int], Pair], prog: Program, laid: Pair | None = None) -> Pair | None:
    """The keys of ``prog``'s layout (rows of the K, V chunks ``kv_of(col)``, ``(B, L, Hkv, D)`` each): ``laid``, the
    phase's layout so far, or a new one, with the rows the program lays copied in (K and V ``(B, N, Hkv, D)``); views
    when the layout is one run of one chunk (``None`` for none; Note [Keys in global order] in
    :mod:`mesh_cp.core.key_layout`, Note [Keys laid once per phase] in :mod:`mesh_cp.core.program`)."""
    if not prog.runs:
        return None
    if prog.view:
        col, k0, k1 = prog.runs[0]
        return rows(kv_of(col), 1, k0, k1)
    for col, k0, k1, at in prog.lays:
        chunk = kv_of(col)
        if laid is None:
            # rows later runs lay may sit between this run's sequences: zeros, not whatever the memory held (a kernel
            # that reads the rows between sequences, masked, must not meet a NaN there)
            new = torch.empty if prog.laid_rows == prog.layout_rows else torch.zeros
            batch, _, heads, dim = chunk[0].shape
            buf = new((2, batch, prog.layout_rows, heads, dim), dtype=chunk[0].dtype, device=chunk[0].device)
            laid = (buf[0], buf[1])
        for i in (0, 1):
            laid[i][:, at : at + k1 - k0].copy_(chunk[i][:, k0:k1])
    return laid


def add_key_grads(dkv_of: Callable[[int], Tensor], c: Call, dk: Tensor, dv: Tensor, first: tuple[bool, ...]) -> None:
    """Write the ``dk, dv`` of call ``c`` (over its keys) into the key-row accumulators ``dkv_of(col) (2, B, L, Hkv,
    D)`` of its pieces: a copy for a first write, else a sum."""
    for (col, _, (k0, k1), at), f in zip(c.pieces, first, strict=True):
        acc = dkv_of(col)
        accumulate(acc[0, :, k0:k1], dk[:, at : at + k1 - k0], f)
        accumulate(acc[1, :, k0:k1], dv[:, at : at + k1 - k0], f)


def source(c: Call, laid: Pair | None, kv_of: Callable[[int], Pair]) -> Pair:
    """The keys call ``c`` reads a view of: the phase's layout, or its KV chunk."""
    return laid if c.laid else kv_of(c.pieces[0][0])


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
