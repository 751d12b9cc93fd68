"""One spawned gloo group serving the cases of several group sizes P: each P runs on the group of the first P ranks
(the spawned world itself for the largest), while the other ranks wait; the ranks start once instead of once per P.

In the worker: ``return by_group_size(SIZES, fn, rank, world)`` with ``fn(group, rank, P)`` (``rank`` is the rank in
``group``, the same as the global one), spawned on ``max(SIZES)`` ranks; in the test, ``size_results(per_rank, P)``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any

from mesh_cp.testing import section_results


def by_group_size(sizes: Iterable[int], fn: Callable[[Any, int, int], Any], rank: int, world: int) -> dict[int, Any]:
    """``{P: fn(group, rank, P)}`` for every size ``P`` of ``sizes`` that this rank takes part in (``rank < P``); a
    ``fn`` that raises gives ``{"section raised": <the traceback>}`` for that ``P`` (:func:`size_results` fails it).

    The sizes run largest first, every rank making the group of each size before it runs and all ranks meeting after
    it. torch names the groups a rank makes after how many it holds, so the ranks of a group must hold as many when
    they make it (see :func:`mesh_cp.runtime.groups.new_subgroups`): largest first, the ranks of each ``P`` took part
    in every ``P`` before it, holding the same groups."""
    import torch.distributed as dist

    results: dict[int, Any] = {}
    for size in sorted(sizes, reverse=True):
        group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
        if rank < size:
            try:
                results[size] = fn(group, rank, size)
            except Exception as err:  # noqa: BLE001 - reported by the tests of that size
                results[size] = {"section raised": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"}
        dist.barrier()
    return results


def size_results(per_rank: list[dict[int, Any]], size: int) -> list[Any]:
    """What ``fn`` returned for group size ``size`` on each of its ``size`` ranks, in rank order; fails with the
    traceback if it raised."""
    return section_results(per_rank[:size], size)
