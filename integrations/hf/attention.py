"""transformers' attention interface for ``attn_implementation="mesh_cp"``: this rank's shard of q, k, v ->
attention over the whole sequence of the CP mesh, with every keyword of the call handled or refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import mesh_cp
from mesh_cp.core.masks import AttentionMask
from mesh_cp.integrations.hf.masks import CacheMask, _MaskNote, mesh_cp_mask

NAME = "mesh_cp"

ATTENTION_KEYWORDS: dict[str, str] = {
    "scaling": "softmax scale of q k^T; None means head_dim ** -0.5",
    "dropout": "attention dropout probability; only 0",
    "is_causal": "causal (True) or full (False: with the mesh_cp_mask of a batch sharded with causal=False) attention; "
    "None means the module's is_causal (as transformers' sdpa)",
    "position_ids": "this rank's positions (shard_batch's: global, or per document with mesh_cp_mask), checked once",
    "sliding_window": "the layer's left window (q - k < window); must equal the window of the mask transformers built",
    "softcap": "attention-logit softcapping (Gemma 2), exact: logits softcap * tanh(s / softcap)",
    "mesh_cp_mask": "the batch's documents and padding (an AttentionMask from shard_batch / ShardingCollator)",
    "cu_seq_lens_q": "a packed row's document boundaries; must equal mesh_cp_mask's (batch 1, on the CPU)",
    "cu_seq_lens_k": "as cu_seq_lens_q (the same boundaries)",
    "max_length_q": "the longest document of cu_seq_lens_q; must match it",
    "max_length_k": "as max_length_q",
    "s_aux": "attention-sink logits per head (gpt-oss), exact: Note [Attention sinks]",
    "output_attentions": "only False or None: attention weights are never formed",
    "use_cache": "rides along the model call; a cache is taken only as the ShardedKVCache of mesh_cp generation",
    "num_items_in_batch": "a loss argument that rides along the model call; attention does not read it",
    "shift_labels": "a loss argument that rides along the model call; attention does not read it",
    "output_hidden_states": "an output switch that rides along the model call; attention does not read it",
    "output_router_logits": "an MoE output switch that rides along the model call; True is refused by the model's hook",
}
"""Every keyword :func:`mesh_cp_attention` accepts (transformers 5 models pass these), and what it does with it.
Any other keyword raises ``NotImplementedError`` naming it."""

PACKING_KEYWORDS: frozenset[str] = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})
"""Keywords of packed batches (several documents in one row): taken only beside ``mesh_cp_mask``, whose documents
they must describe (on its own, a rank's shard cannot tell documents that cross shards)."""

# Note [Attention sinks]
# ~~~~~~~~~~~~~~~~~~~~~~
# A sink adds one logit s per head to the softmax denominator and no value (gpt-oss's eager attention
# appends it as an extra key column and drops that column after the softmax):
#
#     out_sink = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^s) = out * Z / (Z + e^s),   Z = e^{lse},
#
# so out_sink = out * sigmoid(lse - s), with out and lse the exact attention over the whole sequence.
# lse is differentiable, so the gradients of q, k, v and s follow from this formula.


# Opaque to torch.compile, like mesh_attn_func (Note [Opaque to torch.compile] in mesh_cp.runtime.attention): the
# whole call is, so that its Python checks (keywords, masks, position_ids, the count of layers that called) run
# eagerly too, with one graph break per attention layer; the rest of the model is compiled around it.
@torch.compiler.disable(reason="mesh_cp attention communicates over the CP group; it runs eagerly")
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
    if isinstance(attention_mask, CacheMask):  # new tokens over a cache: Note [Sharded generation]
        from mesh_cp.integrations.hf.generation import decode_attention

        _check_attention_keywords(kwargs)
        if dropout:
            raise NotImplementedError(
                f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0"
            )
        return decode_attention(module, query, key, value, attention_mask, scaling, kwargs)
    _check_call(query, key, attention_mask, dropout, kwargs)
    mask = _mask_of_call(attention_mask, kwargs, query.shape[2] * attached.mesh.size)
    if kwargs.get("position_ids") is not None:
        attached.check_positions(kwargs["position_ids"], kwargs.get("mesh_cp_mask"))
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    _check_full_attention(module, causal, mask)
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
        mask=mask,
        softcap=kwargs.get("softcap"),
        **attached.options,
    )
    if sinks is not None:  # Note [Attention sinks]
        out, lse = out
        keep = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # (B, Hq, S_local)
        out = (out.to(lse.dtype) * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype)
    attached.called.add(id(module))
    return (out[..., :v_dim] if out.shape[-1] != v_dim else out), None


