"""The :class:`~mesh_cp.integrations.hf.hybrid.MixerSpec` of every mixer layer kind mesh_cp runs head-parallel
(Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`), one module per kind, each read from transformers'
code of its layers. :data:`SPECS` maps a layer class name to its spec."""

from __future__ import annotations

from mesh_cp.integrations.hf.mixer_spec import MixerSpec
from mesh_cp.integrations.hf.mixers import gated_deltanet, kda, lightning, mamba1, mamba2, short_conv

SPECS: dict[str, MixerSpec] = {
    **gated_deltanet.SPECS,
    **kda.SPECS,
    **lightning.SPECS,
    **mamba1.SPECS,
    **mamba2.SPECS,
    **short_conv.SPECS,
}
"""Mixer layer class name -> its spec."""
