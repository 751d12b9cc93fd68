"""Under ``accelerate launch`` with a config file whose ``parallelism_config`` block asks for DP 2 x CP 2 on 4
processes (test_parallelism_config.py): the Accelerator gets :func:`hf.accelerator_parallelism_config` and builds no
device mesh, and :func:`hf.parallel_from_accelerate` builds mesh_cp's layout from the block. Also from
``ParallelismConfig`` objects: ``dp_shard_size`` counted as DP replicas, and sizes that do not cover the world
refused. Each rank writes its result as JSON to ``OUT_DIR/rank<R>.json`` (printed lines of several processes
interleave)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator, ParallelismConfig

from mesh_cp.integrations import hf
from mesh_cp.testing import gloo_exit_workaround


def sizes(**given: int) -> ParallelismConfig:
    return ParallelismConfig(**{"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "sp_size": 1, **given})


def main() -> None:
    gloo_exit_workaround()
    accelerator = Accelerator(parallelism_config=hf.accelerator_parallelism_config())
    parallel = hf.parallel_from_accelerate(tile=(1, 2))
    sharded = hf.parallel_from_accelerate(sizes(dp_shard_size=2, cp_size=2))
    try:
        hf.parallel_from_accelerate(sizes(cp_size=2))
        refused = None
    except ValueError as err:
        refused = str(err)
    result = {
        "rank": dist.get_rank(),
        "layout": str(parallel),
        "cp_size": parallel.mesh.size,
        "dp_size": parallel.dp_size,
        "dp_rank": parallel.dp_rank,
        "dp_group": dist.get_process_group_ranks(parallel.dp_group),
        "sharded": [sharded.mesh.size, sharded.dp_size],
        "refused": refused,
        "accelerate_mesh": accelerator.torch_device_mesh is not None,
        "accelerate_cp": accelerator.parallelism_config.cp_size,
    }
    Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
