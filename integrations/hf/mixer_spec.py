"""What a mixer layer kind must say to run head-parallel under :func:`~mesh_cp.integrations.hf.attach.attach`
(:class:`MixerSpec`, Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`), and the channel arithmetic the
specs of :mod:`mesh_cp.integrations.hf.mixers` share: heads split contiguously over the ranks, rank after rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Channels = Callable[[torch.nn.Module, int, int], list[int]]
"""``(layer, P, rank) ->`` channel indices; ``-1`` stands for a channel the core reads but does not use (a
gate it passes on to the exit), given as zeros and never sent."""


@dataclass(frozen=True)
class MixerSpec:
    """How one kind of mixer layer runs head-parallel (Note [Mixer cores])."""

    family: str
    """The model families with this layer, for messages and docs."""
    heads: Callable[[torch.nn.Module, int], str | None]
    """``(layer, P) ->`` why the layer's heads do not split over ``P`` ranks (``None`` when they do)."""
    entries: Mapping[str, Channels]
    """Input projection (submodule name, dotted for a grandchild) -> the channels of its output rank ``r``'s core
    reads, in the order the core reads them. All projections travel in one all-to-all."""
    attributes: Callable[[torch.nn.Module, int], dict[str, Any]]
    """``(layer, P) ->`` the core's attributes (head counts and widths of one rank's share)."""
    parameters: Callable[[torch.nn.Module, int, int], dict[str, Tensor]]
    """``(layer, P, rank) ->`` the core's parameters (and buffers) by dotted name: slices of the layer's own."""
    exit: str | Callable[[torch.nn.Module], str]
    """The submodule (dotted name, or ``layer ->`` it) whose call ends the core: its first argument is the core's
    output."""
    outputs: Channels
    """The channels of the core's output (reshaped to ``(batch, seq, -1)``) rank ``r`` computes."""
    tail: Callable[[torch.nn.Module, Tensor, dict[str, Tensor]], Any]
    """``(layer, core output of this rank's tokens (batch, seq_local, width), input projections of its tokens) ->``
    what the layer returns."""
    width: Callable[[torch.nn.Module], int]
    """The core output's channels, all ranks together."""
    call: Callable[[torch.nn.Module, Tensor], Any] = lambda core, x: core.forward(x)
    """How the core's ``forward`` is called, given a stand-in for the hidden states of the right shape."""
    project: Callable[[torch.nn.Module, str, Tensor], Tensor] = lambda layer, name, x: layer.get_submodule(name)(x)
    """``(layer, entry, hidden states of this rank's tokens) ->`` the entry's projection, as the layer's ``forward``
    computes it (Falcon-H1 scales the hidden states first)."""


def core_channels(layer: torch.nn.Module, spec: MixerSpec, world: int, rank: int = 0) -> tuple[int, int]:
    """The channels rank ``rank``'s core reads (over all input projections, placeholders left out) and writes: what
    it exchanges per token (:func:`mesh_cp.core.mixers.mixer_exchange_bytes`)."""
    read = sum(sum(1 for c in channels(layer, world, rank) if c >= 0) for channels in spec.entries.values())
    return read, len(spec.outputs(layer, world, rank))


def span(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def share(total: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``total`` heads (``world`` divides ``total``)."""
    n = total // world
    return range(rank * n, (rank + 1) * n)


def split_reason(what: str, count: int, world: int) -> str | None:
    return None if count % world == 0 else f"its {count} {what} do not split over {world} ranks"


def grouped_reason(groups_what: str, groups: int, heads_what: str, heads: int, world: int) -> str | None:
    """Heads in groups (GQA-like): the heads split over the ranks, and the groups too or each rank's heads lie in
    one group (``world`` a multiple of the group count)."""
    return split_reason(heads_what, heads, world) or (
        None
        if groups % world == 0 or world % groups == 0
        else f"its {groups} {groups_what} neither split over {world} ranks nor divide it"
    )


def groups_of(groups: int, heads: int, world: int, rank: int) -> range:
    """The groups rank ``rank``'s heads belong to (one group, or a contiguous share of them)."""
    if groups % world == 0:
        return share(groups, world, rank)
    first = share(heads, world, rank)[0] // (heads // groups)
    return range(first, first + 1)


def index(channels, like: Tensor) -> Tensor:
    return torch.tensor(list(channels), dtype=torch.long, device=like.device)
