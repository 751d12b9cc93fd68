"""Sequence mixers other than attention (Gated DeltaNet, KDA, lightning attention, Mamba 1 and 2, short
convolutions) under :func:`~mesh_cp.integrations.hf.attach.attach`: each runs head-parallel over the CP group
(Note [Head-parallel mixers] in :mod:`mesh_cp.runtime.mixers`), through transformers' own layer code.

Note [Mixer cores]
~~~~~~~~~~~~~~~~~~
transformers' mixer layers are one ``forward`` each: input projections, a short convolution, a scan, a gated
norm, an output projection. mesh_cp runs that same ``forward`` for a share of the heads over the whole sequence,
without copying its code:

- the input projections run as they are on this rank's tokens (all channels);
- the channels the core of this rank's heads reads are exchanged (tokens -> channels, the whole sequence);
- a *core*, a shallow copy of the layer whose attributes say ``heads / P`` heads (``num_heads``,
  ``intermediate_size``, ...) and whose per-channel parameters (convolution weights, ``A_log``, ``dt_bias``,
  ``D``) are this rank's slices, runs ``forward`` with its input projections replaced by the exchanged tensors;
- the core stops where the layer calls its *exit* module (the gated norm, or the output projection), whose
  first argument is the core's output; it is exchanged back (channels -> tokens), and the rest of the layer
  (the gate, the norm, the output projection: per token) runs on this rank's tokens with the layer's own modules.

Gradients reach the layer's parameters through the slices: each rank's share, summed over the CP group by the
gradient reduction as every other gradient. The core runs in eval mode: transformers then takes its unfused path
(the CUDA kernels of the scan and the convolution, where installed, not the kernel that fuses the norm and the
output projection, which the core must stop before). A row with documents or padding (``mesh_cp_mask``) runs
the core over every document alone, so a state starts at zero at every document start, as the single process
computes each document alone; documents within a power of two of each other's length run as one batch of rows,
padded on the right (the core is causal).

A layer kind is described by a :class:`MixerSpec` (one module per kind in :mod:`mesh_cp.integrations.hf.mixers`): which
projections feed the core and which of their channels each rank's heads read, the core's attributes and
parameter slices, its exit, and the rest of the layer.
"""

from __future__ import annotations

import collections
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mesh_cp.core.masks import AttentionMask
from mesh_cp.integrations.hf.mixer_spec import MixerSpec
from mesh_cp.integrations.hf.mixers import SPECS
from mesh_cp.integrations.hf.model_checks import refuse_other_sequence_mixers
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.mixers import channels_to_tokens, tokens_to_channels

MIXER_KEYWORDS: dict[str, str] = {
    "mesh_cp_mask": "the batch's documents and padding: the core runs over each document alone",
    "position_ids": "this rank's positions (checked by the attention layers); a mixer does not read them",
    "position_embeddings": "RoPE tables that ride along the layer call; a mixer does not read them",
    "use_cache": "rides along; the cache a model makes for itself keeps no state of the mixer layers (the attached "
    "model takes no such cache in a later call), and generation over a sharded cache is refused",
    "output_attentions": "only False or None",
    "output_hidden_states": "an output switch that rides along the model call; a mixer does not read it",
    "output_router_logits": "an MoE output switch that rides along the model call; a mixer does not read it",
    "num_items_in_batch": "a loss argument that rides along the model call; a mixer does not read it",
    "shift_labels": "a loss argument that rides along the model call; a mixer does not read it",
}
"""Every keyword a mixer layer under mesh_cp accepts, and what is done with it; any other raises
``NotImplementedError`` naming it (``cu_seq_lens_*`` and ``seq_idx``: mesh_cp's documents come as
``mesh_cp_mask``)."""


class _Exit(Exception):
    """Raised by the core's exit module to end the core, carrying the core's output."""

    def __init__(self, value: Tensor):
        super().__init__("mixer core exit")
        self.value = value


class _Given(torch.nn.Module):
    """Stands for an input projection in the core: returns the exchanged channels, whatever it is given."""

    def __init__(self, value: Tensor):
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs) -> Tensor:
        return self.value


