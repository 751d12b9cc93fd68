"""A sequence-tiled MLP and a fused (chunked) LM-head loss for an attached model: the per-token stages whose
activations grow with the tokens of a rank, run a slice of them at a time (Note [Tiled MLP and fused LM head]).

::

    model = hf.attach(model, mesh)
    hf.tile_mlp(model, shards=8)                         # DeepSpeed's TiledMLP in every decoder layer
    hf.fused_lm_head(model)                              # TRL's fused LM head: no [tokens, vocab] logits
    ddp = hf.data_parallel(model, mesh=mesh, static_graph=True)   # the tiled MLP needs DDP's static graph
    out = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, shift_labels=batch.shift_labels,
              num_items_in_batch=batch.num_items_in_batch, fused_lm_head=True)
    out.loss.backward()                                  # this rank's share, as hf.causal_lm_loss gives it

Note [Tiled MLP and fused LM head]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under CP a rank holds T = seq / P tokens of every sequence. The MLP and the LM head are per token, so running
them over slices of the rank's T tokens is exact by construction; only what a stage keeps changes:

    MLP      untiled: 4 [T, intermediate] saved per layer (gate, act(gate), up, their product) + the backward's
             temporaries; DeepSpeed's ``TiledMLP`` (ALST): the input only, the MLP recomputed in backward one
             slice at a time (``shards`` slices), its weights' gradients summed over the slices
    LM head  untiled: the [T, vocab] logits, their fp32 copy, log_softmax's output, three fp32 [T, vocab] in
             backward; TRL's ``ChunkedLogProbFunction`` (``add_fused_lm_head``): one [4096, 32768] tile of the
             logits at a time in forward and again in backward, the head's gradient accumulated in fp32

The loss keeps mesh_cp's normalisation: TRL's fused forward scores ``shift_labels`` as given (shifted on the whole
sequence before sharding) and divides the sum by ``num_items_in_batch`` (the label count of the whole batch), as
:func:`mesh_cp.runtime.batch.causal_lm_loss` does; a fused call without either is refused (:func:`fused_lm_head`).

What was not taken, and why:

- DeepSpeed's ``TiledFusedLogitsLoss`` runs the loss's backward inside its forward: the LM head's gradient is
  accumulated when the loss is computed, not when it is differentiated, so a loss scaled afterwards (gradient
  accumulation's division, fp16's loss scaling) scales the hidden states' gradient but not the head's, and DDP's
  reducer sees the head's gradient before its backward starts.
- DeepSpeed's ``sequence_tiled_compute`` with ``output_reduction="mean"`` averages the slices' means: the mean over
  tokens only when every slice has as many labels.

DeepSpeed's ``TiledMLP`` accumulates each slice's weight gradients in a backward of its own, so each weight's
gradient hook fires once per slice: torch DDP refuses that ("marked as ready twice") unless it is built with
``static_graph=True``, which counts the hook calls of the first step. ``TiledMLP`` recomputes the MLP outside
autocast and only for an input that requires a gradient: :func:`tile_mlp` re-enters the forward's autocast state
in the recomputation, and gives the MLP an input that requires a gradient whenever a weight of the MLP does
(an MLP whose input does not, such as the first layer's with the embeddings and attention frozen, would otherwise
get no gradient).
"""

from __future__ import annotations

import functools
import types

import torch

from mesh_cp.integrations.versions import require

MLP_NAMES: tuple[str, ...] = ("mlp", "feed_forward")
"""Attribute names of a decoder layer's MLP in transformers' models (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2:
``mlp``; Llama 4 and some others: ``feed_forward``)."""

TILES_ATTRIBUTE = "mesh_cp_mlp_tiles"
"""The attribute of a tiled MLP holding its number of slices (:func:`tile_mlp`)."""

FUSED_KEYWORDS: tuple[str, ...] = ("shift_labels", "num_items_in_batch")
"""What a call with ``fused_lm_head=True`` must be given under CP (:func:`fused_lm_head`)."""


def tile_mlp(model: torch.nn.Module, *, shards: int) -> torch.nn.Module:
    """Run the MLP of every decoder layer of ``model`` over ``shards`` slices of its tokens with DeepSpeed's
    ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``): its forward saves only its input, and its
    backward recomputes one slice at a time (Note [Tiled MLP and fused LM head]). ``shards=1`` puts the MLPs' own
    forward back. Returns ``model``.

    An MLP is a child named one of :data:`MLP_NAMES` of a module of ``model``. Refused by name: a mixture of experts
    (its router's outputs are read across the tokens), an MLP whose ``forward`` was already replaced on the
    instance, and (on a training forward) an MLP with dropout, whose recomputation would draw other masks. Under
    torch DDP build the wrapper with ``static_graph=True`` (``hf.data_parallel(model, mesh=mesh, static_graph=True)``;
    in a Trainer ``ddp_static_graph=True``); ZeRO and FSDP2 are not checked here.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"tile_mlp: shards must be an int >= 1 (slices of a rank's tokens), got {shards!r}")
    mlps = decoder_mlps(model)
    if not mlps:
        raise ValueError(
            f"tile_mlp: {type(model).__name__} has no decoder-layer MLP (a child named one of {list(MLP_NAMES)})"
        )
    for name, mlp in mlps:
        _check_tileable(name, mlp)
    if shards > 1:
        require("deepspeed")
    for _, mlp in mlps:
        if shards == 1:
            mlp.__dict__.pop("forward", None)
            mlp.__dict__.pop(TILES_ATTRIBUTE, None)
        else:
            setattr(mlp, TILES_ATTRIBUTE, shards)
            mlp.forward = types.MethodType(_tiled_forward, mlp)
    return model


def decoder_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``(qualified name, module)`` of every child of a module of ``model`` named one of :data:`MLP_NAMES`."""
    found = []
    for parent_name, parent in model.named_modules():
        for child in MLP_NAMES:
            module = parent._modules.get(child)
            if module is not None:
                found.append((f"{parent_name}.{child}" if parent_name else child, module))
    return found


