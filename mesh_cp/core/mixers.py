"""Bytes of the head-parallel exchange around a mixer layer's core (Note [Head-parallel mixers] in
:mod:`mesh_cp.runtime.mixers`): the formula the runtime, the cost model's CLI and the docs share."""

from __future__ import annotations

from mesh_cp.core.options import positive_int


def mixer_exchange_bytes(
    *, seq_local: int, channels_in: int, channels_out: int, world: int, itemsize: int, batch: int = 1
) -> int:
    """Bytes one rank sends (and as many it receives) in a mixer layer's forward: ``P - 1`` pieces of its
    ``seq_local`` tokens' core inputs (``channels_in``: the channels one rank's core reads, in total over the
    input projections), then of its core outputs (``channels_out``), for each of ``batch`` rows. The backward sends
    as many (the adjoint exchanges)."""
    for name, value in (("seq_local", seq_local), ("world", world), ("itemsize", itemsize), ("batch", batch)):
        positive_int(name, value)
    if channels_in < 0 or channels_out < 0:
        raise ValueError(f"channel counts must be >= 0, got channels_in={channels_in}, channels_out={channels_out}")
    return (world - 1) * seq_local * (channels_in + channels_out) * itemsize * batch
