"""The head-parallel exchange of a hybrid model's mixer layers (Note [Head-parallel mixers] in
:mod:`mesh_cp.runtime.mixers`) beside the attention's traffic: what ``mesh-cp plan --mixer`` prints."""

from __future__ import annotations

from collections.abc import Iterable

from mesh_cp.core import AttentionShape
from mesh_cp.core.mixers import mixer_exchange_bytes


def parse_mixer(text: str) -> tuple[str, tuple[int, int]]:
    """``NAME=CIN,COUT``: a mixer layer kind and the channels one rank's core reads and writes (``ValueError``
    otherwise)."""
    name, _, channels = text.partition("=")
    parts = channels.split(",")
    if not name or len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"--mixer takes NAME=CIN,COUT (the channels one rank's core reads and writes, as "
            f"scripts/mixer_traffic.py prints them for a transformers config), got {text!r}"
        )
    return name, (int(parts[0]), int(parts[1]))


def mixer_traffic(
    mixers: Iterable[tuple[str, tuple[int, int]]], shape: AttentionShape, world: int
) -> list[tuple[str, int, int, int]]:
    """``(name, channels in, channels out, bytes)`` of each mixer: the bytes one rank sends in its exchanges,
    forward and backward, for the attention's ``shape`` (per-rank tokens, batch, dtype) at ``world`` ranks."""
    rows = []
    for name, (channels_in, channels_out) in mixers:
        one_way = mixer_exchange_bytes(
            seq_local=shape.seq_local,
            channels_in=channels_in,
            channels_out=channels_out,
            world=world,
            itemsize=shape.itemsize,
            batch=shape.batch,
        )
        rows.append((name, channels_in, channels_out, 2 * one_way))
    return rows
