"""Run a function on N local processes joined in a gloo process group (demos, benchmarks, tests).

Production jobs are started by torchrun / accelerate / deepspeed; this is for single-machine runs
that start their own ranks, and :func:`gloo_exit_workaround` is for any process that joins a gloo group.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def gloo_exit_workaround() -> None:
    """Call before ``init_process_group("gloo", ...)`` in every process of a gloo run.

    Without ``torch._dynamo`` imported before the process group is made, gloo processes sometimes abort at
    exit ("terminate called without an active exception") after ``destroy_process_group``; importing it
    first orders torch's exit handlers so they do not. End every run with ``barrier()`` and
    ``destroy_process_group()`` as well.
    """
    importlib.import_module("torch._dynamo")


def _worker(
    rank: int,
    fn: Callable,
    world: int,
    tmp: str,
    threads: int,
    timeout: datetime.timedelta,
    final_barrier: bool,
    args: tuple,
) -> None:
    gloo_exit_workaround()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
    finally:
        if final_barrier:
            dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"result_{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # The result is saved: leave now. torch's exit handlers still abort a gloo process now and then after
    # destroy_process_group ("terminate called without an active exception"), which would fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(
    fn: Callable,
    world: int,
    *args: Any,
    threads_per_rank: int = 1,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    final_barrier: bool = True,
    deadline: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes in one gloo group.

    Returns every rank's (picklable) return value, indexed by rank. ``fn`` must be a module-level
    function (it is pickled by name). An exception in any rank stops all of them and is re-raised
    here with that rank's traceback. Each rank ends with ``barrier()`` (unless ``final_barrier`` is
    false: for runs whose ranks leave out of step, such as a rank stalled on purpose) and
    ``destroy_process_group()``. ``timeout`` bounds every collective (when many ranks share few cores,
    one rank can wait a whole iteration of the slowest one). ``deadline`` (seconds, ``None``: none)
    bounds the whole run: past it every rank is terminated and ``TimeoutError`` raised.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"deadline must be a positive number of seconds or None, got {deadline!r}")
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker,
            args=(fn, world, tmp, threads_per_rank, timeout, final_barrier, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        end = None if deadline is None else time.monotonic() + deadline
        while not context.join(timeout=None if end is None else max(end - time.monotonic(), 0.0)):
            if end is not None and time.monotonic() >= end:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                    process.join()
                raise TimeoutError(
                    f"spawn_gloo: the {world} ranks of {fn.__name__} ran past the deadline of {deadline} s"
                )
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def run_sections(sections: dict[str, Callable[[int, int], dict]], rank: int, world: int) -> dict[str, dict]:
    """Run every ``section(rank, world)`` of ``sections`` (one spawned group serving many tests), in order: each
    section's result under its name, or, when it raises, ``{"section raised": <the traceback>}``
    (:func:`section_results` fails the test that reads it)."""
    results: dict[str, dict] = {}
    for name, section in sections.items():
        try:
            results[name] = section(rank, world)
        except Exception as err:  # noqa: BLE001 - reported by the section's test
            results[name] = {"section raised": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"}
    return results


def section_results(per_rank: list[dict[str, dict]], name: str) -> list[dict]:
    """Section ``name``'s results on every rank (:func:`run_sections`); fails with the traceback if it raised."""
    results = [res[name] for res in per_rank]
    for rank, res in enumerate(results):
        assert "section raised" not in res, f"rank {rank}: {res['section raised']}"
    return results
