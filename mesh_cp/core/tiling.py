"""The ``a x b`` tiling of a CP group: which rank computes which block of the attention block matrix.

Pure Python (no torch).

Note [Mesh tiling]
~~~~~~~~~~~~~~~~~~
The sequence is cut into ``P`` chunks; rank ``g`` starts with chunk ``g`` of Q, K and V. Block
``(x, y)`` is Q chunk ``x`` attending to KV chunk ``y``. The ``P x P`` block matrix is covered by
``P`` tiles of ``a x b`` blocks (``a * b = P``)::

    owner(x, y) = (x // a) * a + (y % a)
    Qgroup(g)   = {(g // a) * a + i : i < a}     rows rank g computes (a consecutive ranks)
    KVgroup(g)  = {(g % a) + j * a : j < b}      columns rank g computes

    P = 4, tile 2 x 2 (entries are owners)      P = 4, tile 1 x 4 (ring)
            y=0 y=1 y=2 y=3                           y=0 y=1 y=2 y=3
      x=0 [  0   1   0   1 ]                    x=0 [  0   0   0   0 ]
      x=1 [  0   1   0   1 ]                    x=1 [  1   1   1   1 ]
      x=2 [  2   3   2   3 ]                    x=2 [  2   2   2   2 ]
      x=3 [  2   3   2   3 ]                    x=3 [  3   3   3   3 ]

Rank ``g`` computes exactly ``Qgroup(g) x KVgroup(g)``: it gathers the ``a`` Q chunks of its
Q-group and the ``b`` KV chunks of its KV-group, and owns its own diagonal block ``(g, g)``.
``a = 1`` is Ring-Attention, ``a = P`` passes Q around instead of KV, ``a = b`` is the square tile
(ATTENTION2D). Partial outputs of a row are merged with their log-sum-exp and reduced to the rank
that owns the row's chunk; in backward ``dq`` is summed over the Q-group and ``dk, dv`` over the
KV-group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mesh_cp.core.options import positive_int


def factorizations(world: int) -> tuple[tuple[int, int], ...]:
    """Every tile ``(a, b)`` with ``a * b == world``, ``a`` ascending (``(1, world)`` is the ring)."""
    return tuple((a, world // a) for a in range(1, world + 1) if world % a == 0)


def most_square_tile(world: int) -> tuple[int, int]:
    """The tile of ``world`` with ``|a - b|`` smallest; on a tie the larger ``a`` (8 -> 4x2), which
    sends less for MHA since ``a`` weighs ``2(a-1)`` and ``b`` weighs ``2r(b-1)`` forward and
    ``3(a-1)`` against ``4r(b-1)`` backward."""
    return min(factorizations(world), key=lambda ab: (abs(ab[0] - ab[1]), -ab[0]))


def parse_tile(tile: str) -> tuple[int, int]:
    """``(a, b)`` of an ``"AxB"`` string, whatever the group it is for."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", tile)
    if match is None:
        raise ValueError(f"tile {tile!r} is not of the form 'AxB' (for example '2x2')")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Tiling:
    """The ``a x b`` tiling of a CP group of ``world = a * b`` ranks. See Note [Mesh tiling]."""

    world: int
    """Number of ranks ``P`` in the context-parallel group."""
    a: int
    """Q chunks per tile (size of a Q-group); ``a = 1`` is Ring-Attention."""
    b: int
    """KV chunks per tile (size of a KV-group)."""

    def __post_init__(self) -> None:
        for name in ("world", "a", "b"):
            positive_int(f"Tiling.{name}", getattr(self, name))
        if self.a * self.b != self.world:
            options = ", ".join(f"{a}x{b}" for a, b in factorizations(self.world))
            raise ValueError(
                f"tile {self.a}x{self.b} does not factor the CP group size {self.world} "
                f"({self.a}*{self.b}={self.a * self.b}); choose one of: {options}"
            )

    @classmethod
    def parse(cls, tile: object, world: int) -> Tiling:
        """Build from ``(a, b)`` or ``"axb"``; the error lists the valid tiles of ``world``."""
        if isinstance(tile, str):
            a, b = parse_tile(tile)
        elif isinstance(tile, (tuple, list)) and len(tile) == 2:
            a, b = tile
        else:
            options = ", ".join(f"({a}, {b})" for a, b in factorizations(world))
            raise ValueError(f"tile must be a pair (a, b) with a*b = {world}, got {tile!r}; choose one of: {options}")
        return cls(world=world, a=a, b=b)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.a, self.b)

    def owner(self, x: int, y: int) -> int:
        """Rank that computes block ``(x, y)``."""
        return (x // self.a) * self.a + (y % self.a)

    def q_group(self, rank: int) -> tuple[int, ...]:
        """The ``a`` ranks (= Q chunks) of ``rank``'s Q-group, in group-rank order."""
        start = (rank // self.a) * self.a
        return tuple(range(start, start + self.a))

    def kv_group(self, rank: int) -> tuple[int, ...]:
        """The ``b`` ranks (= KV chunks) of ``rank``'s KV-group, in group-rank order."""
        return tuple(rank % self.a + j * self.a for j in range(self.b))

    def q_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.q_group(i * self.a) for i in range(self.b))

    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.kv_group(i) for i in range(self.a))

    def blocks(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Blocks ``(x, y)`` computed by ``rank``: its Q-group rows times its KV-group columns."""
        return tuple((x, y) for x in self.q_group(rank) for y in self.kv_group(rank))

    def __str__(self) -> str:
        return f"{self.a}x{self.b}"
