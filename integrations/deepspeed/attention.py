"""Context-parallel attention for models that are not Hugging Face models, in the place of DeepSpeed's
``DistributedAttention``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import mesh_cp
from mesh_cp.runtime.mesh import CPMesh


class MeshDistributedAttention(torch.nn.Module):
    """Context-parallel attention for models that are not Hugging Face models, in the place and with the
    call of ``deepspeed.sequence.layer.DistributedAttention``.

    ``MeshDistributedAttention(local_attention, causal=True)(query, key, value, batch_dim_idx)`` takes this
    rank's shard, ``(batch, seq_local, heads, head_dim)`` when ``batch_dim_idx == 0`` or ``(seq_local,
    batch, heads, head_dim)`` when it is 1, with K/V of ``kv_heads`` heads and RoPE already applied at the
    tokens' global positions, and returns the attention output in the same layout. :func:`initialize`
    attaches the mesh; without one (no ``mesh_attention`` block) it calls ``local_attention(query, key,
    value, *args, **kwargs)`` on the whole sequence, so the same model runs with and without CP.

    With a mesh, ``local_attention`` is not called: ``causal`` (required) and ``softmax_scale`` (default ``1 /
    sqrt(head_dim)``) must say what it computes, softmax attention without dropout. ``rotary_pos_emb``, which
    DeepSpeed's class applies after its all-to-all, is refused either way: rotate query and key first.
    """

    def __init__(self, local_attention: torch.nn.Module | None = None, *, causal: bool, softmax_scale=None):
        super().__init__()
        self.local_attn = local_attention
        self.causal, self.softmax_scale = causal, softmax_scale
        self.mesh: CPMesh | None = None
        self.options: dict[str, Any] = {}

    def use_mesh(self, mesh: CPMesh, **options: Any) -> None:
        """Compute attention over ``mesh`` from now on, with ``options`` (``schedule``, ``backward``) of
        :func:`mesh_cp.mesh_attn_func`; :func:`mesh_cp.integrations.switch_attention` calls it."""
        self.mesh, self.options = mesh, dict(options)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int = 0, rotary_pos_emb=None, *args, **kwargs
    ):
        if rotary_pos_emb is not None:  # with or without a mesh: the same model computes the same thing
            raise ValueError(
                "MeshDistributedAttention does not apply rotary_pos_emb: rotate query and key at their global "
                "positions (mesh_cp.position_ids) before calling it"
            )
        if self.mesh is None:
            if self.local_attn is None:
                raise ValueError(
                    "MeshDistributedAttention has no mesh (initialize with a mesh_attention block) and no "
                    "local_attention to fall back on"
                )
            return self.local_attn(query, key, value, *args, **kwargs)
        if args or kwargs:
            raise ValueError(
                f"MeshDistributedAttention computes causal or full softmax attention only; it got extra arguments "
                f"{len(args)} positional, {sorted(kwargs)} (masks, dropout, ...) it would have to drop"
            )
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 (batch, seq, ...) or 1 (seq, batch, ...), got {batch_dim_idx}")
        q, k, v = (t.transpose(0, 1) if batch_dim_idx == 1 else t for t in (query, key, value))
        out = mesh_cp.mesh_attn_func(
            q, k, v, mesh=self.mesh, causal=self.causal, softmax_scale=self.softmax_scale, **self.options
        )
        return out.transpose(0, 1) if batch_dim_idx == 1 else out
