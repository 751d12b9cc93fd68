"""Hugging Face transformers: the ``mesh_cp`` attention implementation and exact sequence sharding.

::

    import mesh_cp
    from mesh_cp.integrations import hf

    model = hf.attach(AutoModelForCausalLM.from_config(config), mesh)   # every attention layer runs over mesh
    batch = hf.shard_batch(input_ids, mesh=mesh)      # this rank's input_ids, global position_ids, shift_labels
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
    loss.backward()                                   # then sum parameter gradients over the CP group

Each rank's ``loss`` is its share of the global mean (token losses summed over its shard, divided by
the label count of the whole sequence), so the loss is the sum over the CP group and so is every
parameter gradient (:func:`reduce_gradients`). Labels are shifted on the *full* sequence before
sharding, so the last token of every shard keeps its label.

What a model hands mesh_cp is either computed exactly or refused with the feature named, never
dropped: every keyword of the attention call (:data:`ATTENTION_KEYWORDS`), every mask transformers
composes (:func:`mesh_cp_mask`), the switch itself and the RoPE variants that read the sequence
length (:func:`attach`). A padding mask is accepted only when it pads on the right and is given to
:func:`shard_batch` (exact under causal attention: padded tokens get no label); left or inner
padding, masks given to the model, packed batches, sliding windows shorter than the sequence,
softcapping, attention dropout, caches (generation) and models that do not compute their attention
through transformers' ``AttentionInterface`` raise with the reason.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

import mesh_cp
from mesh_cp.core.options import check_layout, check_option
from mesh_cp.runtime.batch import IGNORE_INDEX, ShardedBatch, ShardingCollator, causal_lm_loss, shard_batch
from mesh_cp.runtime.device_checks import check_on_device
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.parallel import DataContextParallel, reduce_gradients

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

MASK_KEYWORDS: frozenset[str] = frozenset(
    {"allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype", "config", "use_vmap", "device", "local_size"}
)
"""Keywords :func:`mesh_cp_mask` accepts beyond its named parameters: hints for building the mask tensor
transformers would build, and mesh_cp builds none (``local_size`` repeats the sliding window, which is
checked through the mask function)."""

LENGTH_DEPENDENT_ROPE: tuple[str, ...] = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the sequence length (``max(position_ids) + 1``); :func:`attach`
gives them the global length (Note [Length-dependent RoPE])."""

# Note [Attention sinks]
# ~~~~~~~~~~~~~~~~~~~~~~
# A sink adds one logit s per head to the softmax denominator and no value (gpt-oss's eager attention
# appends it as an extra key column and drops that column after the softmax):
#
#     out_sink = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^s) = out * Z / (Z + e^s),   Z = e^{lse},
#
# so out_sink = out * sigmoid(lse - s), with out and lse the exact attention over the whole sequence.
# lse is differentiable, so the gradients of q, k, v and s follow from this formula.
#
# Note [Length-dependent RoPE]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers' "dynamic" and "longrope" RoPE (modeling_rope_utils.dynamic_rope_update) pick their
# frequencies from seq_len = max(position_ids) + 1 of the call. On a CP rank that is the maximum of its
# own shard, which differs between ranks and from the whole sequence's. attach() gives such a rotary
# module one more position, S - 1 (S = P * seq_local, the whole sequence's last position), so it picks
# the frequencies of the whole sequence; cos and sin are computed position by position, and the extra
# row is cut from its output. Exact whenever position_ids are the layout's global positions (checked).


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
    _check_attention_keywords(kwargs)
    seq_local, seq = query.shape[2], query.shape[2] * attached.mesh.size
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


def _check_window(window: int | None, seq: int) -> None:
    """A sliding window masks nothing when it spans the whole sequence of ``seq`` tokens (distance < window)."""
    if window is not None and window < seq:
        raise NotImplementedError(
            f"sliding_window={window} is not supported by mesh_cp for a sequence of {seq} tokens: only windows of at "
            f"least the sequence length (which mask nothing) are; set config.sliding_window=None (or "
            f"use_sliding_window=False) for full attention"
        )


