"""Short-convolution layers (LFM2's ``Lfm2ShortConv``, LFM2-MoE's ``Lfm2MoeShortConv``): ``in_proj`` gives B, C and
x per channel; the causal depthwise convolution of ``B * x``, gated by C, mixes the sequence per channel
(Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`). No heads: each rank takes ``hidden / P`` channels."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, index, share, split_reason


def _width(layer) -> int:
    return layer.conv.in_channels


def _heads(layer, world: int) -> str | None:
    return split_reason("channels", _width(layer), world)


def _channels(layer, world: int, rank: int) -> list[int]:
    return list(share(_width(layer), world, rank))


def _in_proj(layer, world: int, rank: int) -> list[int]:
    # B, C and x of the rank's channels: C gates the convolution's output inside the core
    mine, width = _channels(layer, world, rank), _width(layer)
    return [part * width + c for part in range(3) for c in mine]


def _attributes(layer, world: int) -> dict[str, Any]:
    return {}


def _parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    mine = index(_channels(layer, world, rank), layer.conv.weight)
    params = {"conv.weight": layer.conv.weight.index_select(0, mine)}
    if layer.conv.bias is not None:
        params["conv.bias"] = layer.conv.bias.index_select(0, mine)
    return params


def _tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    return layer.out_proj(core)


SHORT_CONV = MixerSpec(
    family="short convolution (LFM2)",
    heads=_heads,
    entries={"in_proj": _in_proj},
    attributes=_attributes,
    parameters=_parameters,
    exit="out_proj",
    outputs=_channels,
    tail=_tail,
    width=_width,
)

SPECS: dict[str, MixerSpec] = {"Lfm2ShortConv": SHORT_CONV, "Lfm2MoeShortConv": SHORT_CONV}