def _check_call(query: Tensor, key: Tensor, attention_mask: Any, dropout: float, kwargs: Mapping[str, Any]) -> None:
    """Refuse what :func:`mesh_cp_attention` cannot compute exactly over a mesh: an
    unknown keyword, a mask overlay it does not compute, a mask tensor, dropout, attention weights, a cache."""
    _check_attention_keywords(kwargs)
    seq_local = query.shape[2]
    if isinstance(attention_mask, _MaskNote):
        attention_mask.check()
    elif attention_mask is not None:
        raise ValueError(
            f"mesh_cp attention got a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)}; "
            f"padding and documents reach mesh_cp as mesh_cp_mask: pass the attention_mask to shard_batch / "
            f"ShardingCollator instead, and call the model with their batch"
        )
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions=True is not supported by mesh_cp: attention weights are never formed"
        )
    if key.shape[2] != seq_local:
        raise NotImplementedError(
            f"mesh_cp attention got keys of {key.shape[2]} tokens for queries of {seq_local}: a cache is not supported "
            f"here; call the model with use_cache=False and without past_key_values, and generate with "
            f"mesh_cp.integrations.hf.generate (a sharded cache)"
        )


def _check_full_attention(module: torch.nn.Module, causal: bool, mask: AttentionMask | None) -> None:
    """Full attention needs the batch's padding in the mask (``shard_batch(causal=False)``): causal attention never
    reaches right padding, full attention would."""
    if not causal and (mask is None or mask.documents is None):
        raise NotImplementedError(
            f"{type(module).__name__}: full (non-causal) attention without the batch's mesh_cp_mask would attend to "
            f"padding, the mesh's own included; shard the batch with causal=False (hf.shard_batch, ShardingCollator, "
            f"ShardCollated; MeshCPTrainer does it for such a model) and call the model with its mesh_cp_mask"
        )


def _check_attention_keywords(kwargs: Mapping[str, Any]) -> None:
    """Refuse every keyword of the attention call that is not in :data:`ATTENTION_KEYWORDS`."""
    unknown = kwargs.keys() - ATTENTION_KEYWORDS.keys()
    if unknown:
        raise NotImplementedError(
            f"mesh_cp attention got keyword(s) {sorted(unknown)} it does not handle, and would not drop them "
            f"silently; it accepts {sorted(ATTENTION_KEYWORDS)}"
        )


def _mask_of_call(attention_mask: Any, kwargs: Mapping[str, Any], seq: int) -> AttentionMask | None:
    """The :class:`~mesh_cp.core.AttentionMask` of this layer's call: the batch's documents and padding
    (``mesh_cp_mask``) with the layer's window (the one transformers composed into its mask, which a
    ``sliding_window`` keyword must repeat). ``None`` when neither masks anything."""
    given = kwargs.get("mesh_cp_mask")
    if given is not None and not isinstance(given, AttentionMask):
        raise ValueError(f"mesh_cp_mask must be a mesh_cp.AttentionMask (shard_batch's), got {type(given).__name__}")
    _check_packing_keywords(kwargs, given, seq)
    window = attention_mask.window if isinstance(attention_mask, _MaskNote) else None
    layer = kwargs.get("sliding_window")
    if layer is not None and layer != window and not (window is None and layer >= seq):
        raise NotImplementedError(
            f"the layer passes sliding_window={layer} but the mask transformers built for it has window {window}; "
            f"mesh_cp computes one of them and will not guess which: make the config's sliding window settings agree"
        )
    window = None if window is None or window >= seq else window
    if window is None:
        return given
    return AttentionMask(window=window) if given is None else dataclasses.replace(given, window=window)


def _check_packing_keywords(kwargs: Mapping[str, Any], mask: AttentionMask | None, seq: int) -> None:
    """``cu_seq_lens_*`` / ``max_length_*`` must describe the documents of ``mask`` (one packed row)."""
    given = {name: kwargs[name] for name in sorted(PACKING_KEYWORDS) if kwargs.get(name) is not None}
    if not given:
        return
    if mask is None or mask.rows != 1:
        raise NotImplementedError(
            f"mesh_cp attention got {', '.join(given)} without the mesh_cp_mask of one packed row: a rank's shard "
            f"cannot tell documents that cross shards; shard a packed collator's batches (TRL's padding-free, "
            f"DataCollatorWithFlattening) with hf.ShardCollated(collator, mesh) or hf.mesh_cp_trainer_class(...), or "
            f"build them with ShardingCollator(packed=True) / shard_batch(documents=...), and call the model with "
            f"their mesh_cp_mask"
        )
    if mask.parts is not None:
        raise NotImplementedError(
            f"mesh_cp attention got {', '.join(given)} with split documents (ShardingCollator(balance='split')): "
            f"they describe documents back to back, which the split layout does not keep; drop them"
        )
    spans = mask.row_documents(0, seq)
    if not spans:
        raise ValueError(f"{', '.join(given)} given for a row without documents (mesh_cp_mask {mask})")
    bounds, longest = [spans[0][0], *(stop for _, stop in spans)], max(stop - start for start, stop in spans)
    for name, value in given.items():
        if isinstance(value, Tensor) and value.device.type != "cpu":
            raise NotImplementedError(
                f"{name} on {value.device}: keep it on the CPU (reading it would stall the device)"
            )
        got = value.tolist() if isinstance(value, Tensor) else value
        want = bounds if name.startswith("cu_") else longest
        if got != want:
            raise ValueError(f"{name} {got} does not describe the documents of mesh_cp_mask ({want})")


def register() -> None:
    """Register ``attn_implementation="mesh_cp"`` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, mesh_cp_attention)
    AttentionMaskInterface.register(NAME, mesh_cp_mask)
