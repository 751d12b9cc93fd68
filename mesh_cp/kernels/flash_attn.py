"""The flash-attn (Dao-AILab) kernel on CUDA: native GQA, fp16/bf16. Needs ``flash-attn>=2.6.3``.

This is the only module that imports ``flash_attn``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mesh_cp.kernels.base import out_for_delta

MIN_VERSION = (2, 6, 3)
# No dropout, no sliding window, no softcap, no ALiBi: plain softmax attention.
_PLAIN = {"dropout_p": 0.0, "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None}


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class FlashAttnKernel:
    """``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` (flash-attn 2.6.3+)."""

    name = "flash_attn"

    def __init__(self) -> None:
        try:
            import flash_attn
            from flash_attn import flash_attn_interface
        except ImportError as err:  # pragma: no cover - exercised only where flash-attn is missing
            raise RuntimeError(
                "kernel 'flash_attn' needs the flash-attn package: pip install 'mesh-cp[flash]' "
                "(CUDA only); otherwise use kernel='cuda_sdpa' or 'cpu_flash'"
            ) from err
        if _version_tuple(flash_attn.__version__) < MIN_VERSION:
            raise RuntimeError(
                f"flash-attn {flash_attn.__version__} is too old; mesh_cp needs >= "
                f"{'.'.join(map(str, MIN_VERSION))} (pip install -U 'mesh-cp[flash]')"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("kernel 'flash_attn' needs CUDA; on CPU use kernel='cpu_flash'")
        self._fa = flash_attn_interface

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, _, _ = self._fa._flash_attn_forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            softmax_scale=scale,
            causal=causal,
            return_softmax=False,
            **_PLAIN,
        )
        return out, lse

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        do = do.contiguous()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            do,
            q,
            k,
            v,
            out_for_delta(do, delta).contiguous(),
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            softmax_scale=scale,
            causal=causal,
            deterministic=True,
            rng_state=None,
            **_PLAIN,
        )
        return dq, dk, dv
