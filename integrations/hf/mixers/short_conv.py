"""Placeholder: filled in by the family work."""

from __future__ import annotations

from mesh_cp.integrations.hf.hybrid import MixerSpec

SPECS: dict[str, MixerSpec] = {}
