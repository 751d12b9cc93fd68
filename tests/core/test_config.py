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
        ({"enabled": True, "cp_size": "4"}, r'"cp_size" must be a positive int, got \'4\''),
        ({"enabled": "yes"}, r'"enabled" must be a bool'),
        (
            {"cp_size": 4, "schedule": "ring"},
            r"schedule 'ring' is not supported; choose one of \['collective', 'overlap'\]",
        ),
        ({"enabled": True, "cp_size": 4, "tile": "auto"}, r"needs \['topology', 'seq_len'\]"),
        ({"enabled": True, "cp_size": 4, "topology": "tpu"}, r"tpu"),
        ([1, 2], r'"mesh_attention" must be a JSON object'),
    ]
    for block, message in cases:
        with pytest.raises(ValueError, match=message):
            MeshConfig.from_dict(block)
    with pytest.raises(ValueError, match=r"\"mesh_attention\": tile '2by2' is not of the form 'AxB'"):
        MeshConfig(enabled=True, cp_size=4, tile="2by2")
    # A block that is off is only type-checked.
    assert MeshConfig.from_dict({"enabled": False, "tile": "3x1"}).enabled is False


def test_head_parallel_key_tiles_the_rest_and_is_refused_with_the_value_and_the_fix() -> None:
    """ "head_parallel": u (the head-parallel x mesh hybrid): the tile tiles cp_size / u ranks (default the most
    square of them), sequences are multiples of 2 cp_size whatever u; left out, it is 1 with a tile and the cost
    model's choice with "tile": "auto" (auto_mesh's head_parallel=None); bad values name themselves and the fix,
    and the former key "heads" is refused naming "head_parallel"."""
    plain = MeshConfig.from_dict({"enabled": True, "cp_size": 4})
    assert (plain.head_parallel, plain.mesh_ranks, plain.tile_for(4), plain.seq_multiple) == (None, 4, (2, 2), 8)
    cfg = MeshConfig.from_dict({"enabled": True, "cp_size": 8, "head_parallel": 2, "tile": "2x2", "seq_len": 64})
    assert (cfg.head_parallel, cfg.mesh_ranks, cfg.tile_for(8), cfg.seq_multiple) == (2, 4, "2x2", 16)
    assert MeshConfig(enabled=True, cp_size=8, head_parallel=2).tile_for(16) == (2, 2)
    assert MeshConfig(enabled=True, cp_size=8, head_parallel=8).tile_for(8) == (1, 1)  # Ulysses
    assert MeshConfig(enabled=True, cp_size=8, head_parallel=4).seq_multiple == 16
    # "auto" with head_parallel: the tile for that u; a topology orders a hybrid's transfers too.
    auto = {"enabled": True, "cp_size": 8, "head_parallel": 2, "tile": "auto", "topology": "h100", "seq_len": 64}
    assert MeshConfig.from_dict(auto).tile_for(8) == "auto"
    topology = {"enabled": True, "cp_size": 8, "head_parallel": 2, "topology": "h100"}
    assert MeshConfig.from_dict(topology).head_parallel == 2
    assert MeshConfig.from_dict({"enabled": True, "cp_size": 4, "head_parallel": None}).head_parallel is None
    cases = [
        ({"enabled": True, "cp_size": 4, "head_parallel": 0}, r'"head_parallel" must be a positive int, got 0'),
        ({"cp_size": 4, "head_parallel": "2"}, r'"head_parallel" must be a positive int, got \'2\''),
        ({"cp_size": 4, "head_parallel": True}, r'"head_parallel" must be a positive int, got True'),
        # The former spelling of the key, refused by name with the new one and its value.
        (
            {"enabled": True, "cp_size": 8, "heads": 2, "tile": "2x2"},
            r"\"mesh_attention\": 'heads' was renamed 'head_parallel'.*pass head_parallel=2",
        ),
    ]
    for block, message in cases:
        with pytest.raises(ValueError, match=message):
            MeshConfig.from_dict(block)


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
    """The collective schedule's forward gathers, and sends the row partials of ``partials="input"`` (a list of
    tensors), through flat copies on gloo; NCCL moves them in place. NCCL also means the GPU kernels' share (their
    backward's fp32 temporaries), so the overlapped backward is larger there."""
    shape = AttentionShape(batch=1, seq_local=64, heads=4, kv_heads=4, head_dim=16, itemsize=4)
    plan = make_plan(Tiling(world=4, a=2, b=2), shape, causal=True, layout="zigzag", schedule="collective")
    for kernel in ("cpu_flash", "cuda_flash"):  # the same kernel's share on both
        assert peak_bytes(plan, "forward", backend="nccl", kernel=kernel) <= peak_bytes(
            plan, "forward", backend="gloo", kernel=kernel
        )
    rows = make_plan(plan.tiling, shape, causal=True, layout="zigzag", schedule="collective", partials="input")
    assert peak_bytes(rows, "forward", backend="nccl", kernel="cpu_flash") < peak_bytes(
        rows, "forward", kernel="cpu_flash"
    )
    overlap = make_plan(Tiling(world=4, a=2, b=2), shape, causal=True, layout="zigzag")
    assert peak_bytes(overlap, "backward", backend="nccl") > peak_bytes(overlap, "backward")
    with pytest.raises(ValueError, match=r"backend 'mpi' is not modelled; choose one of \['gloo', 'nccl'\]"):
        peak_bytes(plan, "forward", backend="mpi")


