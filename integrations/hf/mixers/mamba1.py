"""Mamba 1 layers (Jamba's ``JambaMambaMixer``): no heads, every channel of the inner width scanned on its own, but
``x_proj`` reads all of a token's channels (Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`).

Each rank takes ``intermediate / P`` channels: their convolution, their ``dt_proj`` rows, ``A`` and ``D`` rows and
their gated scan. Its core computes ``x_proj`` of its channels only (the weight's columns), and the ranks sum those
partial products (:func:`mesh_cp.runtime.mixers.sum_over_ranks`), so every rank gets the whole ``x_proj`` (dt, B, C)
of every token; the norms of dt, B and C then run on it on every rank (``dt_rank + 2 N`` channels a token)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, index, share, split_reason
from mesh_cp.runtime.mixers import sum_over_ranks


def _heads(layer, world: int) -> str | None:
    return split_reason("inner channels (intermediate_size)", layer.intermediate_size, world)


def _mine(layer, world: int, rank: int) -> list[int]:
    return list(share(layer.intermediate_size, world, rank))


def _in_proj(layer, world: int, rank: int) -> list[int]:
    mine = _mine(layer, world, rank)
    return mine + [layer.intermediate_size + c for c in mine]  # x, then the gate the scan multiplies in


def _attributes(layer, world: int) -> dict[str, Any]:
    return {"intermediate_size": layer.intermediate_size // world}


def _parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    mine = index(_mine(layer, world, rank), layer.D)
    params = {
        "conv1d.weight": layer.conv1d.weight.index_select(0, mine),
        "x_proj.weight": layer.x_proj.weight.index_select(1, mine),
        "dt_proj.weight": layer.dt_proj.weight.index_select(0, mine),
        "A_log": layer.A_log.index_select(0, mine),
        "D": layer.D.index_select(0, mine),
    }
    for name in ("conv1d", "dt_proj"):
        bias = getattr(layer, name).bias
        if bias is not None:
            params[f"{name}.bias"] = bias.index_select(0, mine)
    if layer.x_proj.bias is not None:  # added once to the sum of the ranks' partial products
        params["x_proj.bias"] = layer.x_proj.bias * (1.0 if rank == 0 else 0.0)
    return params


class _Summed(torch.nn.Module):
    """The core's ``x_proj``: its partial product summed over the ranks."""

    def __init__(self, inner: torch.nn.Module, mesh):
        super().__init__()
        self.inner, self.mesh = inner, mesh

    def forward(self, x: Tensor) -> Tensor:
        return sum_over_ranks(self.inner(x), mesh=self.mesh)


def _call(core, stand_in: Tensor) -> Any:
    if not isinstance(core._modules["x_proj"], _Summed):
        core._modules["x_proj"] = _Summed(core._modules["x_proj"], core.mesh_cp_mesh)
    return core.forward(stand_in)


def _tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    return layer.out_proj(core)


MAMBA1 = MixerSpec(
    family="Mamba 1 (Jamba)",
    heads=_heads,
    entries={"in_proj": _in_proj},
    attributes=_attributes,
    parameters=_parameters,
    exit="out_proj",
    outputs=_mine,
    tail=_tail,
    width=lambda layer: layer.intermediate_size,
    call=_call,
)

SPECS: dict[str, MixerSpec] = {"JambaMambaMixer": MAMBA1}
