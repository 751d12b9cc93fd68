"""The block-attention kernel interface every backend implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class BlockKernel(Protocol):
    """Attention of one Q block against one KV block, returning the softmax statistics.

    Shapes (flash-attn layout): ``q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hkv, D)`` with ``Hq % Hkv == 0``;
    GQA/MQA heads are expanded, if at all, inside the kernel. ``causal`` is only ever asked for
    square blocks (``Sq == Sk``) and is top-left aligned.
    """

    name: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """Return ``out (B, Sq, Hq, D)`` in ``q.dtype`` and ``lse (B, Hq, Sq)`` in fp32 (fp64 for fp64)."""
        ...

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one block given the row's *global* ``lse`` and ``delta = rowsum(dO * O)``.

        ``lse`` and ``delta`` are ``(B, Hq, Sq)`` fp32 (fp64 for fp64). Returns ``dq (B, Sq, Hq, D)``
        and ``dk, dv (B, Sk, Hkv, D)`` (in ``q.dtype`` or wider).
        """
        ...


def out_for_delta(do: Tensor, delta: Tensor) -> Tensor:
    """A tensor ``o`` with ``rowsum(do * o) == delta``, for fused backward kernels that take ``out``.

    Fused flash backward kernels read ``out`` only to form ``delta = rowsum(dO * O)``. A block of a
    distributed row needs the row's global ``delta`` (and, when the lse itself receives a gradient,
    ``delta - dlse``), which no local ``out`` carries; ``o = do * delta / |do|^2`` has exactly that row
    sum (and rows with ``do = 0`` have ``delta = 0`` too, so ``o = 0`` there). ``do (B, S, H, D)``,
    ``delta (B, H, S)``; the result is ``do.dtype``.
    """
    acc = delta.dtype
    do_acc = do.to(acc)
    norm2 = (do_acc * do_acc).sum(-1)
    coef = torch.where(norm2 > 0, delta.transpose(1, 2) / torch.where(norm2 > 0, norm2, 1), 0)
    return (do_acc * coef.unsqueeze(-1)).to(do.dtype)
