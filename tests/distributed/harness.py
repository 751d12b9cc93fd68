"""Multi-rank tests spawn their own gloo group with :func:`mesh_cp.testing.spawn_gloo`.

Each test module spawns a group once per world size and runs many cases inside it (a spawn costs
seconds on two cores; a case costs milliseconds).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mesh_cp.testing import spawn_gloo


def run_distributed(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks, one thread each; per-rank results."""
    return spawn_gloo(fn, world, *args, threads_per_rank=1)


def expect_error(results: dict, name: str, exc: type[Exception], pattern: str, fn: Callable[[], Any]) -> None:
    """Record in ``results[name]`` whether ``fn()`` raised ``exc`` with a message matching ``pattern``
    (``True``), or what happened instead (a string)."""
    try:
        fn()
    except exc as err:
        results[name] = bool(re.search(pattern, str(err))) or f"wrong message: {err}"
        return
    except Exception as err:  # noqa: BLE001 - any other exception is a failure to report
        results[name] = f"raised {type(err).__name__}: {err}"
        return
    results[name] = "did not raise"