# Leaf mask functions of transformers' masking_utils that mask nothing beyond causal or full attention, which the
# attention itself applies over global positions: causal, full (config.is_causal=False, which transformers also
# passes to every layer as is_causal=False), and the packed-sequence mask that a zig-zag shard's jumping positions
# make transformers add (packing itself is refused by the position check).
_PLAIN_MASKS = frozenset(
    {"causal_mask_function", "bidirectional_mask_function", "packed_sequence_mask_function.<locals>.inner_mask"}
)

# Leaf mask functions of transformers' masking_utils that mesh_cp refuses, and the feature each is.
_REFUSED_MASKS = {
    "chunked_overlay.<locals>.inner_mask": "chunked attention (config.attention_chunk_size)",
    "blockwise_overlay.<locals>.inner_mask": "block-wise bidirectional attention (block_sequence_ids)",
    "or_masks.<locals>.or_mask": "an or_mask_function overlay (tokens that attend outside the causal mask)",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": "a bidirectional sliding window",
    "padding_mask_function.<locals>.inner_mask": "a padding mask function",
}


def _mask_parts(fn: Callable) -> list[tuple[str, dict[str, Any]]]:
    """The leaf mask functions transformers composed into ``fn`` (``and_masks`` and the packed-sequence
    position remap opened), each as its qualified name and its closure variables."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    code = getattr(fn, "__code__", None)
    cells = (
        {}
        if code is None
        else dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    )
    if name == "and_masks.<locals>.and_mask":
        return [part for f in cells["mask_functions"] for part in _mask_parts(f)]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _mask_parts(cells["mask_function"])
    return [(name, cells)]


class _MaskNote:
    """What :func:`mesh_cp_mask` returns in place of a mask that is not plain causal: nothing is built; the
    attention layers given it check it against their own sequence (:meth:`check`), so a mask that no layer
    uses (a model may build a sliding-window mask its layers never read) costs nothing. Any other use of it
    by model code raises the refusal."""

    __slots__ = ("window", "refusal")

    def __init__(self, *, window: int | None = None, refusal: str | None = None):
        self.window, self.refusal = window, refusal

    def check(self, seq: int) -> None:
        """Raise unless this mask is causal attention over a sequence of ``seq`` tokens."""
        if self.refusal is not None:
            raise NotImplementedError(self.refusal)
        _check_window(self.window, seq)

    def __getattr__(self, name: str):
        raise NotImplementedError(
            self.refusal or f"mesh_cp builds no sliding-window mask (window {self.window}), and model code read .{name}"
        )

    def __getitem__(self, index):
        return self.__getattr__("__getitem__")


def mesh_cp_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> _MaskNote | None:
    """transformers mask function: checks the mask transformers would build and builds none (the mesh
    applies causality over global positions itself).

    Returns None for the causal or the full mask (the attention applies either, from ``is_causal``, as
    transformers' sdpa path does), possibly with the packed-sequence wrapper transformers adds for
    position_ids that jump (a zig-zag shard always does; packing itself is refused by the position
    check). A sliding window, or an overlay mesh_cp refuses (chunked, bidirectional, block-wise,
    or-masks), gives a :class:`_MaskNote` that every attention layer using it checks: a window must span
    the whole sequence, a refused overlay raises ``NotImplementedError`` naming it. Offsets or
    ``kv_length != q_length`` (a cache) are refused here; other keywords must be in :data:`MASK_KEYWORDS`.

    ``attention_mask`` (this rank's 2-D padding mask, given to the model) must be all ones. It is checked
    by value only on the CPU, where reading it costs no device synchronisation; a mask on an accelerator
    is refused (checking it there would stop the device every step, and it carries nothing mesh_cp can
    use): give the padding mask to :func:`shard_batch` or :class:`ShardingCollator` instead.
    """
    unknown = kwargs.keys() - MASK_KEYWORDS
    if unknown:
        raise NotImplementedError(
            f"mesh_cp mask got keyword(s) {sorted(unknown)} it does not handle; it accepts {sorted(MASK_KEYWORDS)}"
        )
    if isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor) or q_offset or kv_offset or kv_length != q_length:
        raise NotImplementedError(
            f"mesh_cp got a mask for {q_length} queries at offset {q_offset} over {kv_length} keys at offset {kv_offset}: "
            f"a cache (generation) is not supported; call the model with use_cache=False and without past_key_values"
        )
    if attention_mask is not None:
        if attention_mask.device.type != "cpu":
            raise NotImplementedError(
                f"mesh_cp does not take attention_mask in the model call (got one on {attention_mask.device}): pass "
                f"it to mesh_cp.integrations.hf.shard_batch / ShardingCollator (right padding becomes ignored labels) "
                f"and call the model without it"
            )
        if not bool(attention_mask.all()):
            raise ValueError(
                "mesh_cp attention does not take padding masks: right-pad the batch and pass attention_mask to "
                "mesh_cp.integrations.hf.shard_batch (padded tokens then get no label), not to the model"
            )
    windows = []
    for name, cells in _mask_parts(mask_function) if mask_function is not None else ():
        if name in _PLAIN_MASKS:
            continue
        if name == "sliding_window_overlay.<locals>.inner_mask":
            windows.append(cells["sliding_window"])
            continue
        return _MaskNote(
            refusal=f"mesh_cp does not support {_REFUSED_MASKS.get(name, f'the mask function {name}')}: it computes "
            f"causal (or full) attention over the whole sequence only"
        )
    return _MaskNote(window=min(windows)) if windows else None


def register() -> None:
    """Register ``attn_implementation="mesh_cp"`` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, mesh_cp_attention)
    AttentionMaskInterface.register(NAME, mesh_cp_mask)


def attach(
    model: torch.nn.Module,
    mesh: CPMesh,
    *,
    schedule: str = "overlap",
    backward: str = "regather",
    layout: str = "zigzag",
) -> torch.nn.Module:
    """Switch ``model`` to ``attn_implementation="mesh_cp"`` and give every attention layer ``mesh`` (and the
    ``schedule`` and ``backward`` of :func:`mesh_cp.mesh_attn_func`; ``layout`` is how :func:`shard_batch`
    sharded the sequence). Returns ``model``; attaching again replaces the earlier attachment.

    Checked, so that a model is exact or refused by name:

    - the switch happened: ``_attn_implementation`` is ``"mesh_cp"`` on the model and every sub-model (a model
      that does not compute attention through transformers' ``AttentionInterface``, such as Falcon, GPT-J,
      Bloom or MPT, keeps its own attention and is refused here), and on the first forward every attention
      layer (module with ``is_causal`` and ``config``) called :func:`mesh_cp_attention` (raised otherwise);
    - every forward of ``model`` gets ``position_ids`` equal to this rank's global positions in ``layout``
      (one check per ``position_ids`` tensor; the model would number a shard from 0, and packed batches
      restart positions per document);
    - RoPE types in :data:`LENGTH_DEPENDENT_ROPE` are given the whole sequence's length (Note
      [Length-dependent RoPE]); ``attn_temperature_tuning`` (Llama 4), which scales queries by positions
      counted from 0 on each shard, is refused.
    """
    if not isinstance(mesh, CPMesh):
        raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
    check_option("schedule", schedule)
    check_option("backward", backward)
    check_layout(layout)
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    from transformers import PreTrainedModel

    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for m in models:
        if getattr(m.config, "attn_temperature_tuning", False):
            raise NotImplementedError(
                f"{type(m).__name__}: attn_temperature_tuning scales the queries of layers without RoPE by positions "
                f"counted from 0 on each rank's shard, which mesh_cp cannot make exact; set "
                f"config.attn_temperature_tuning=False"
            )
    register()
    _detach(model)
    model.set_attn_implementation(NAME)
    kept = sorted(
        {
            f"{type(m).__name__} ({m.config._attn_implementation!r})"
            for m in models
            if m.config._attn_implementation != NAME
        }
    )
    if kept:
        raise NotImplementedError(
            f"{', '.join(kept)} kept its attention implementation after set_attn_implementation('mesh_cp'): it does "
            f"not compute attention through transformers' AttentionInterface, so every rank would attend over its "
            f"own shard only; mesh_cp cannot run this model"
        )
    layers = [(name, m) for name, m in model.named_modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers (modules with is_causal) to attach to")
    attached = _Attachment(mesh, layout, {"schedule": schedule, "backward": backward}, layers)
    for _, layer in layers:
        layer.mesh_cp_attached = attached
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        rope_types = rope_types.values() if isinstance(rope_types, Mapping) else [rope_types]
        if any(isinstance(t, str) and any(d in t for d in LENGTH_DEPENDENT_ROPE) for t in rope_types):
            module.register_forward_pre_hook(attached.rope_before, with_kwargs=True)
            module.register_forward_hook(attached.rope_after, with_kwargs=True)
    model.register_forward_pre_hook(attached.before_forward, with_kwargs=True)
    model.register_forward_hook(attached.after_forward, with_kwargs=True)
    return model


def _detach(model: torch.nn.Module) -> None:
    """Remove what an earlier :func:`attach` added to ``model`` (its hooks and the layers' attachment)."""
    for module in model.modules():
        module.__dict__.pop("mesh_cp_attached", None)
        for hooks, extras in (
            (module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
            (module._forward_hooks, (module._forward_hooks_with_kwargs,)),
        ):
            for hook_id in [i for i, h in hooks.items() if isinstance(getattr(h, "__self__", None), _Attachment)]:
                del hooks[hook_id]
                for extra in extras:
                    extra.pop(hook_id, None)


_POSITIONS_MESSAGE = (
    "position_ids are not this rank's global positions of one sequence (in every row): a packed batch (positions "
    "restarting per document) is not supported by mesh_cp yet, and a shard numbered from 0 would be silently wrong; "
    "pass the position_ids of shard_batch / ShardingCollator"
)


class _Attachment:
    """What :func:`attach` gives a model: its mesh, layout and options (read by every attention layer), and
    the checks that run once per forward. Deep-copied with the model (the mesh copies as itself)."""

    def __init__(self, mesh: CPMesh, layout: str, options: dict[str, str], layers: list[tuple[str, torch.nn.Module]]):
        self.mesh, self.layout, self.options, self.layers = mesh, layout, options, layers
        self.verified = False
        """Every attention layer called :func:`mesh_cp_attention` in one forward (checked until true)."""
        self.called: set[int] = set()
        """``id`` of the layers that called :func:`mesh_cp_attention` in this forward."""
        self._checked: tuple[weakref.ref, int] | None = None
        self._expected: dict[tuple[int, torch.device], Tensor] = {}
        self._position_kinds: set[tuple] = set()

    def check_positions(self, position_ids: Tensor) -> None:
        """``position_ids`` must be this rank's global positions (:func:`mesh_cp.position_ids`) of one sequence
        of ``P * seq_local`` tokens, for every row. Checked once per tensor (identity and version), so once per
        forward however many layers pass it on. The first tensor of each (shape, device, dtype) is compared on
        the host (a clear error naming the positions); later ones, a new tensor every step, are compared where
        they are with ``torch._assert_async`` (on a GPU a wrong tensor stops the run with a device-side assertion
        at the next synchronisation, with no host read per step; on the CPU the same ``ValueError`` at once)."""
        if (
            self._checked is not None
            and self._checked[0]() is position_ids
            and self._checked[1] == position_ids._version
        ):
            return
        seq_local = position_ids.shape[-1]
        seq = seq_local * self.mesh.size
        parts = 2 * self.mesh.size if self.layout == "zigzag" else self.mesh.size
        expected = None
        if seq % parts == 0:
            key = (seq_local, position_ids.device)
            if key not in self._expected:
                self._expected[key] = mesh_cp.position_ids(seq, mesh=self.mesh, layout=self.layout, device=key[1])
            expected = self._expected[key]
        kind = (tuple(position_ids.shape), position_ids.device, position_ids.dtype)
        if expected is not None and position_ids.dim() <= 2 and kind in self._position_kinds:
            check_on_device((position_ids == expected).all(), ValueError(_POSITIONS_MESSAGE))
        elif expected is None or position_ids.dim() > 2 or not bool((position_ids == expected).all()):
            shown = position_ids.reshape(-1, seq_local)[0].tolist()
            raise ValueError(
                f"position_ids {_preview(shown)} are not this rank's global positions of one sequence of {seq} tokens "
                f"in the {self.layout} layout ({'none' if expected is None else _preview(expected.tolist())}, in every "
                f"row): a packed batch (positions restarting per document) is not supported by mesh_cp yet, and a "
                f"shard numbered from 0 would be silently wrong; pass the position_ids of shard_batch / ShardingCollator"
            )
        self._position_kinds.add(kind)
        self._checked = (weakref.ref(position_ids), position_ids._version)

    def before_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the attached model: check ``position_ids``, start the layer count."""
        positions = kwargs.get("position_ids")
        if positions is None and args:
            positions = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments.get("position_ids")
        if positions is None:
            raise ValueError(
                f"{type(model).__name__} was called without position_ids: it would number this rank's shard from 0; "
                f"pass the global positions of shard_batch / ShardingCollator (batch.position_ids)"
            )
        self.check_positions(positions)
        self.called.clear()

    def after_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of the attached model: on the first forward, check that every attention layer called
        :func:`mesh_cp_attention`."""
        if self.verified:
            return
        missing = [f"{name} ({type(m).__name__})" for name, m in self.layers if id(m) not in self.called]
        if missing:
            raise NotImplementedError(
                f"{type(model).__name__}: attention layer(s) {', '.join(missing)} did not call mesh_cp attention in "
                f"the forward: they compute attention outside transformers' AttentionInterface, over this rank's "
                f"shard only; mesh_cp cannot run this model"
            )
        self.verified = True

    def rope_before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of a length-dependent RoPE: one more position, the sequence's last (Note
        [Length-dependent RoPE])."""
        in_kwargs = "position_ids" in kwargs
        if not in_kwargs and len(args) < 2:
            raise NotImplementedError(
                f"{type(module).__name__} (rope_type {module.rope_type!r}) was called without position_ids; mesh_cp "
                f"gives length-dependent RoPE the whole sequence's length through them"
            )
        positions = kwargs["position_ids"] if in_kwargs else args[1]
        last = positions.new_full((*positions.shape[:-1], 1), positions.shape[-1] * self.mesh.size - 1)
        positions = torch.cat([positions, last], dim=-1)
        if in_kwargs:
            return args, {**kwargs, "position_ids": positions}
        return (args[0], positions, *args[2:]), kwargs

    def rope_after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of a length-dependent RoPE: cut the extra position's row from every output."""
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if not all(isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] == positions.shape[-1] for t in outputs):
            raise NotImplementedError(
                f"{type(module).__name__} (rope_type {module.rope_type!r}) returned "
                f"{[tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in outputs]}, not per-position "
                f"tensors of {positions.shape[-1]} rows; mesh_cp cannot give it the whole sequence's length"
            )
        cut = [t[..., :-1, :] for t in outputs]
        return type(output)(cut) if isinstance(output, (tuple, list)) else cut[0]


def _preview(values: list[int], n: int = 6) -> str:
    return str(values) if len(values) <= n else f"[{', '.join(map(str, values[:n]))}, ...] ({len(values)} values)"


def mesh_cp_trainer_class():
    """``transformers.Trainer`` subclass that trains with a :class:`DataContextParallel` layout.

    ``MeshCPTrainer(model=..., args=..., train_dataset=..., layout=layout, pad_token_id=...)``: attaches
    the layout's mesh to the model, feeds every rank of a CP group the same examples (a
    ``DistributedSampler`` over the DP replicas, reshuffled every epoch: Trainer calls the dataloader's
    ``set_epoch``) through :class:`ShardingCollator`, and lets Trainer's
    own token counting do the rest: with ``average_tokens_across_devices`` (required) the loss is the
    model's sum over this rank's tokens over the label count of all ranks, times the world size, so
    the DDP gradient mean over all DP x CP ranks is the gradient of the global mean loss. Evaluation
    and prediction raise (Trainer gathers them as if every rank held different examples).

    With DeepSpeed (``TrainingArguments(deepspeed="ds_config.json")``, or ``--deepspeed`` on the command
    line) leave ``layout`` out: the trainer builds it from the config's ``"mesh_attention"`` block
    (:mod:`mesh_cp.integrations.deepspeed`), and DeepSpeed's gradient mean over all ranks is exact at
    every ZeRO stage for the same reason.
    """
    from torch.utils.data import DistributedSampler
    from transformers import Trainer

    class MeshCPTrainer(Trainer):
        def __init__(self, *args, layout: DataContextParallel | None = None, pad_token_id: int, **kwargs):
            if args:
                raise ValueError("MeshCPTrainer takes keyword arguments only (model=..., args=..., ...)")
            if layout is None:
                layout = _layout_from_deepspeed_args(kwargs.get("args"), kwargs.get("model"))
            elif isinstance(layout, DataContextParallel):
                attach(kwargs["model"], layout.mesh)
            else:
                raise ValueError(f"layout must be a DataContextParallel, got {type(layout).__name__}")
            kwargs.setdefault("data_collator", ShardingCollator(layout.mesh, pad_token_id=pad_token_id))
            super().__init__(**kwargs)
            if not self.args.average_tokens_across_devices:
                raise ValueError(
                    "MeshCPTrainer needs TrainingArguments(average_tokens_across_devices=True): the loss of a CP "
                    "rank is its share of the global token mean"
                )
            self.layout = layout

        def get_train_dataloader(self) -> DataLoader:
            if self.train_dataset is None:
                raise ValueError("Trainer: training requires a train_dataset.")
            sampler = DistributedSampler(
                self.train_dataset,
                num_replicas=self.layout.dp_size,
                rank=self.layout.dp_rank,
                shuffle=True,
                seed=self.args.seed,
            )
            return _EpochDataLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                sampler=sampler,
                collate_fn=self.data_collator,
                drop_last=self.args.dataloader_drop_last,
            )

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            raise NotImplementedError(
                "MeshCPTrainer trains only: Trainer's evaluation loop gathers predictions as if every rank held "
                "different examples, which CP ranks do not; evaluate the trained model without CP"
            )

        def get_test_dataloader(self, test_dataset) -> DataLoader:
            return self.get_eval_dataloader(test_dataset)

    return MeshCPTrainer


