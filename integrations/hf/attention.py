"""transformers' attention interface for ``attn_implementation="mesh_cp"``: this rank's shard of q, k, v ->
attention over the whole sequence of the CP mesh, with every keyword of the call handled or refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import mesh_cp
from mesh_cp.integrations.hf.masks import _check_window, _MaskNote, mesh_cp_mask

NAME = "mesh_cp"

ATTENTION_KEYWORDS: dict[str, str] = {
    "scaling": "softmax scale of q k^T; None means head_dim ** -0.5",
    "dropout": "attention dropout probability; only 0",
    "is_causal": "causal (True) or full (False) attention; None means the module's is_causal (as transformers' sdpa)",
    "position_ids": "this rank's global positions of one sequence (shard_batch's), checked once per tensor",
    "sliding_window": "None, or a window at least as long as the whole sequence (then it masks nothing)",
    "softcap": "attention-logit softcapping; only None",
    "s_aux": "attention-sink logits per head (gpt-oss), exact: Note [Attention sinks]",
    "output_attentions": "only False or None: attention weights are never formed",
    "use_cache": "rides along the model call; a cache that already holds tokens is refused by its length",
    "num_items_in_batch": "a loss argument that rides along the model call; attention does not read it",
    "shift_labels": "a loss argument that rides along the model call; attention does not read it",
    "output_hidden_states": "an output switch that rides along the model call; attention does not read it",
    "output_router_logits": "an MoE output switch that rides along the model call; attention does not read it",
}
"""Every keyword :func:`mesh_cp_attention` accepts (transformers 5 models pass these), and what it does with it.
Any other keyword raises ``NotImplementedError`` naming it."""

PACKING_KEYWORDS: frozenset[str] = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
)
"""Keywords of packed batches (several documents in one row); refused: mesh_cp computes one sequence per row."""

# Note [Attention sinks]
# ~~~~~~~~~~~~~~~~~~~~~~
# A sink adds one logit s per head to the softmax denominator and no value (gpt-oss's eager attention
# appends it as an extra key column and drops that column after the softmax):
#
#     out_sink = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^s) = out * Z / (Z + e^s),   Z = e^{lse},
#
# so out_sink = out * sigmoid(lse - s), with out and lse the exact attention over the whole sequence.
# lse is differentiable, so the gradients of q, k, v and s follow from this formula.


def mesh_cp_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function over the module's CP mesh.

    ``query (B, Hq, S_local, Dqk)``, ``key (B, Hkv, S_local, Dqk)``, ``value (B, Hkv, S_local, Dv)`` of this
    rank's shard -> ``((B, S_local, Hq, Dv), None)``: attention over the whole sequence for this rank's
    queries. ``Dv != Dqk`` (multi-head latent attention) is exact: the narrower of the two is padded with
    zeros. Every keyword is in :data:`ATTENTION_KEYWORDS` (with what is done with it) or raises
    ``NotImplementedError`` naming it; ``attention_mask`` must be None (:func:`mesh_cp_mask` builds none).
    No host synchronisation, except the check of a new ``position_ids`` tensor (once per forward).
    """
    attached = getattr(module, "mesh_cp_attached", None)
    if attached is None:
        raise ValueError(
            f"{type(module).__name__} uses attn_implementation='mesh_cp' but has no CP mesh; "
            f"call mesh_cp.integrations.hf.attach(model, mesh) after building the model"
        )
    _check_call(query, key, attention_mask, dropout, kwargs, attached.mesh.size)
    if kwargs.get("position_ids") is not None:
        attached.check_positions(kwargs["position_ids"])
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    scale = qk_dim**-0.5 if scaling is None else scaling
    if v_dim < qk_dim:
        v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        q, k = (torch.nn.functional.pad(t, (0, v_dim - qk_dim)) for t in (q, k))
    sinks = kwargs.get("s_aux")
    out = mesh_cp.mesh_attn_func(
        q,
        k,
        v,
        mesh=attached.mesh,
        causal=causal,
        softmax_scale=scale,
        layout=attached.layout,
        return_lse=sinks is not None,
        **attached.options,
    )
    if sinks is not None:  # Note [Attention sinks]
        out, lse = out
        keep = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # (B, Hq, S_local)
        out = (out.to(lse.dtype) * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype)
    attached.called.add(id(module))
    return (out[..., :v_dim] if out.shape[-1] != v_dim else out), None


def _check_call(
    query: Tensor, key: Tensor, attention_mask: Any, dropout: float, kwargs: Mapping[str, Any], mesh_size: int
) -> None:
    """Refuse what :func:`mesh_cp_attention` cannot compute exactly over a mesh of ``mesh_size`` ranks: an
    unknown keyword, a mask other than causal or full, dropout, attention weights, softcapping, a cache, a
    sliding window shorter than the whole sequence."""
    _check_attention_keywords(kwargs)
    seq_local, seq = query.shape[2], query.shape[2] * mesh_size
    if isinstance(attention_mask, _MaskNote):
        attention_mask.check(seq)
    elif attention_mask is not None:
        raise ValueError(
            f"mesh_cp attention got a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)}; "
            f"only causal or full attention is supported: drop the mask, or right-pad and use shard_batch"
        )
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions=True is not supported by mesh_cp: attention weights are never formed"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            f"attention softcap {kwargs['softcap']} is not supported by mesh_cp yet; set the config's "
            f"attn_logit_softcapping=None"
        )
    if key.shape[2] != seq_local:
        raise NotImplementedError(
            f"mesh_cp attention got keys of {key.shape[2]} tokens for queries of {seq_local}: a cache (generation) "
            f"is not supported; call the model with use_cache=False and without past_key_values"
        )
    _check_window(kwargs.get("sliding_window"), seq)


def _check_attention_keywords(kwargs: Mapping[str, Any]) -> None:
    """Refuse every keyword of the attention call that is not in :data:`ATTENTION_KEYWORDS`."""
    unknown = kwargs.keys() - ATTENTION_KEYWORDS.keys()
    if not unknown:
        return
    packing = sorted(unknown & PACKING_KEYWORDS)
    if packing:
        raise NotImplementedError(
            f"mesh_cp attention got {', '.join(packing)}: packed batches (several documents in one row) are not "
            f"supported by mesh_cp yet; give one sequence per row (right-padded, through shard_batch)"
        )
    raise NotImplementedError(
        f"mesh_cp attention got keyword(s) {sorted(unknown)} it does not handle, and would not drop them silently; "
        f"it accepts {sorted(ATTENTION_KEYWORDS)}"
    )


def register() -> None:
    """Register ``attn_implementation="mesh_cp"`` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, mesh_cp_attention)
    AttentionMaskInterface.register(NAME, mesh_cp_mask)
