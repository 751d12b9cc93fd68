"""Kimi Delta Attention layers (Kimi Linear's ``KimiLinearDeltaAttention``): the delta rule per head with a decay per
channel, as many key heads as value heads (Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, index, share, span, split_reason

# KDA (Kimi Linear): q_proj, k_proj, v_proj (heads x head_dim each) concatenated into the conv's channels; b_proj one
# channel per head; the forget gate: f_b_proj(f_a_proj(x)) (a low-rank projection to heads x head_dim) plus dt_bias
# per channel, times exp(A_log) per head; the output gate g_b_proj(g_a_proj(x)), read by the exit only; exit:
# o_norm(core, gate) per head; then o_proj.


class _Zeros(torch.nn.Module):
    """Stands for the output gate's up-projection in the core (the exit does not read the gate): zeros of
    ``width`` channels."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros((*x.shape[:-1], self.width))


def _kda_heads(layer, world: int) -> str | None:
    """Why the heads do not split over ``world`` ranks (``None`` when they do)."""
    return split_reason("heads", layer.num_heads, world)


def _kda_channels(layer, world: int, rank: int) -> list[int]:
    """The channels of this rank's heads in a ``heads x head_dim`` projection."""
    hd = layer.head_dim
    return [c for h in share(layer.num_heads, world, rank) for c in span(h * hd, hd)]


def _kda_head_channels(layer, world: int, rank: int) -> list[int]:
    """One channel per head (b): this rank's heads."""
    return list(share(layer.num_heads, world, rank))


def _kda_forget_input(layer, world: int, rank: int) -> list[int]:
    """All channels of the forget gate's low-rank input (``forget_gate.f_a_proj``): every head reads it whole;
    ``f_b_proj`` and the rest of the gate run in the core on this rank's rows."""
    return list(range(layer.forget_gate.f_a_proj.out_features))


def _kda_gate_placeholder(layer, world: int, rank: int) -> list[int]:
    """The output gate's low-rank input: the core reads it for the exit only, so nothing of it is sent."""
    return [-1] * layer.g_a_proj.out_features


def _kda_conv_channels(layer, world: int, rank: int) -> list[int]:
    """The conv's channels of this rank's heads: their q, k and v."""
    mine = _kda_channels(layer, world, rank)
    return [part * layer.qkv_dim + c for part in range(3) for c in mine]


def _kda_attributes(layer, world: int) -> dict[str, Any]:
    """The core's head count and widths (one rank's share)."""
    qkv = layer.qkv_dim // world
    return {"num_heads": layer.num_heads // world, "qkv_dim": qkv, "conv_dim": 3 * qkv}


def _kda_parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    """This rank's slices of the conv, the forget gate's up-projection, ``dt_bias`` and ``A_log``."""
    like = layer.conv1d.weight
    heads = index(share(layer.num_heads, world, rank), like)
    channels = index(_kda_channels(layer, world, rank), like)
    conv = index(_kda_conv_channels(layer, world, rank), like)
    forget = layer.forget_gate
    params = {
        "conv1d.weight": layer.conv1d.weight.index_select(0, conv),
        "forget_gate.f_b_proj.weight": forget.f_b_proj.weight.index_select(0, channels),
        "forget_gate.dt_bias": forget.dt_bias.index_select(0, channels),
        "forget_gate.A_log": forget.A_log.index_select(2, heads),
    }
    if layer.conv1d.bias is not None:
        params["conv1d.bias"] = layer.conv1d.bias.index_select(0, conv)
    if forget.f_b_proj.bias is not None:
        params["forget_gate.f_b_proj.bias"] = forget.f_b_proj.bias.index_select(0, channels)
    return params


def _kda_call(core, x: Tensor) -> Any:
    """The core's ``forward``, its output gate's up-projection giving zeros."""
    core._modules["g_b_proj"] = _Zeros(core.qkv_dim)
    return core.forward(x)


def _kda_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    """The layer's output on this rank's tokens: o_proj(o_norm(core, g_b_proj(g_a_proj(x)))) per head."""
    shape = (*core.shape[:2], -1, layer.head_dim)
    gate = layer.g_b_proj(projections["g_a_proj"]).view(shape)
    return layer.o_proj(layer.o_norm(core.view(shape), gate).reshape(core.shape))


KIMI_LINEAR_KDA = MixerSpec(
    family="KDA (Kimi Linear)",
    heads=_kda_heads,
    entries={
        "q_proj": _kda_channels,
        "k_proj": _kda_channels,
        "v_proj": _kda_channels,
        "b_proj": _kda_head_channels,
        "forget_gate.f_a_proj": _kda_forget_input,
        "g_a_proj": _kda_gate_placeholder,
    },
    attributes=_kda_attributes,
    parameters=_kda_parameters,
    exit="o_norm",
    outputs=_kda_channels,
    tail=_kda_tail,
    width=lambda layer: layer.qkv_dim,
    call=_kda_call,
)


SPECS: dict[str, MixerSpec] = {"KimiLinearDeltaAttention": KIMI_LINEAR_KDA}
