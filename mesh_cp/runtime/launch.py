"""Run a function on N local processes joined in a gloo process group (demos, benchmarks, tests).

Production jobs are started by torchrun / accelerate / deepspeed; this is for single-machine runs
that start their own ranks.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def _worker(
    rank: int, fn: Callable, world: int, tmp: str, threads: int, timeout: datetime.timedelta, args: tuple
) -> None:
    import torch._dynamo  # noqa: F401  (before init_process_group: gloo can abort at exit otherwise)
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"result_{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn_gloo(
    fn: Callable,
    world: int,
    *args: Any,
    threads_per_rank: int = 1,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes in one gloo group.

    Returns every rank's (picklable) return value, indexed by rank. ``fn`` must be a module-level
    function (it is pickled by name). An exception in any rank stops all of them and is re-raised
    here with that rank's traceback. Each rank ends with ``barrier()`` + ``destroy_process_group()``.
    ``timeout`` bounds every collective (when many ranks share few cores, one rank can wait a whole
    iteration of the slowest one).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(fn, world, tmp, threads_per_rank, timeout, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