class _EpochDataLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reshuffles its sampler: Trainer calls ``set_epoch(epoch)`` on a
    training dataloader that has one, before every epoch (a plain ``DataLoader`` would repeat the order)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def _layout_from_deepspeed_args(training_args, model) -> DataContextParallel:
    """The layout of an enabled ``"mesh_attention"`` block in ``training_args.deepspeed`` (model switched)."""
    ds_config = getattr(training_args, "hf_deepspeed_config", None)
    if ds_config is None:
        raise ValueError(
            "MeshCPTrainer needs layout=DataContextParallel.create(...), or TrainingArguments(deepspeed=...) whose "
            'config has an enabled "mesh_attention" block'
        )
    from mesh_cp.integrations.deepspeed import layout_from_config

    mesh_attention = layout_from_config(ds_config.config, model)
    if mesh_attention is None:
        raise ValueError(
            'the DeepSpeed config has no enabled "mesh_attention" block: add {"enabled": true, "cp_size": ..., '
            '"tile": ...} to it, or pass layout= to MeshCPTrainer'
        )
    return mesh_attention.layout


__all__ = [
    "ATTENTION_KEYWORDS",
    "IGNORE_INDEX",
    "DataContextParallel",
    "ShardedBatch",
    "ShardingCollator",
    "attach",
    "causal_lm_loss",
    "mesh_cp_attention",
    "mesh_cp_mask",
    "mesh_cp_trainer_class",
    "reduce_gradients",
    "register",
    "shard_batch",
]
