"""Switching a transformers model to ``attn_implementation="mesh_cp"`` over a CP mesh, and the checks every
forward of the switched model runs (global ``position_ids``, every attention layer reached, RoPE that reads
the sequence length)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import mesh_cp
from mesh_cp.core.head_parallel import HeadCounts, check_head_parallel
from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.options import check_layout, check_option
from mesh_cp.integrations.hf.attention import NAME, register
from mesh_cp.integrations.hf.compat import given_cache
from mesh_cp.integrations.hf.hybrid import attention_layers, checked_mixers, install, uninstall
from mesh_cp.integrations.hf.model_checks import (
    LossCheck,
    absolute_position_tables,
    check_losses,
    own_configs,
    refuse_labels_of_one_process,
    refuse_left_padding,
    refuse_loss_elsewhere,
    refuse_pooled_heads,
    refuse_router_loss,
    refuse_temperature_tuning,
    restore_loss,
)
from mesh_cp.runtime.batch import document_positions
from mesh_cp.runtime.device_checks import check_on_device
from mesh_cp.runtime.mesh import CPMesh

LENGTH_DEPENDENT_ROPE: tuple[str, ...] = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the sequence length (``max(position_ids) + 1``); :func:`attach`
gives them the global length (Note [Length-dependent RoPE])."""

