"""One attention call as the executors see it: the mesh, the plan, the kernel, the scale, and how every block of
the plan becomes kernel calls (masked blocks cut into tiles; Note [Masked blocks] in :mod:`mesh_cp.core.masks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mesh_cp.core.blocks import BlockWork, MaskKind
from mesh_cp.core.layout import local_positions
from mesh_cp.core.numerics import acc_dtype, merge_, visibility
from mesh_cp.core.plan import AttentionPlan
from mesh_cp.kernels import takes
from mesh_cp.kernels.base import BlockKernel
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
    """``(B, S)`` document of every global position (``-1``: padding) when the plan has a mask."""
    _positions: dict = field(default_factory=dict, repr=False)

    def forward_block(self, w: BlockWork, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(o, lse)`` of block ``w`` (rows ``w.q_rows``) from the whole Q chunk ``q (B, L, H, D)`` and the
        stacked K, V chunk ``kv (2, B, L, Hkv, D)``."""
        if not self._tiled(w):
            return self._forward_call(w, w.q_rows, w.kv_rows, "causal" if w.causal else "full", q, kv)
        (qa, qb), acc = w.q_rows, acc_dtype(q.dtype)
        batch, _, heads, dim = q.shape
        o_acc = torch.zeros((batch, qb - qa, heads, dim), dtype=acc, device=q.device)
        lse_acc = torch.full((batch, heads, qb - qa), float("-inf"), dtype=acc, device=q.device)
        for (q0, q1), kv_rows, kind in self.plan.tiles(w):
            o, lse = self._forward_call(w, (q0, q1), kv_rows, kind, q, kv)
            merge_(o_acc[:, q0 - qa : q1 - qa], lse_acc[:, :, q0 - qa : q1 - qa], o, lse)
        return o_acc, lse_acc

    def backward_block(
        self, w: BlockWork, q: Tensor, do: Tensor, stats: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` of block ``w`` (shaped like its rows and columns) from whole chunks; ``stats
        (2, B, H, L)`` holds the rows' lse and delta."""
        if not self._tiled(w):
            return self._backward_call(w, w.q_rows, w.kv_rows, "causal" if w.causal else "full", q, do, stats, kv)
        (qa, qb), (ka, kb), acc = w.q_rows, w.kv_rows, acc_dtype(q.dtype)
        dq = torch.zeros((q.shape[0], qb - qa, *q.shape[2:]), dtype=acc, device=q.device)
        dkv = torch.zeros((2, kv.shape[1], kb - ka, *kv.shape[3:]), dtype=acc, device=q.device)
        for (q0, q1), (k0, k1), kind in self.plan.tiles(w):
            dq_t, dk_t, dv_t = self._backward_call(w, (q0, q1), (k0, k1), kind, q, do, stats, kv)
            dq[:, q0 - qa : q1 - qa] += dq_t
            dkv[0, :, k0 - ka : k1 - ka] += dk_t
            dkv[1, :, k0 - ka : k1 - ka] += dv_t
        return dq, dkv[0], dkv[1]

    def _tiled(self, w: BlockWork) -> bool:
        """Block ``w`` runs as tiles: the mask cuts it, or its logits are softcapped and the kernel cannot do that
        (the reference kernel then runs it tile by tile, in bounded memory)."""
        return w.kind is MaskKind.MASKED or (self.softcap is not None and not takes(self.kernel, "softcap"))

    def _forward_call(self, w: BlockWork, q_rows, kv_rows, kind: str, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        (q0, q1), (k0, k1) = q_rows, kv_rows
        kernel, extra = self._kernel(w, q_rows, kv_rows, kind)
        return kernel.forward(
            q[:, q0:q1], kv[0, :, k0:k1], kv[1, :, k0:k1], causal=kind == "causal", scale=self.scale, **extra
        )

    def _backward_call(self, w: BlockWork, q_rows, kv_rows, kind: str, q, do, stats, kv) -> tuple[Tensor, ...]:
        (q0, q1), (k0, k1) = q_rows, kv_rows
        kernel, extra = self._kernel(w, q_rows, kv_rows, kind)
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

    def _kernel(self, w: BlockWork, q_rows, kv_rows, kind: str) -> tuple[BlockKernel, dict]:
        """The kernel of one call and its extra arguments. Softcapped logits go to a kernel that takes ``"softcap"``
        (else the reference kernel); a ``"masked"`` tile to one that takes ``"mask"`` (a boolean mask) or
        ``"segments"`` (flash-attn varlen sequences, Note [Tile segments] in :mod:`mesh_cp.core.masks`),
        else to the reference kernel."""
        kernel, extra = self.kernel, {}
        if self.softcap is not None:
            kernel = kernel if takes(kernel, "softcap") else _REFERENCE
            extra["softcap"] = self.softcap
        if kind != "masked":
            return kernel, extra
        if takes(kernel, "mask"):
            return kernel, {**extra, "mask": self._tile_mask(w, q_rows, kv_rows)}
        if takes(kernel, "segments"):
            return kernel, {**extra, "segments": self.plan.tile_segments(w, q_rows, kv_rows)}
        return _REFERENCE, {**extra, "mask": self._tile_mask(w, q_rows, kv_rows)}

    def _tile_mask(self, w: BlockWork, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> Tensor:
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