RULES = (
    "The block needs all of: cp_size divides the {w} ranks, head_parallel divides cp_size, a tile a x b with "
    "a * b * head_parallel == cp_size{seq}; on {w} ranks use "
)


@pytest.mark.parametrize(
    ("block", "world", "broken", "advice"),
    [
        (  # cp_size 3 on 4 ranks with tile 2x2: fixing either alone would meet the other
            {"cp_size": 3, "tile": "2x2"},
            4,
            '"cp_size" 3 does not divide the 4 ranks (divisors: 1, 2, 4); "tile" 2x2 with head_parallel 1 spans 4 '
            "ranks, not cp_size 3",
            "cp_size 4 with tile 2x2, or cp_size 2 with tile 2x1",
        ),
        (
            {"cp_size": 4, "tile": "3x1"},
            4,
            '"tile" 3x1 with head_parallel 1 spans 3 ranks, not cp_size 4',
            "cp_size 4 with tile 2x2, or cp_size 2 with tile 2x1",
        ),
        (
            {"cp_size": 4, "head_parallel": 3},
            4,
            '"head_parallel" 3 does not divide cp_size 4 (divisors: 1, 2, 4)',
            "cp_size 4, head_parallel 2 with tile 2x1, or cp_size 2, head_parallel 2 with tile 1x1",
        ),
        (
            {"cp_size": 8, "head_parallel": 2, "tile": "2x4"},
            8,
            '"tile" 2x4 with head_parallel 2 spans 16 ranks, not cp_size 8',
            "cp_size 8, head_parallel 2 with tile 2x2, or cp_size 4, head_parallel 2 with tile 2x1",
        ),
        (
            {"cp_size": 4, "seq_len": 100},
            4,
            '"seq_len" 100 is not a multiple of 2 * cp_size = 8',
            "cp_size 4 with tile 2x2 and seq_len 104, or cp_size 2 with tile 2x1",
        ),
        (
            {"cp_size": 8, "tile": "auto", "topology": "h100", "seq_len": 64},
            4,
            '"cp_size" 8 does not divide the 4 ranks (divisors: 1, 2, 4)',
            "cp_size 4, or cp_size 2",
        ),
    ],
)
def test_one_message_names_every_broken_constraint_and_valid_blocks(block, world, broken, advice) -> None:
    """The layout's constraints are checked together against the world (no process group: ``tile_for(world)``), so
    the message names each broken one with its values and blocks that satisfy all of them on that world."""
    cfg = MeshConfig.from_dict({"enabled": True, **block})
    seq = ", seq_len a multiple of 2 * cp_size" if "seq_len" in block else ""
    message = f'"mesh_attention" on {world} ranks: {broken}. {RULES.format(w=world, seq=seq)}{advice}'
    with pytest.raises(ValueError) as err:
        cfg.tile_for(world)
    assert str(err.value) == message
    for suggestion in advice.split(", or "):  # each suggested block passes on that world
        words = suggestion.replace(",", "").replace(" with ", " ").replace(" and ", " ").split()
        fixed = {**block, **{k: v if k == "tile" else int(v) for k, v in zip(words[::2], words[1::2], strict=True)}}
        MeshConfig.from_dict({"enabled": True, **fixed}).check_world(world)  # raises if the advice were wrong
