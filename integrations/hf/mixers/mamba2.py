"""Mamba 2 mixer layers: Bamba's ``BambaMixer``, Nemotron-H's ``NemotronHMamba2Mixer``, Granite 4's
``GraniteMoeHybridMambaLayer``, Zamba2's ``Zamba2MambaMixer`` (attributes named as Bamba's) and Falcon-H1's
``FalconH1Mixer`` (its multipliers, its gated norm optional): the SSD scan per head, B and C per group of heads, so a
rank's heads read one group (a group spanning ranks: its B and C go to each of them) or a contiguous share of the
groups (Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, grouped_reason, groups_of, index, share, span

# in_proj -> [gate (d_inner) | x (d_inner) | B (G N) | C (G N) | dt (H)]; conv over [x | B | C]; the SSD scan per
# head, B and C per group; exit: norm(scan, gate) (a norm over all channels or per group: either way it runs on the
# rank's tokens over every channel); then out_proj.


def _m2_heads(layer, world: int) -> str | None:
    return grouped_reason("groups (n_groups)", layer.n_groups, "heads", layer.num_heads, world)


def _m2_groups(layer, world: int, rank: int) -> range:
    """The groups of B and C rank ``rank``'s heads read, in order."""
    return groups_of(layer.n_groups, layer.num_heads, world, rank)


def _m2_head_channels(layer, world: int, rank: int) -> list[int]:
    """The ``d_inner`` channels of rank ``rank``'s heads (of x, of the gate, of the scan's output)."""
    hd = layer.head_dim
    return [c for h in share(layer.num_heads, world, rank) for c in span(h * hd, hd)]


def _m2_conv_channels(layer, world: int, rank: int) -> list[int]:
    """The convolution's channels rank ``rank``'s core reads: its heads' x, its groups' B, then C."""
    d, n = layer.intermediate_size, layer.ssm_state_size
    groups = _m2_groups(layer, world, rank)
    b = [d + c for g in groups for c in span(g * n, n)]
    c_ = [d + layer.n_groups * n + c for g in groups for c in span(g * n, n)]
    return _m2_head_channels(layer, world, rank) + b + c_


def _m2_in_proj(layer, world: int, rank: int) -> list[int]:
    """in_proj's channels the core reads: the gate as placeholders (the norm's, in the tail), x B C, dt."""
    d = layer.intermediate_size
    gate = [-1] * (d // world)
    conv = [d + c for c in _m2_conv_channels(layer, world, rank)]
    dt = [d + layer.conv_dim + h for h in share(layer.num_heads, world, rank)]
    return gate + conv + dt


def _m2_attributes(layer, world: int) -> dict[str, Any]:
    groups = len(_m2_groups(layer, world, 0))
    inner = layer.intermediate_size // world
    return {
        "num_heads": layer.num_heads // world,
        "intermediate_size": inner,
        "n_groups": groups,
        "conv_dim": inner + 2 * groups * layer.ssm_state_size,
    }


def _m2_parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    heads = index(share(layer.num_heads, world, rank), layer.A_log)
    conv = index(_m2_conv_channels(layer, world, rank), layer.A_log)
    params = {
        "conv1d.weight": layer.conv1d.weight.index_select(0, conv),
        "A_log": layer.A_log.index_select(0, heads),
        "dt_bias": layer.dt_bias.index_select(0, heads),
        "D": layer.D.index_select(0, heads),
    }
    if layer.conv1d.bias is not None:
        params["conv1d.bias"] = layer.conv1d.bias.index_select(0, conv)
    return params


def _m2_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    gate = projections["in_proj"][..., : layer.intermediate_size]
    return layer.out_proj(layer.norm(core, gate))


BAMBA_MAMBA2 = MixerSpec(
    family="Mamba 2 (Bamba)",
    heads=_m2_heads,
    entries={"in_proj": _m2_in_proj},
    attributes=_m2_attributes,
    parameters=_m2_parameters,
    exit="norm",
    outputs=_m2_head_channels,
    tail=_m2_tail,
    width=lambda layer: layer.intermediate_size,
)


def _same_as_bamba(family: str) -> MixerSpec:
    """Bamba's spec under ``family``'s name: Nemotron-H, Granite 4 and Zamba2 name their layer's attributes, split
    in_proj and call their gated norm (per group of channels) as Bamba does."""
    return dataclasses.replace(BAMBA_MAMBA2, family=f"Mamba 2 ({family})")


# Falcon-H1: the hidden states are scaled by ssm_in_multiplier before in_proj, whose output is scaled by the
# mup_vector buffer inside forward (sliced to the core's channels); without mamba_rms_norm (norm is an Identity) the
# core multiplies the scan by silu(gate) itself, so it reads its heads' gate and ends at out_proj.


def _falcon_in_proj(layer, world: int, rank: int) -> list[int]:
    """in_proj's channels the core reads: Bamba's, the gate real (its heads') where the core applies it."""
    channels = _m2_in_proj(layer, world, rank)
    if layer.mamba_rms_norm:
        return channels
    gate = _m2_head_channels(layer, world, rank)
    return gate + channels[len(gate) :]


def _falcon_parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    """Bamba's slices and the mup_vector's factors of the channels the core reads (a placeholder's: any, it
    multiplies zeros)."""
    channels = [max(c, 0) for c in _falcon_in_proj(layer, world, rank)]
    return {
        **_m2_parameters(layer, world, rank),
        "mup_vector": layer.mup_vector.index_select(-1, index(channels, layer.A_log)),
    }


def _falcon_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    if not layer.mamba_rms_norm:
        return layer.out_proj(core)
    d = layer.intermediate_size
    gate = projections["in_proj"][..., :d] * layer.mup_vector[..., :d]
    return layer.out_proj(layer.norm(core, gate))


FALCON_H1_MAMBA2 = MixerSpec(
    family="Mamba 2 (Falcon-H1)",
    heads=_m2_heads,
    entries={"in_proj": _falcon_in_proj},
    attributes=_m2_attributes,
    parameters=_falcon_parameters,
    exit=lambda layer: "norm" if layer.mamba_rms_norm else "out_proj",
    outputs=_m2_head_channels,
    tail=_falcon_tail,
    width=lambda layer: layer.intermediate_size,
    project=lambda layer, name, x: layer.in_proj(x * layer.ssm_in_multiplier),
)

SPECS: dict[str, MixerSpec] = {
    "BambaMixer": BAMBA_MAMBA2,
    "NemotronHMamba2Mixer": _same_as_bamba("Nemotron-H"),
    "GraniteMoeHybridMambaLayer": _same_as_bamba("Granite 4"),
    "Zamba2MambaMixer": _same_as_bamba("Zamba2"),
    "FalconH1Mixer": FALCON_H1_MAMBA2,
}
"""Mamba 2 layer class name -> its spec."""