def _check_tileable(name: str, mlp: torch.nn.Module) -> None:
    """Refuse, by name, an MLP that slices of the tokens would not compute exactly or that is not ours to patch."""
    kind = type(mlp).__name__
    if hasattr(mlp, "experts") or hasattr(mlp, "router"):
        raise NotImplementedError(
            f"tile_mlp: {name} ({kind}) is a mixture of experts: its router's logits and load-balancing statistics "
            f"are taken over the tokens it is given, and TiledMLP would give it one slice at a time; leave it untiled"
        )
    own = mlp.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is not _tiled_forward:
        raise NotImplementedError(
            f"tile_mlp: {name} ({kind}) already has a forward of its own on the instance ({own!r}); TiledMLP would "
            f"recompute the class's forward instead"
        )


def _tiled_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward :func:`tile_mlp` gives an MLP: DeepSpeed's ``TiledMLP`` over ``self.mesh_cp_mlp_tiles`` slices
    of ``x`` (``(..., tokens, hidden)``, sliced on the tokens), the class's forward recomputed in backward under
    this call's autocast state. Returns the MLP's output, shaped as ``x``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    if self.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.modules()):
        raise NotImplementedError(
            f"tile_mlp: {type(self).__name__} has dropout; its recomputation in backward would draw other masks than "
            f"its forward; set its dropout probability to 0 or untile it (hf.tile_mlp(model, shards=1))"
        )
    params = [p for p in self.parameters() if p.requires_grad]
    if params and torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_(True)  # otherwise TiledMLP's output needs no gradient, nor do the weights
    device = x.device.type
    state = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    slice_forward = functools.partial(_slice_forward, autocast=state)
    return TiledMLP.apply(slice_forward, self, x, getattr(self, TILES_ATTRIBUTE), params)


def _slice_forward(mlp: torch.nn.Module, x: torch.Tensor, *, autocast: tuple[bool, torch.dtype]) -> torch.Tensor:
    """The class's forward of ``mlp`` on one slice ``x``, under the autocast state ``(enabled, dtype)`` of the
    tiled forward (TiledMLP recomputes in backward, where autocast is off). Returns the slice's output."""
    enabled, dtype = autocast
    with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
        return type(mlp).forward(mlp, x)


def fused_lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, the one ``SFTTrainer`` adds):
    called with ``fused_lm_head=True``, ``shift_labels`` and ``num_items_in_batch``, its forward returns no logits
    and ``loss`` = minus the log-probabilities of ``shift_labels`` summed over this rank's tokens, divided by
    ``num_items_in_batch`` (what :func:`mesh_cp.runtime.batch.causal_lm_loss` gives from the logits), computed one
    tile of the logits at a time (Note [Tiled MLP and fused LM head]). Without ``fused_lm_head`` the forward is the
    model's own. Returns ``model``; a model that has the head already is returned as it is.

    Refused by name: an LM head with a PEFT adapter (TRL reads ``lm_head.weight`` directly: the adapter would not
    train), and a fused call without ``shift_labels`` or ``num_items_in_batch`` (TRL would shift this rank's shard
    of the labels itself, or divide by this rank's label count: the loss summed over the CP group would be wrong).
    Call it on the model that trains (TRL's patched forward keeps the original model's own forward: a
    ``copy.deepcopy`` of a patched model runs the original's forward without ``fused_lm_head``).
    """
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"fused_lm_head: {type(model).__name__} has no output embeddings with a weight (an LM head)")
    if hasattr(head, "base_layer"):
        raise NotImplementedError(
            f"fused_lm_head: the LM head of {type(model).__name__} is a PEFT adapter ({type(head).__name__}); TRL's "
            f"fused head multiplies by lm_head.weight directly, so the adapter would never train; leave lm_head out of "
            f"target_modules (modules_to_save trains the head itself)"
        )
    if getattr(model, "mesh_cp_fused_lm_head", False):
        return model
    require("trl")
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)
    model.register_forward_pre_hook(_check_fused_call, with_kwargs=True)
    model.mesh_cp_fused_lm_head = True
    return model


def _check_fused_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a model given :func:`fused_lm_head`: a call with ``fused_lm_head=True`` must be given
    ``shift_labels`` and ``num_items_in_batch`` (refused otherwise, naming the missing one)."""
    if not kwargs.get("fused_lm_head"):
        return
    missing = [k for k in FUSED_KEYWORDS if kwargs.get(k) is None]
    if missing:
        raise ValueError(
            f"{type(model).__name__} was called with fused_lm_head=True without {' and '.join(missing)}: TRL's fused "
            f"head would shift this rank's shard of the labels itself (pairing tokens wrongly at the seams of the "
            f"chunks) or divide by this rank's label count; pass batch.shift_labels and batch.num_items_in_batch of "
            f"hf.shard_batch / ShardingCollator"
        )
