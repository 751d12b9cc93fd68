"""Short-convolution layers (LFM2's ``Lfm2ShortConv``, LFM2-MoE's ``Lfm2MoeShortConv``): ``in_proj`` gives B, C and
x per channel; the causal depthwise convolution of ``B * x``, gated by C, mixes the sequence per channel
(Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`). No heads: each rank takes ``hidden / P`` channels.

Only the convolution mixes tokens: ``B * x`` is made on this rank's tokens and is all its core reads (one channel in
and one out per convolution channel); the core is handed ones for its B and C, so it convolves ``B * x`` as given
and returns the convolution, and the tail gates it with C on this rank's tokens before ``out_proj``. Multiplying by
one is exact, so the core's output is the layer's, bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, index, share, split_reason


def _width(layer) -> int:
    return layer.conv.in_channels


def _heads(layer, world: int) -> str | None:
    return split_reason("channels", _width(layer), world)


def _channels(layer, world: int, rank: int) -> list[int]:
    return list(share(_width(layer), world, rank))


def _project(layer, name: str, hidden_states: Tensor) -> Tensor:
    """``[B * x, C]`` of this rank's tokens: the convolution's input and the gate of its output."""
    b, c, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    return torch.cat([b * x, c], dim=-1)


def _attributes(layer, world: int) -> dict[str, Any]:
    return {}


def _parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    mine = index(_channels(layer, world, rank), layer.conv.weight)
    params = {"conv.weight": layer.conv.weight.index_select(0, mine)}
    if layer.conv.bias is not None:
        params["conv.bias"] = layer.conv.bias.index_select(0, mine)
    return params


class _OnesBeside(torch.nn.Module):
    """The core's ``in_proj``: ``[1, 1, B * x]`` (its B, C and x), ``B * x`` being what the exchange gave."""

    def __init__(self, given: torch.nn.Module):
        super().__init__()
        self.given = given

    def forward(self, *args, **kwargs) -> Tensor:
        bx = self.given(*args, **kwargs)
        return torch.cat([torch.ones_like(bx), torch.ones_like(bx), bx], dim=-1)


def _call(core, stand_in: Tensor) -> Any:
    core._modules["in_proj"] = _OnesBeside(core._modules["in_proj"])
    return core.forward(stand_in)


def _tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    gate = projections["in_proj"][..., _width(layer) :]
    return layer.out_proj(gate * core)


SHORT_CONV = MixerSpec(
    family="short convolution (LFM2)",
    heads=_heads,
    entries={"in_proj": _channels},  # B * x of the rank's channels
    attributes=_attributes,
    parameters=_parameters,
    exit="out_proj",
    outputs=_channels,
    tail=_tail,
    width=_width,
    call=_call,
    project=_project,
)

SPECS: dict[str, MixerSpec] = {"Lfm2ShortConv": SHORT_CONV, "Lfm2MoeShortConv": SHORT_CONV}
