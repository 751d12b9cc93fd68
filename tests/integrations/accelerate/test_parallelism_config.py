"""mesh_cp's DP x CP layout from accelerate's ``parallelism_config`` (:func:`hf.parallel_from_accelerate`): every
refusal without a process group, then an ``accelerate launch`` whose config file carries the block (DP 2 x CP 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch.distributed as dist  # noqa: E402
from accelerate import ParallelismConfig  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from mesh_cp.integrations import hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
BLOCK = {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2"}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch):
    """The environment ``accelerate launch`` gives a process for a parallelism_config block of DP 2 x CP 2."""
    for name in [n for n in os.environ if n.startswith("PARALLELISM_CONFIG_")] + ["ACCELERATE_USE_FSDP"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, value in BLOCK.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def sizes(**given: int) -> ParallelismConfig:
    return ParallelismConfig(**{"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "sp_size": 1, **given})


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "PARALLELISM_CONFIG_TP_SIZE",
            "2",
            "the config file's parallelism_config block: parallelism_config_tp_size 2 asks for tensor parallelism, "
            "which mesh_cp's DP x CP layout does not combine with; set parallelism_config_tp_size: 1",
        ),
        (
            "PARALLELISM_CONFIG_SP_SIZE",
            "4",
            "parallelism_config_sp_size 4 asks for DeepSpeed's sequence parallelism (Ulysses), which mesh_cp's DP x CP "
            "layout does not combine with; set parallelism_config_sp_size: 1",
        ),
        (
            "PARALLELISM_CONFIG_CP_SIZE",
            "1",
            "parallelism_config_cp_size 1 asks for no context parallelism; set it to the ranks of each CP group",
        ),
        (
            "PARALLELISM_CONFIG_CP_SIZE",
            "two",
            "PARALLELISM_CONFIG_CP_SIZE='two' (parallelism_config_cp_size) must be a positive integer",
        ),
        (
            "ACCELERATE_USE_FSDP",
            "true",
            "accelerate runs FSDP version 1 here (distributed_type: FSDP); mesh_cp shards with FSDP2 over every DP x CP "
            "rank: set fsdp_version: 2 in the config file's fsdp_config",
        ),
        (
            "ACCELERATE_USE_PARALLELISM_CONFIG",
            "false",
            "no parallelism_config block reached this process: accelerate launch hands the config file's "
            "parallelism_config block (parallelism_config_cp_size: N, parallelism_config_dp_replicate_size: M) to "
            "every process; add the block, or pass an accelerate.ParallelismConfig",
        ),
    ],
)
def test_refusals_name_the_key_and_the_fix(launched, variable: str, value: str, message: str) -> None:
    launched.setenv(variable, value)
    with pytest.raises(ValueError) as err:
        hf.parallel_from_accelerate(tile=(1, 2))
    assert message in str(err.value)


def test_fsdp2_beside_replicas_is_refused_as_hsdp(launched) -> None:
    """FSDP2 shards over every DP x CP rank: the block's dp_replicate_size (replicas beside the shards) is refused."""
    launched.setenv("ACCELERATE_USE_FSDP", "true")
    launched.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError) as err:
        hf.parallel_from_accelerate(tile=(1, 2))
    assert "parallelism_config_dp_replicate_size 2 with FSDP asks for HSDP" in str(err.value)
    assert "put the DP degree in parallelism_config_dp_shard_size" in str(err.value)


def test_an_accelerator_running_its_own_context_parallelism_is_refused(launched) -> None:
    launched.setitem(AcceleratorState._shared_state, "parallelism_config", sizes(dp_shard_size=2, cp_size=2))
    with pytest.raises(ValueError) as err:
        hf.parallel_from_accelerate()
    assert str(err.value) == (
        "the Accelerator runs accelerate's own context parallelism (cp_size 2), which would shard the sequence a "
        "second time; create it with Accelerator(parallelism_config=hf.accelerator_parallelism_config())"
    )


def test_objects_and_the_process_group(launched) -> None:
    with pytest.raises(ValueError, match=r"must be an accelerate.ParallelismConfig, got dict \(without integer"):
        hf.parallel_from_accelerate({"cp_size": 2})
    with pytest.raises(ValueError, match=r"^ParallelismConfig: tp_size 2 asks for tensor parallelism"):
        hf.parallel_from_accelerate(sizes(tp_size=2, dp_shard_size=2))
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    with pytest.raises(ValueError, match=r"^no default process group: create the Accelerator first"):
        hf.parallel_from_accelerate()


def test_the_accelerator_gets_every_size_one(launched) -> None:
    """Whatever the block says (the environment is read for sizes left out), accelerate gets no parallelism."""
    config = hf.accelerator_parallelism_config()
    assert [config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size, config.sp_size] == [1] * 5
    assert config.total_size == 1 and config.cp_handler is None


def test_accelerate_launch_with_a_parallelism_config_block(tmp_path: Path) -> None:
    """4 processes, DP 2 x CP 2 from the config file: rank r is CP rank r % 2 of replica r // 2."""
    block = "".join(f"  {name.lower()}: {value}\n" for name, value in BLOCK.items())
    config = tmp_path / "accelerate.yaml"
    config.write_text((ROOT / "configs" / "accelerate_mesh_cp.yaml").read_text() + "parallelism_config:\n" + block)
    accelerate = Path(sys.executable).with_name("accelerate")
    script = Path(__file__).with_name("parallelism_script.py")
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(config),
        "--main_process_port",
        "29631",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [r["rank"] for r in results] == [0, 1, 2, 3], proc.stdout[-3000:]
    for r in results:
        rank = r["rank"]
        assert (r["cp_size"], r["dp_size"], r["dp_rank"]) == (2, 2, rank // 2), r
        assert r["layout"].startswith("DP(2) x CP(1x2)") and r["dp_group"] == [rank % 2, rank % 2 + 2], r
        assert r["sharded"] == [2, 2], r  # dp_shard_size 2 counts as two replicas
        assert r["refused"] == (
            "ParallelismConfig: cp_size 2 x dp_replicate_size 1 x dp_shard_size 1 = 2 ranks, but the process group "
            "has 4; make dp_replicate_size x dp_shard_size 2"
        ), r
        assert r["accelerate_mesh"] is False and r["accelerate_cp"] == 1, r