class _ExitModule(torch.nn.Module):
    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        raise _Exit(x)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` sharing its tensors, with its own parameter and child dicts and no hooks."""
    copy = module.__class__.__new__(module.__class__)
    state = dict(module.__dict__)
    state["_parameters"], state["_modules"] = dict(module._parameters), dict(module._modules)
    state["_buffers"] = dict(module._buffers)
    for name in _HOOK_DICTS:
        if name in state:
            state[name] = collections.OrderedDict()
    for name in ("forward", "_hf_hook", "mesh_cp_mixer"):
        state.pop(name, None)
    copy.__dict__ = state
    return copy


def _set(module: torch.nn.Module, dotted: str, value: Tensor) -> None:
    """Put ``value`` as parameter ``dotted`` of ``module`` (a shallow copy), copying the children on the way."""
    *path, leaf = dotted.split(".")
    for name in path:
        child = _shallow(module._modules[name])
        module._modules[name] = child
        module = child
    if leaf in module._parameters:
        module._parameters[leaf] = value
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise AssertionError(f"{type(module).__name__} has no parameter or buffer {leaf!r}")


def _put(module: torch.nn.Module, dotted: str, child: torch.nn.Module) -> None:
    """Put ``child`` as submodule ``dotted`` of ``module`` (a shallow copy), copying the modules on the way."""
    *path, leaf = dotted.split(".")
    for name in path:
        copied = _shallow(module._modules[name])
        module._modules[name] = copied
        module = copied
    module._modules[leaf] = child


@dataclass
class _Plan:
    """A layer's channel sets at one ``P`` (host lists, made once), and their device copies."""

    entries: dict[str, tuple[list[Tensor], Tensor | None, int]]
    """Projection -> (real channels of every rank, index placing this rank's zeros, zero count)."""
    outputs: list[Tensor]
    cached: dict[torch.device, Any]


def _make_plan(layer: torch.nn.Module, spec: MixerSpec, mesh: CPMesh) -> _Plan:
    world, rank = mesh.size, mesh.rank
    entries = {}
    for name, channels in spec.entries.items():
        per_rank = [channels(layer, world, r) for r in range(world)]
        real = [torch.tensor([c for c in chs if c >= 0], dtype=torch.long) for chs in per_rank]
        mine = per_rank[rank]
        zeros = sum(1 for c in mine if c < 0)
        place = None
        if zeros:  # real channels first, then one zero column for every placeholder
            seen = iter(range(len(mine) - zeros))
            place = torch.tensor([next(seen) if c >= 0 else len(mine) - zeros for c in mine], dtype=torch.long)
        entries[name] = (real, place, zeros)
    outputs = [torch.tensor(spec.outputs(layer, world, r), dtype=torch.long) for r in range(world)]
    placed = torch.cat(outputs)
    if not torch.equal(torch.sort(placed).values, torch.arange(spec.width(layer))):
        raise AssertionError(f"{type(layer).__name__}: the ranks' core outputs do not cover its channels once each")
    return _Plan(entries, outputs, {})


class HybridMixer:
    """What :func:`attach` gives a mixer layer: its spec, the mesh, and the forward that runs it head-parallel.
    Installed as the layer's ``forward`` (removed by a later :func:`attach` or by detaching)."""

    def __init__(self, layer: torch.nn.Module, spec: MixerSpec, attached: Any):
        self.spec, self.attached = spec, attached
        mesh = attached.mesh
        self.plan = _make_plan(layer, spec, mesh)

    @torch.compiler.disable(reason="a mixer layer under mesh_cp communicates over the CP group; it runs eagerly")
    def forward(self, layer: torch.nn.Module, hidden_states: Tensor, *args, **kwargs) -> Any:
        given = _bind(layer, hidden_states, args, kwargs)
        cache = given.pop("cache", None)
        cache = given.pop("cache_params", cache)
        cache = given.pop("past_key_values", cache)
        attention_mask = given.pop("attention_mask", None)
        kwargs = given
        name = type(layer).__name__
        # A cache the model made for itself in a forward (use_cache=True) is left without this layer's states: the
        # attached model refuses any cache but a ShardedKVCache as the cache of a later call.
        if hasattr(cache, "decoding"):
            raise NotImplementedError(
                f"{name} ({self.spec.family}) was given a ShardedKVCache: generation with mesh_cp does not shard recurrent "
                f"(Mamba, linear-attention, convolution) caches; generate with the model on one process"
            )
        if attention_mask is not None:
            raise NotImplementedError(
                f"{name} was given an attention_mask: under mesh_cp, padding and documents reach a mixer as the "
                f"batch's mesh_cp_mask; pass the attention_mask to shard_batch / ShardingCollator, not to the model"
            )
        unknown = sorted(k for k in kwargs if k not in MIXER_KEYWORDS)
        if unknown:
            raise NotImplementedError(
                f"{name} under mesh_cp does not take {', '.join(map(repr, unknown))}: documents come as the batch's "
                f"mesh_cp_mask; it takes {sorted(MIXER_KEYWORDS)}"
            )
        if kwargs.get("output_attentions"):
            raise NotImplementedError(f"{name}: output_attentions=True; a mixer layer has no attention weights")
        mask = kwargs.get("mesh_cp_mask", self.attached.mask)
        return self.run(layer, hidden_states, mask)

    def run(self, layer: torch.nn.Module, hidden_states: Tensor, mask: AttentionMask | None) -> Any:
        spec, mesh, layout = self.spec, self.attached.mesh, self.attached.layout
        batch, seq_local, _ = hidden_states.shape
        device = hidden_states.device
        plan = self._device_plan(device)
        projections = {name: spec.project(layer, name, hidden_states) for name in spec.entries}
        given = self._exchange(projections, plan, mesh, layout)
        core = self._core(layer, mesh)
        seq = seq_local * mesh.size
        stand_in = hidden_states.new_zeros(()).expand(batch, seq, hidden_states.shape[-1])
        if mask is None or mask.documents is None:
            out = self._run_core(core, given, stand_in)
        else:
            out = self._run_documents(core, given, stand_in, mask, seq)
        mine = channels_to_tokens(out, plan["outputs"], spec.width(layer), mesh=mesh, layout=layout)
        return spec.tail(layer, mine, projections)

    def _exchange(self, projections: dict[str, Tensor], plan: dict, mesh: CPMesh, layout: str) -> dict[str, Tensor]:
        """Every input projection's channels for this rank's core, over the whole sequence: one all-to-all for all
        the projections together (their channels side by side), then zeros where the core reads placeholders."""
        sending = [name for name, (real, _, _) in plan["entries"].items() if real[mesh.rank].numel()]
        widths = tuple(projections[name].shape[-1] for name in sending)
        if widths not in plan["merged"]:
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            plan["merged"][widths] = [
                torch.cat(
                    [plan["entries"][name][0][rank] + offset for name, offset in zip(sending, offsets, strict=True)]
                )
                for rank in range(mesh.size)
            ]
        joined = torch.cat([projections[name] for name in sending], dim=-1)
        whole = tokens_to_channels(joined, plan["merged"][widths], mesh=mesh, layout=layout)
        parts = dict(
            zip(sending, whole.split([len(plan["entries"][n][0][mesh.rank]) for n in sending], dim=-1), strict=True)
        )
        given = {}
        for name, (_, place, zeros) in plan["entries"].items():
            part = parts.get(name, whole[..., :0])
            if zeros:
                part = torch.cat([part, part.new_zeros((*part.shape[:-1], 1))], dim=-1).index_select(-1, place)
            given[name] = part
        return given

    def exit_name(self, layer: torch.nn.Module) -> str:
        return self.spec.exit if isinstance(self.spec.exit, str) else self.spec.exit(layer)

    def _device_plan(self, device: torch.device) -> dict:
        if device not in self.plan.cached:
            self.plan.cached[device] = {
                "entries": {
                    name: ([c.to(device) for c in real], None if place is None else place.to(device), zeros)
                    for name, (real, place, zeros) in self.plan.entries.items()
                },
                "outputs": [c.to(device) for c in self.plan.outputs],
                "merged": {},
            }
        return self.plan.cached[device]

    def _core(self, layer: torch.nn.Module, mesh: CPMesh) -> torch.nn.Module:
        core = _shallow(layer)
        core.training = False  # the unfused path (Note [Mixer cores])
        core.__dict__["mesh_cp_mesh"] = mesh  # for a spec's call that reduces over the ranks (Mamba 1)
        for key, value in self.spec.attributes(layer, mesh.size).items():
            core.__dict__[key] = value
        for dotted, value in self.spec.parameters(layer, mesh.size, mesh.rank).items():
            _set(core, dotted, value)
        _put(core, self.exit_name(layer), _ExitModule())
        return core

    def _run_core(self, core: torch.nn.Module, given: dict[str, Tensor], stand_in: Tensor) -> Tensor:
        for name, value in given.items():
            _put(core, name, _Given(value))
        try:
            self.spec.call(core, stand_in)
        except _Exit as done:
            return done.value.reshape(stand_in.shape[0], stand_in.shape[1], -1)
        raise AssertionError(f"{type(core).__name__}'s forward did not call its exit ({self.spec.exit})")

    def _run_documents(
        self, core: torch.nn.Module, given: dict[str, Tensor], stand_in: Tensor, mask: AttentionMask, seq: int
    ) -> Tensor:
        """The core over every document of every row alone (its spans in order), zeros at padding. Documents of
        lengths within a power of two run as one batch, each padded on the right to the longest (the core is
        causal: what follows a document's last token cannot change its outputs)."""
        device = stand_in.device
        buckets: dict[int, list[tuple[int, Tensor]]] = {}
        for row in range(stand_in.shape[0]):
            for spans in mask.document_spans(row if mask.rows is not None else 0, seq):
                index = torch.cat([torch.arange(start, stop) for start, stop in spans])
                buckets.setdefault((index.numel() - 1).bit_length(), []).append((row, index))
        rows, positions, outputs = [], [], []
        for documents in buckets.values():
            longest = max(index.numel() for _, index in documents)
            part = {}
            for name, value in given.items():
                pieces = [value[row].index_select(0, index.to(device)) for row, index in documents]
                part[name] = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in pieces])
            out = self._run_core(core, part, stand_in[:1, :1].expand(len(documents), longest, -1))
            for (row, index), result in zip(documents, out, strict=True):
                outputs.append(result[: index.numel()])
                rows.append(torch.full((index.numel(),), row, dtype=torch.long))
                positions.append(index)
        width = outputs[0].shape[-1]
        out = stand_in.new_zeros((stand_in.shape[0], seq, width))
        return out.index_put((torch.cat(rows).to(device), torch.cat(positions).to(device)), torch.cat(outputs))


def mixer_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, MixerSpec]]:
    """The mixer layers of ``model`` with a spec in :data:`~mesh_cp.integrations.hf.mixers.SPECS` (by class)."""
    return [(name, m, SPECS[type(m).__name__]) for name, m in model.named_modules() if type(m).__name__ in SPECS]


def checked_mixers(
    model: torch.nn.Module, models: list[torch.nn.Module], mesh: CPMesh
) -> list[tuple[str, torch.nn.Module, MixerSpec]]:
    """The mixer layers of ``model``, each of whose heads split over the CP group's ``P`` ranks; refused by name
    otherwise, and so is a model with a sequence mixer that has no spec
    (:func:`~mesh_cp.integrations.hf.model_checks.refuse_other_sequence_mixers`)."""
    refuse_other_sequence_mixers(model, models, set(SPECS))
    layers = mixer_layers(model)
    for name, layer, spec in layers:
        why = spec.heads(layer, mesh.size)
        if why:
            raise NotImplementedError(
                f"{name} ({type(layer).__name__}, {spec.family}) runs head-parallel over the CP group of {mesh.size} "
                f"ranks, and {why}; use a CP size that splits them"
            )
    return layers


def attention_layers(
    model: torch.nn.Module, mixers: list[tuple[str, torch.nn.Module, MixerSpec]]
) -> list[tuple[str, torch.nn.Module]]:
    """The attention layers of ``model`` (modules with ``is_causal`` and ``config``), its ``mixers`` left out (a
    mixer called like attention, as MiniMax's lightning attention, is not one)."""
    skip = {id(m) for _, m, _ in mixers}
    return [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "is_causal") and hasattr(m, "config") and id(m) not in skip
    ]


def install(layer: torch.nn.Module, spec: MixerSpec, attached: Any) -> HybridMixer:
    """Make ``layer`` run head-parallel over ``attached.mesh`` (its ``forward`` replaced; see :func:`uninstall`)."""
    mixer = HybridMixer(layer, spec, attached)
    layer.mesh_cp_mixer = mixer
    layer.forward = types.MethodType(_forward, layer)  # a bound method: a deep copy of the model binds its copy
    return mixer


def _bind(layer: torch.nn.Module, hidden_states: Tensor, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``layer`` (positional ones by the names of its class's ``forward``), but the
    hidden states, in one dict; ``None`` values left out."""
    signature = inspect.signature(type(layer).forward)
    bound = signature.bind(layer, hidden_states, *args, **kwargs).arguments
    rest = {
        k: v for k, v in list(bound.items())[2:] if signature.parameters[k].kind is not inspect.Parameter.VAR_KEYWORD
    }
    for k, v in bound.items():
        if signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            rest.update(v)
    return {k: v for k, v in rest.items() if v is not None}


def _forward(layer: torch.nn.Module, *args, **kwargs) -> Any:
    return layer.mesh_cp_mixer.forward(layer, *args, **kwargs)


def uninstall(layer: torch.nn.Module) -> None:
    """Undo :func:`install`."""
    if layer.__dict__.pop("mesh_cp_mixer", None) is not None:
        layer.__dict__.pop("forward", None)
