"""One attention call as the executors see it: the mesh, the plan, the kernel, the scale, and how every block of
the plan becomes kernel calls (masked blocks cut into tiles; Note [Masked blocks] in :mod:`mesh_cp.core.masks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import acc_dtype, merge_, visibility
from mesh_cp.core.plan import AttentionPlan, BlockWork, MaskKind
from mesh_cp.kernels.base import BlockKernel
from mesh_cp.kernels.reference import ReferenceKernel
from mesh_cp.runtime.mesh import CPMesh

if TYPE_CHECKING:
    from mesh_cp.runtime.executors import Executor

_REFERENCE = ReferenceKernel()


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What one attention call runs with, the same in forward and backward (kept on the autograd ``ctx``)."""

    mesh: CPMesh
    plan: AttentionPlan
    kernel: BlockKernel
    scale: float
    lse_grad: bool = False
    """The lse may receive a gradient (``return_lse``): the block kernels take the exact path for any
    ``dlse`` (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`). Equal on every rank."""
    softcap: float | None = None
    """Logits ``softcap * tanh(s / softcap)``: every block goes through the reference kernel, which does it."""
    doc_ids: Tensor | None = None
    """``(B, S)`` document of every global position (``-1``: padding) when the plan has a mask."""
    _positions: dict = field(default_factory=dict, repr=False)

    @property
    def executor(self) -> Executor:
        from mesh_cp.runtime.executors import EXECUTORS

        return EXECUTORS[self.plan.schedule]

    def forward_block(self, w: BlockWork, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(o, lse)`` of block ``w`` (rows ``w.q_rows``) from the whole Q chunk ``q (B, L, H, D)`` and the
        stacked K, V chunk ``kv (2, B, L, Hkv, D)``."""
        if w.kind is not MaskKind.MASKED:
            kernel, extra = self._kernel(None)
            (q0, q1), (k0, k1) = w.q_rows, w.kv_rows
            return kernel.forward(
                q[:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=w.causal, scale=self.scale, **extra
            )
        (qa, qb), acc = w.q_rows, acc_dtype(q.dtype)
        batch, _, heads, dim = q.shape
        o_acc = torch.zeros((batch, qb - qa, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((batch, heads, qb - qa), float("-inf"), dtype=acc, device=q.device)
        for (q0, q1), (k0, k1), kind in self.plan.tiles(w):
            kernel, extra = self._kernel(self._tile_mask(w, (q0, q1), (k0, k1), kind))
            o, lse = kernel.forward(
                q[:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=kind == "causal", scale=self.scale, **extra
            )
            merge_(o_acc[:, q0 - qa : q1 - qa], lse_acc[:, :, q0 - qa : q1 - qa], o, lse)
        return o_acc, lse_acc

    def backward_block(
        self, w: BlockWork, q: Tensor, do: Tensor, stats: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` of block ``w`` (shaped like its rows and columns) from whole chunks; ``stats
        (2, B, H, L)`` holds the rows' lse and delta."""
        if w.kind is not MaskKind.MASKED:
            return self._backward_call(w.q_rows, w.kv_rows, "causal" if w.causal else "full", None, q, do, stats, kv)
        (qa, qb), (ka, kb), acc = w.q_rows, w.kv_rows, acc_dtype(q.dtype)
        dq = torch.zeros((q.shape[0], qb - qa, *q.shape[2:]), dtype=acc, device=q.device)
        dkv = torch.zeros((2, kv.shape[1], kb - ka, *kv.shape[3:]), dtype=acc, device=q.device)
        for (q0, q1), (k0, k1), kind in self.plan.tiles(w):
            mask = self._tile_mask(w, (q0, q1), (k0, k1), kind)
            dq_t, dk_t, dv_t = self._backward_call((q0, q1), (k0, k1), kind, mask, q, do, stats, kv)
            dq[:, q0 - qa : q1 - qa] += dq_t
            dkv[0, :, k0 - ka : k1 - ka] += dk_t
            dkv[1, :, k0 - ka : k1 - ka] += dv_t
        return dq, dkv[0], dkv[1]

    def _backward_call(self, q_rows, kv_rows, kind: str, mask, q, do, stats, kv) -> tuple[Tensor, Tensor, Tensor]:
        (q0, q1), (k0, k1) = q_rows, kv_rows
        kernel, extra = self._kernel(mask)
        return kernel.backward(
            do[:, q0:q1],
            q[:, q0:q1],
            kv[0, :, k0:k1],
            kv[1, :, k0:k1],
            stats[0, :, :, q0:q1],
            stats[1, :, :, q0:q1],
            causal=kind == "causal",
            scale=self.scale,
            lse_grad=self.lse_grad,
            **extra,
        )

    def _kernel(self, mask: Tensor | None) -> tuple[BlockKernel, dict]:
        """The kernel of one call and its extra arguments: softcapped logits always go to the reference kernel;
        an explicit mask to the call's kernel when it ``takes_mask``, else to the reference kernel."""
        if self.softcap is not None:
            return _REFERENCE, {"mask": mask, "softcap": self.softcap}
        if mask is None:
            return self.kernel, {}
        return (self.kernel if getattr(self.kernel, "takes_mask", False) else _REFERENCE), {"mask": mask}

    def _tile_mask(self, w: BlockWork, q_rows: tuple[int, int], kv_rows: tuple[int, int], kind: str) -> Tensor | None:
        if kind != "masked":
            return None
        q_pos, k_pos = self._global_positions(w.x, q_rows), self._global_positions(w.y, kv_rows)
        return visibility(self.doc_ids, q_pos, k_pos, causal=self.plan.causal, window=self.plan.mask.window)

    def _global_positions(self, chunk: int, rows: tuple[int, int]) -> Tensor:
        """Global positions of the local rows ``rows`` of ``chunk``, on the device of :attr:`doc_ids`."""
        if chunk not in self._positions:
            plan = self.plan
            positions = local_positions(plan.seq_len, plan.tiling.world, chunk, plan.layout)
            self._positions[chunk] = torch.tensor(positions, dtype=torch.int64, device=self.doc_ids.device)
        return self._positions[chunk][rows[0] : rows[1]]


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