# Note [Length-dependent RoPE]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers' "dynamic" and "longrope" RoPE (modeling_rope_utils.dynamic_rope_update) pick their
# frequencies from seq_len = max(position_ids) + 1 of the call. On a CP rank that is the maximum of its
# own shard, which differs between ranks and from the whole sequence's. attach() gives such a rotary
# module one more position, S - 1 (S = P * seq_local, the whole sequence's last position), so it picks
# the frequencies of the whole sequence; cos and sin are computed position by position, and the extra
# row is cut from its output. Exact whenever position_ids are the layout's global positions (checked) of a
# row the single process sees at the same length S (the mesh pads a row to a multiple of 2P: pad it to that length
# yourself). With documents or padding (a mesh_cp_mask) positions restart and the length is the batch's longest
# document: refused.


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

    ``mesh`` may be a head-parallel x mesh hybrid (``CPMesh.create(group, tile=..., head_parallel=u)``): shard the batch
    with :func:`shard_batch` / :class:`ShardingCollator` over the same mesh (they follow its layout), and every
    layer's query heads must split over ``u`` and its K/V heads split or repeat (checked here).

    Checked, so that a model is exact or refused by name:

    - the switch happened: ``_attn_implementation`` is ``"mesh_cp"`` on the model and every sub-model (a model
      that does not compute attention through transformers' ``AttentionInterface``, such as Falcon, GPT-J,
      Bloom or MPT, keeps its own attention and is refused here), and on the first forward every attention
      layer (module with ``is_causal`` and ``config``) called :func:`mesh_cp_attention` (raised otherwise);
    - every forward of ``model`` gets ``position_ids`` equal to this rank's global positions in ``layout``
      (one check per ``position_ids`` tensor; the model would number a shard from 0, and packed batches
      restart positions per document);
    - other sequence mixers (Mamba, Gated DeltaNet, ...: :data:`~mesh_cp.integrations.hf.mixers.SPECS`) run
      head-parallel (:func:`~mesh_cp.integrations.hf.hybrid.checked_mixers`; other mixers are refused);
    - RoPE types in :data:`LENGTH_DEPENDENT_ROPE` are given the whole sequence's length (Note
      [Length-dependent RoPE]); ``attn_temperature_tuning`` (Llama 4), which scales queries by positions
      counted from 0 on each shard, is refused;
    - heads that read across the sequence (sequence classification, question answering: ``POOLED_HEADS`` in
      :mod:`~mesh_cp.integrations.hf.model_checks`) are refused; per-token heads are exact;
    - a forward given ``labels`` needs ``shift_labels`` and ``num_items_in_batch`` (mesh_cp's batches hold all three),
      and its loss must come from the model's ``loss_function`` with both (refused otherwise, by name).

    The model gets its own copies of its configs, so another model built from the same config object keeps its
    attention implementation.
    """
    _check_attach_arguments(model, mesh, schedule, backward, layout)
    from transformers import PreTrainedModel

    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    refuse_temperature_tuning(models)
    mixers = checked_mixers(model, models, mesh)
    refuse_pooled_heads(model, models)
    layers = attention_layers(model, mixers)
    _check_head_counts(layers, mesh)  # before the switch: a refused model is left as it was
    register()
    _detach(model)
    own_configs(model)
    model.set_attn_implementation(NAME)
    _check_switched(models)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers (modules with is_causal) to attach to")
    attached = _Attachment(mesh, layout, {"schedule": schedule, "backward": backward}, layers)
    attached.position_tables = absolute_position_tables(model)
    attached.losses = check_losses(models)
    for _, layer in layers:
        layer.mesh_cp_attached = attached
    for _, layer, spec in mixers:
        install(layer, spec, attached)
    _hook_length_dependent_rope(model, attached)
    model.register_forward_pre_hook(attached.before_forward, with_kwargs=True)
    model.register_forward_hook(attached.after_forward, with_kwargs=True)
    return model


def _check_attach_arguments(model: torch.nn.Module, mesh: CPMesh, schedule: str, backward: str, layout: str) -> None:
    """The arguments of :func:`attach`, each named with its accepted values when refused."""
    if not isinstance(mesh, CPMesh):
        raise ValueError(f"mesh must be a mesh_cp.CPMesh, got {type(mesh).__name__}")
    check_option("schedule", schedule)
    check_option("backward", backward)
    check_layout(layout)
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")


def _check_head_counts(layers: list[tuple[str, torch.nn.Module]], mesh: CPMesh) -> None:
    """With head-parallel ranks (``mesh.head_parallel > 1``), every layer's query heads must split over them and
    its K/V heads split or repeat (:func:`mesh_cp.core.check_head_parallel`); refused here, before any forward."""
    if mesh.head_parallel == 1:
        return
    for name, layer in layers:
        heads = getattr(layer.config, "num_attention_heads", None)
        if not isinstance(heads, int):
            continue  # checked by the attention call itself
        kv_heads = getattr(layer.config, "num_key_value_heads", None) or heads
        try:
            check_head_parallel(mesh.size, mesh.head_parallel, HeadCounts(heads, kv_heads))
        except ValueError as err:
            raise ValueError(f"{name} ({type(layer).__name__}): {err}") from None


def _check_switched(models: list[torch.nn.Module]) -> None:
    """The model and every sub-model took ``attn_implementation="mesh_cp"``: one that keeps its own attention
    would attend over this rank's shard only."""
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


def _hook_length_dependent_rope(model: torch.nn.Module, attached: _Attachment) -> None:
    """Give every rotary module of a type in :data:`LENGTH_DEPENDENT_ROPE` the whole sequence's length (Note
    [Length-dependent RoPE])."""
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        rope_types = rope_types.values() if isinstance(rope_types, Mapping) else [rope_types]
        if any(isinstance(t, str) and any(d in t for d in LENGTH_DEPENDENT_ROPE) for t in rope_types):
            module.register_forward_pre_hook(attached.rope_before, with_kwargs=True)
            module.register_forward_hook(attached.rope_after, with_kwargs=True)


def _detach(model: torch.nn.Module) -> None:
    """Remove what an earlier :func:`attach` added to ``model`` (hooks, loss checks, the layers' attachment)."""
    for module in model.modules():
        module.__dict__.pop("mesh_cp_attached", None)
        uninstall(module)
        restore_loss(module)
        for hooks, extras in (
            (module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
            (module._forward_hooks, (module._forward_hooks_with_kwargs,)),
        ):
            for hook_id in [i for i, h in hooks.items() if isinstance(getattr(h, "__self__", None), _Attachment)]:
                del hooks[hook_id]
                for extra in extras:
                    extra.pop(hook_id, None)


_POSITIONS_KIND = "(global positions, or positions inside each document of the mesh_cp_mask)"
_POSITIONS_FIX = (
    "a shard numbered from 0 would be silently wrong, and packed rows (positions restarting per document) need the "
    "mesh_cp_mask of their documents; pass the position_ids and mesh_cp_mask of shard_batch / ShardingCollator, or of "
    "hf.ShardCollated(your_collator, mesh) (what hf.mesh_cp_trainer_class(...) uses, TRL's packing included)"
)
_POSITIONS_MESSAGE = (
    f"position_ids are not this rank's positions of its tokens {_POSITIONS_KIND}, in every row: {_POSITIONS_FIX}"
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
        self._checked: tuple[weakref.ref, tuple[int, int]] | None = None
        self._expected: dict[tuple[int, torch.device], Tensor] = {}
        self._position_kinds: set[tuple] = set()
        self.decoding = False
        """This forward decodes over a sharded cache (set by :meth:`before_forward`)."""
        self.documents = False
        """This forward's rows have documents or padding (positions restart): set by :meth:`before_forward`."""
        self.position_tables: list[str] = []
        """The model's learned absolute position tables (left padding is refused with them)."""
        self.losses: list[LossCheck] = []
        """The checks in place of the models' ``loss_function`` (the outermost model's first)."""
        self.labels = False  # this forward was given labels (set by before_forward)
        self.mask: AttentionMask | None = None  # this forward's mesh_cp_mask, for mixers not given it

    def check_positions(self, position_ids: Tensor, mask: AttentionMask | None = None) -> None:
        """``position_ids`` must be this rank's positions of its tokens in every row: global positions
        (:func:`mesh_cp.position_ids`) of one sequence of ``P * seq_local`` tokens, or, for a batch with documents
        (``mask``, the ``mesh_cp_mask`` of the call), positions inside each document
        (:func:`mesh_cp.runtime.batch.document_positions`). Checked once per tensor (identity and version), so once
        per forward however many layers pass it on. The first tensor of each (shape, device, dtype) is compared on
        the host (a clear error naming the positions); later ones, a new tensor every step, are compared where
        they are with ``torch._assert_async`` (on a GPU a wrong tensor stops the run with a device-side assertion
        at the next synchronisation, with no host read per step; on the CPU the same ``ValueError`` at once)."""
        state = (position_ids._version, id(mask))
        if self._checked is not None and self._checked[0]() is position_ids and self._checked[1] == state:
            return
        seq_local = position_ids.shape[-1]
        expected = self._expected_positions(seq_local, position_ids, mask)
        kind = (tuple(position_ids.shape), position_ids.device, position_ids.dtype, mask is None)
        if expected is not None and position_ids.dim() <= 2 and kind in self._position_kinds:
            try:  # raises at once on the CPU only; then the error shows where they differ
                check_on_device((position_ids == expected).all(), ValueError(_POSITIONS_MESSAGE))
            except ValueError:
                raise self._positions_error(position_ids, expected) from None
        elif expected is None or position_ids.dim() > 2 or not bool((position_ids == expected).all()):
            raise self._positions_error(position_ids, expected)
        self._position_kinds.add(kind)
        self._checked = (weakref.ref(position_ids), state)

    def _positions_error(self, position_ids: Tensor, expected: Tensor | None) -> ValueError:
        """The error of :meth:`check_positions`: the first row and index where ``position_ids`` differ from
        ``expected``, with the values got and expected around it."""
        seq_local = position_ids.shape[-1]
        wrong = (
            f"position_ids are not this rank's positions of a sequence of {seq_local * self.mesh.size} tokens in "
            f"the {self.layout} layout {_POSITIONS_KIND}"
        )
        if position_ids.dim() > 2:
            return ValueError(
                f"{wrong}: they have shape {tuple(position_ids.shape)}, and mesh_cp takes (batch, sequence) positions "
                f"(not the several position axes of multimodal RoPE); {_POSITIONS_FIX}"
            )
        if expected is None:
            return ValueError(
                f"{wrong}: no positions fit a shard of shape {tuple(position_ids.shape)} (a sequence length the layout "
                f"does not take, or rows other than the mesh_cp_mask's); {_POSITIONS_FIX}"
            )
        got = position_ids.reshape(-1, seq_local).cpu()
        want = expected.reshape(-1, seq_local).cpu().expand_as(got)
        row, index = (got != want).nonzero()[0].tolist()
        start, stop = max(index - 3, 0), min(index + 4, seq_local)
        return ValueError(
            f"{wrong}: row {row} first differs at index {index} of {seq_local}, at indices {start}..{stop - 1} got "
            f"{_window(got[row].tolist(), start, stop)}, expected {_window(want[row].tolist(), start, stop)}; "
            f"{_POSITIONS_FIX}"
        )

    def _expected_positions(self, seq_local: int, position_ids: Tensor, mask: AttentionMask | None) -> Tensor | None:
        """What :meth:`check_positions` compares with; ``None`` when no positions can fit (a length the layout
        does not take, or a mask for another number of rows)."""
        seq = seq_local * self.mesh.size
        if seq % self.mesh.seq_multiple(self.layout):
            return None
        device = position_ids.device
        if mask is not None and mask.documents is not None:
            if position_ids.dim() != 2 or position_ids.shape[0] != mask.rows:
                return None
            return document_positions(mask, mask.rows, seq, mesh=self.mesh, layout=self.layout, device=device)
        key = (seq_local, device)
        if key not in self._expected:
            self._expected[key] = mesh_cp.position_ids(seq, mesh=self.mesh, layout=self.layout, device=device)
        return self._expected[key]

    # The hooks run eagerly under torch.compile, like the attention (Note [Opaque to torch.compile] in
    # mesh_cp.runtime.attention): their bookkeeping of the previous forward would otherwise be guarded on and
    # recompiled.
    @torch.compiler.disable(reason="mesh_cp's per-forward checks read host state; they run eagerly")
    def before_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the attached model: check ``position_ids``, start the layer count. A step of decoding
        over a :class:`~mesh_cp.integrations.hf.shard_cache.ShardedKVCache` that holds tokens feeds every rank the same
        new tokens at their own positions (Note [Sharded generation]): not a shard, so not checked as one."""
        self.called.clear()
        self.labels = False
        for check in self.losses:
            check.calls = 0
        cache = given_cache(kwargs)
        if cache is not None and not hasattr(cache, "decoding"):
            raise NotImplementedError(
                f"{type(model).__name__} was called with a {type(cache).__name__}: with mesh_cp attention, generate "
                f"through mesh_cp.integrations.hf.generate (or prefill's ShardedKVCache), which shards the cache"
            )
        self.decoding = getattr(cache, "decoding", False) is True
        if self.decoding:
            return
        given = (
            {**inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments, **kwargs} if args else kwargs
        )
        positions = given.get("position_ids")
        if positions is None:
            raise ValueError(
                f"{type(model).__name__} was called without position_ids: it would number this rank's shard from 0; "
                f"pass the global positions of shard_batch / ShardingCollator (batch.position_ids)"
            )
        mask = kwargs.get("mesh_cp_mask")
        self.mask = mask
        self.check_positions(positions, mask)
        self.documents = mask is not None and mask.documents is not None
        refuse_router_loss(model, kwargs)
        self.labels = given.get("labels") is not None
        loss = self.losses[0].function if self.losses else None
        refuse_labels_of_one_process(model, given.get("labels"), kwargs, loss)
        if cache is None:  # a prefill numbers left-padded rows from their first real token, as generate does
            refuse_left_padding(model, self.position_tables, mask)

    @torch.compiler.disable(reason="mesh_cp's per-forward checks read host state; they run eagerly")
    def after_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of the attached model: on the first forward, check that every attention layer called
        :func:`mesh_cp_attention`; given labels, that a loss was made through the model's ``loss_function``."""
        refuse_loss_elsewhere(model, {**kwargs, "labels": self.labels or None}, output, self.losses)
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
        if self.decoding:
            raise NotImplementedError(
                f"{type(module).__name__} (rope_type {module.rope_type!r}) depends on the sequence length, which "
                f"decoding over a sharded cache does not give it; generate with a model whose RoPE does not"
            )
        if self.documents:
            raise NotImplementedError(
                f"{type(module).__name__} (rope_type {module.rope_type!r}) picks its frequencies from the longest "
                f"position of the call, which with documents or padding (a mesh_cp_mask) is the longest document of "
                f"the whole batch, not known on a rank; train such a model on rows without packing or padding"
            )
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


def _window(values: list[int], start: int, stop: int) -> str:
    """``values[start:stop]`` as a list, with ``...`` where values were left out before or after."""
    shown = [*(["..."] if start > 0 else []), *map(str, values[start:stop]), *(["..."] if stop < len(values) else [])]
    return f"[{', '.join(shown)}]"
