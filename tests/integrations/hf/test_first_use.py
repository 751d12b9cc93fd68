"""What a first use meets: ``attn_implementation="mesh_cp"`` registered by importing the adapter, and the messages of
a model without a mesh, of a layout asked for before the process group exists, and of wrong ``position_ids`` (where
they differ from this rank's positions)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from mesh_cp.testing import spawn_gloo  # noqa: E402

SEQ = 256  # 128 positions per rank at P = 2: a long row


def test_import_registers_the_attention_implementation(tmp_path) -> None:
    """A fresh process that only imports the adapter builds models with ``attn_implementation="mesh_cp"``
    (``from_config`` and ``from_pretrained``); their forward without a mesh names the fix."""
    script = textwrap.dedent(
        f"""
        import torch
        import mesh_cp.integrations.hf
        from transformers import AutoModelForCausalLM
        from mesh_cp.testing.models import tiny_config

        model = AutoModelForCausalLM.from_config(tiny_config("LlamaConfig"), attn_implementation="mesh_cp")
        model.save_pretrained({str(tmp_path)!r})
        loaded = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, attn_implementation="mesh_cp")
        print("implementations", model.config._attn_implementation, loaded.config._attn_implementation)
        try:
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        except ValueError as err:
            print("forward:", err)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "implementations mesh_cp mesh_cp" in proc.stdout, proc.stdout
    assert "has no CP mesh; call mesh_cp.integrations.hf.attach(model, mesh)" in proc.stdout, proc.stdout


def test_layout_before_the_process_group_names_init_process_group() -> None:
    from mesh_cp.runtime.mesh import CPMesh
    from mesh_cp.runtime.parallel import DataContextParallel

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    assert dist.group.WORLD is None  # what a user passes before init_process_group
    for create in (
        lambda: DataContextParallel.create(dist.group.WORLD, cp_size=2, tile=(1, 2)),
        lambda: CPMesh.create(dist.group.WORLD, tile=(1, 2)),
    ):
        with pytest.raises(ValueError, match=r"no default process group: call torch\.distributed\.init_process_group"):
            create()


def positions_worker(rank: int, world: int) -> dict[str, str]:
    """Position ids off by one in the middle of every rank's row (each rank refuses before any collective): checked
    on the host (first tensor of its shape) and on the device path (a later tensor of the same shape, which on the
    CPU raises at once)."""
    from transformers import AutoModelForCausalLM

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.testing.models import tiny_config

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    torch.manual_seed(0)
    model = hf.attach(AutoModelForCausalLM.from_config(tiny_config("LlamaConfig")), mesh)
    batch = hf.shard_batch(torch.randint(3, 90, (1, SEQ)), mesh=mesh)
    wrong = batch.position_ids.clone()
    wrong[0, 70] += 1
    messages = {}
    for name in ("host", "device"):
        try:
            with torch.no_grad():
                model(input_ids=batch.input_ids, position_ids=wrong)
        except ValueError as err:
            messages[name] = str(err)
        with torch.no_grad():
            model(input_ids=batch.input_ids, position_ids=batch.position_ids)  # then the device path
        wrong = wrong.clone()
    return messages


def test_position_mismatch_shows_where_they_differ() -> None:
    messages = spawn_gloo(positions_worker, 2, deadline=180)[0]
    # Rank 0 holds zig-zag chunks [0, 64) and [192, 256): local index 70 is position 198, given as 199.
    where = (
        "position_ids are not this rank's positions of a sequence of 256 tokens in the zigzag layout (global "
        "positions, or positions inside each document of the mesh_cp_mask): row 0 first differs at index 70 of 128, "
        "at indices 67..73 got [..., 195, 196, 197, 199, 199, 200, 201, ...], expected [..., 195, 196, 197, 198, 199, "
        "200, 201, ...]; a shard numbered from 0 would be silently wrong"
    )
    fix = "(what hf.mesh_cp_trainer_class(...) uses, TRL's packing included)"
    assert sorted(messages) == ["device", "host"], messages
    for message in messages.values():
        assert message.startswith(where) and message.endswith(fix) and "hf.ShardCollated" in message, message
