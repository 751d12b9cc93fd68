"""The per-rank tensor sizes of one attention call (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh_cp.core.options import positive_int


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank tensor sizes of one attention call: ``q (batch, seq_local, heads, head_dim)``, ``k, v (batch,
    seq_local, kv_heads, head_dim)``. ``heads`` and ``kv_heads`` count query and K/V heads."""

    batch: int
    seq_local: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    """Bytes per element of q, k, v (2 for bf16/fp16, 4 for fp32)."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq_local", "heads", "kv_heads", "head_dim", "itemsize"):
            positive_int(f"AttentionShape.{name}", getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (GQA/MQA); "
                f"use a kv_heads that divides {self.heads}"
            )

    @property
    def acc_itemsize(self) -> int:
        """Bytes per element of accumulators (o, lse, delta, dq, dk, dv): fp32, or fp64 for fp64."""
        return 8 if self.itemsize == 8 else 4

    @property
    def chunk_elems(self) -> int:
        """One ``C``: elements of a local Q chunk, ``batch * seq_local * heads * head_dim``."""
        return self.batch * self.seq_local * self.heads * self.head_dim

    @property
    def kv_ratio(self) -> float:
        """``r = kv_heads / heads``."""
        return self.kv_heads / self.heads

    @property
    def stats_elems(self) -> int:
        """Elements of one lse (or delta) chunk, ``batch * heads * seq_local``."""
        return self.batch * self.heads * self.seq_local
