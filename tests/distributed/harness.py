"""Multi-rank tests spawn their own gloo group with :func:`mesh_cp.runtime.launch.spawn_gloo`.

Each test module spawns a group once per world size and runs many cases inside it (a spawn costs
seconds on two cores; a case costs milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mesh_cp.runtime.launch import spawn_gloo


def run_distributed(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks, one thread each; per-rank results."""
    return spawn_gloo(fn, world, *args, threads_per_rank=1)
