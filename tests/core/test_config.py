"""The "mesh_attention" block (mesh_cp.config.MeshConfig) and the option names, checked without a process group."""

from __future__ import annotations

import pytest

from mesh_cp.config import MeshConfig
from mesh_cp.core import AttentionShape, Tiling, make_plan
from mesh_cp.core.options import BACKWARD_MODES, LAYOUTS, SCHEDULES, check_option
from mesh_cp.sim.memory import peak_bytes


def test_block_is_validated_once_with_the_value_and_the_fix() -> None:
    assert MeshConfig.from_dict(None) is None
    cfg = MeshConfig.from_dict({"enabled": True, "cp_size": 4, "tile": "2x2", "schedule": "collective"})
    assert (cfg.cp_size, cfg.tile, cfg.attention_options) == (
        4,
        "2x2",
        {"schedule": "collective", "backward": "regather"},
    )
    assert cfg.tile_for(8) == "2x2" and MeshConfig(enabled=True, cp_size=8).tile_for(16) == (4, 2)
    cases = [
        ({"enabled": True, "cp_size": 4, "tiles": "2x2"}, r'unknown key "tiles" \(the keys are: enabled, cp_size'),
        ({"enabled": True, "tile": "2x2"}, r'needs "cp_size"'),
        ({"enabled": True, "cp_size": "4"}, r'"cp_size" must be a positive integer, got \'4\''),
        ({"enabled": "yes"}, r'"enabled" must be a bool'),
        (
            {"cp_size": 4, "schedule": "ring"},
            r"schedule 'ring' is not supported; choose one of \['collective', 'overlap'\]",
        ),
        ({"enabled": True, "cp_size": 4, "tile": "3x1"}, r"tile 3x1 does not factor the CP group size 4"),
        ({"enabled": True, "cp_size": 4, "tile": "auto"}, r"needs \['topology', 'seq_len'\]"),
        ({"enabled": True, "cp_size": 4, "seq_len": 100}, r'"seq_len" 100 must be a multiple of 2 \* cp_size = 8'),
        ({"enabled": True, "cp_size": 4, "topology": "tpu"}, r"tpu"),
        ([1, 2], r'"mesh_attention" must be a JSON object'),
    ]
    for block, message in cases:
        with pytest.raises(ValueError, match=message):
            MeshConfig.from_dict(block)
    with pytest.raises(ValueError, match=r'"cp_size" 3 does not divide the 4 ranks; choose one of \[1, 2, 4\]'):
        MeshConfig(enabled=True, cp_size=3).tile_for(4)
    # A block that is off is only type-checked.
    assert MeshConfig.from_dict({"enabled": False, "tile": "3x1"}).enabled is False


def test_option_names_have_one_tuple_and_one_check() -> None:
    assert (LAYOUTS, SCHEDULES, BACKWARD_MODES) == (
        ("contiguous", "zigzag"),
        ("overlap", "collective"),
        ("regather", "reuse"),
    )
    for name, values in (("layout", LAYOUTS), ("schedule", SCHEDULES), ("backward", BACKWARD_MODES)):
        assert all(check_option(name, v) == v for v in values)
        with pytest.raises(
            ValueError, match=rf"{name} 'x' is not supported; choose one of {sorted(values)!r}".replace("[", r"\[")
        ):
            check_option(name, "x")
    shape = AttentionShape(batch=1, seq_local=8, heads=2, kv_heads=2, head_dim=4, itemsize=4)
    with pytest.raises(ValueError, match=r"backward 'keep' is not supported"):
        make_plan(Tiling(world=4, a=2, b=2), shape, causal=True, layout="zigzag", backward="keep")


def test_memory_model_stages_gathers_only_on_gloo() -> None:
    """The collective schedule's forward gathers through a flat copy on gloo; NCCL gathers in place."""
    shape = AttentionShape(batch=1, seq_local=64, heads=4, kv_heads=4, head_dim=16, itemsize=4)
    plan = make_plan(Tiling(world=4, a=2, b=2), shape, causal=True, layout="zigzag", schedule="collective")
    assert peak_bytes(plan, "forward", backend="nccl") <= peak_bytes(plan, "forward", backend="gloo")
    overlap = make_plan(Tiling(world=4, a=2, b=2), shape, causal=True, layout="zigzag")
    assert peak_bytes(overlap, "backward", backend="nccl") == peak_bytes(overlap, "backward")
    with pytest.raises(ValueError, match=r"backend 'mpi' is not modelled; choose one of \['gloo', 'nccl'\]"):
        peak_bytes(plan, "forward", backend="mpi")
