"""The installed package: public names, and the adapters importable as mesh_cp.integrations.*."""

from __future__ import annotations

import importlib

import pytest

import mesh_cp


def test_fixed_public_names_exist() -> None:
    names = ("CPMesh", "mesh_attn_func", "shard_sequence", "unshard_sequence", "MeshAttnFunc", "CommCounter")
    names += ("auto_mesh", "DataContextParallel", "shard_batch", "ShardingCollator", "causal_lm_loss", "MeshConfig")
    for name in names:
        assert name in mesh_cp.__all__
        assert callable(getattr(mesh_cp, name))
    assert callable(mesh_cp.CPMesh.create) and callable(mesh_cp.CPMesh.from_device_mesh)
    with pytest.raises(AttributeError, match="no attribute 'ring_attn'"):
        mesh_cp.ring_attn  # noqa: B018


@pytest.mark.parametrize("framework", ["hf", "deepspeed", "megatron"])
def test_integrations_are_importable_as_subpackages(framework: str) -> None:
    module = importlib.import_module(f"mesh_cp.integrations.{framework}")
    assert module.__name__ == f"mesh_cp.integrations.{framework}"
    assert module.__file__ is not None and f"integrations/{framework}/__init__.py" in module.__file__.replace("\\", "/")
