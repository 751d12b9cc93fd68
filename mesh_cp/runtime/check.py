"""The cross-rank call check: every rank of a CP group calls mesh attention with the same shapes and options.

Checked once per signature new to this rank (one small all-gather and a host sync), on every call with
``debug``; the signatures already checked are remembered per check group here, at most :data:`REMEMBERED` of
them (the oldest forgotten first), so a run whose call shapes keep changing does not grow without bound.
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.runtime.comm import all_gather
from mesh_cp.runtime.groups import group_device

REMEMBERED = 1024
"""Signatures remembered per check group."""

_SEEN: dict[str, OrderedDict[tuple[int, ...], None]] = {}
"""Check group name -> signatures (as codes) already checked across it."""


def check_same_call(group: ProcessGroup, signature: Mapping[str, object], *, debug: bool = False) -> None:
    """Raise ``ValueError`` on every rank when the ranks of ``group`` call with different ``signature``.

    ``signature`` maps names to ints, bools, floats, strings, shapes (tuples of up to 4 ints) or ``None``: the same
    names, in the same order, on every rank. The error names, for each entry that differs, the value of every rank.
    Collective over ``group`` when it checks: once per signature new to this rank, on every call with ``debug``.
    A group of the ``"fake"`` backend moves no data and is not checked.

    Limit: a rank whose signature was already checked does not check again (without ``debug``). When one rank
    diverges to a signature it has seen before while the others call with one that is new to them, the others wait
    in the check and that rank in the attention: the mismatch is caught by the process groups' timeout, not by this
    message. ``debug=True`` removes the limit.
    """
    codes = tuple(code for value in signature.values() for code in _code(value))
    seen = _SEEN.setdefault(group.group_name, OrderedDict())
    if codes in seen and not debug:
        seen.move_to_end(codes)
        return
    if str(dist.get_backend(group)) != "fake":
        check_same(group, signature, what="called mesh_attn_func with different arguments", codes=codes)
    seen[codes] = None
    while len(seen) > REMEMBERED:
        seen.popitem(last=False)


_INT64 = range(-(2**63), 2**63)


def _code(value: object) -> tuple[int, ...]:
    """Six int64 codes of a signature value (the same count for every value, so every rank gathers the
    same size); equal values give equal codes on every process, different ones different codes (strings
    and other objects up to a CRC-32 collision)."""
    if value is None:
        return (0, 0, 0, 0, 0, 0)
    if isinstance(value, bool):
        return (1, int(value), 0, 0, 0, 0)
    if isinstance(value, int) and value in _INT64:
        return (2, value, 0, 0, 0, 0)
    if isinstance(value, float):
        return (3, struct.unpack("<q", struct.pack("<d", value))[0], 0, 0, 0, 0)
    if isinstance(value, tuple) and len(value) <= 4 and all(isinstance(d, int) and d in _INT64 for d in value):
        return (4, len(value), *value, *(0,) * (4 - len(value)))
    text = value if isinstance(value, str) else f"{type(value).__qualname__}:{value!r}"
    return (5, zlib.crc32(text.encode()), len(text), 0, 0, 0)  # crc32: stable across processes, unlike hash()


def check_same(
    group: ProcessGroup, signature: Mapping[str, object], *, what: str, codes: tuple[int, ...] | None = None
) -> None:
    """All-gather the codes of ``signature`` over ``group`` (``codes``: already computed); on a difference, gather
    the readable ``signature`` of every rank and raise ``ValueError`` on every rank naming, per differing entry,
    each rank's value (``what`` says what the ranks did: "asked for different meshes")."""
    if codes is None:
        codes = tuple(code for value in signature.values() for code in _code(value))
    mine = torch.tensor(codes, dtype=torch.int64, device=group_device(group))
    gathered = all_gather(mine, group).tolist()  # host sync: once per call signature
    if all(row == gathered[0] for row in gathered):
        return
    # Every rank saw the same gathered codes, so every rank is here: gather the values to name them.
    values: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, dict(signature), group=group)
    differing = [
        name for i, name in enumerate(signature) if len({tuple(row[6 * i : 6 * i + 6]) for row in gathered}) != 1
    ]
    listing = "; ".join(
        f"{name} (" + ", ".join(f"rank {r}: {row[name]!r}" for r, row in enumerate(values)) + ")" for name in differing
    )
    raise ValueError(f"ranks of the CP group {what}: {listing}; pass the same on every rank of the CP group")
