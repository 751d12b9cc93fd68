"""Tree-Attention decoding as data: the all-reduces that combine the ranks' partial results, and their bytes.

Note [Tree decoding]
~~~~~~~~~~~~~~~~~~~~
Decoding ``k`` new tokens with a K/V cache sharded along the sequence over ``P`` ranks: the queries are replicated,
rank ``g`` attends them to the keys of its shard that each may see and gets ``o_g`` (fp32) and ``lse_g`` per query
row and head (``o_g = 0``, ``lse_g = -inf`` where it holds none). The exact result is::

    m = max_g lse_g,   w_g = exp(lse_g - m),   o = sum_g w_g o_g / sum_g w_g,   lse = m + log(sum_g w_g)

two all-reduces per call: MAX of the lse, then SUM of ``[w_g o_g, w_g]`` packed into one fp32 tensor. Both are
done in levels: over the mesh's Q-group, then over its KV-group. The two partition the CP group (Q-group of rank
``g``: ``g // a * a + i``; KV-group: ``g % a + j * a``, Note [Mesh tiling]), so summing over the Q-group and then
over the KV-group sums over every rank, and every rank ends with the result (no broadcast). With a node-local tile
(``a`` = ranks per node) the first level stays inside a node and the second crosses nodes once per rank: the
topology-aware reduction. ``1 x P`` is one flat all-reduce over the CP group.

Bytes a rank sends per call (the all-reduce of ``n`` members moves ``2 (n - 1) / n`` of its payload, as
:mod:`mesh_cp.debug` counts it): per level, ``lse`` is ``B * Hq * k`` fp32 and the packed sum ``B * k * Hq * (D + 1)``
fp32. Nothing depends on the context length; passing the cache around a ring moves ``(P - 1)`` shards per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh_cp.core.options import positive_int

FP32 = 4


@dataclass(frozen=True)
class DecodeShape:
    """One decode attention call of one layer."""

    batch: int
    new_tokens: int
    """``k``: query tokens per row in this call (1 for plain decoding)."""
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    """Tokens in the whole cache (all ranks' shards), per row."""
    itemsize: int
    """Bytes per element of the cache (2 for bf16)."""

    def __post_init__(self) -> None:
        for name in ("batch", "new_tokens", "heads", "kv_heads", "head_dim", "itemsize"):
            positive_int(name, getattr(self, name))
        if not isinstance(self.context, int) or isinstance(self.context, bool) or self.context < 0:
            raise ValueError(f"context must be an int >= 0, got {self.context!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (GQA groups)")

    @property
    def lse_bytes(self) -> int:
        """The MAX all-reduce's payload: ``lse`` of every query row and head, fp32."""
        return self.batch * self.heads * self.new_tokens * FP32

    @property
    def sum_bytes(self) -> int:
        """The SUM all-reduce's payload: ``[w o, w]`` of every query row and head, fp32."""
        return self.batch * self.new_tokens * self.heads * (self.head_dim + 1) * FP32

    def shard_bytes(self, world: int) -> int:
        """K and V bytes of the largest of ``world`` balanced shards of the cache."""
        return (
            2
            * self.batch
            * -(-self.context // positive_int("world", world))
            * self.kv_heads
            * self.head_dim
            * self.itemsize
        )


@dataclass(frozen=True)
class DecodeReduction:
    """The all-reduce levels of tree decoding over a CP group: their sizes, in the order they run."""

    levels: tuple[int, ...]
    """Members of each level's groups (levels of one member are left out; ``()`` for one rank)."""

    def __post_init__(self) -> None:
        for n in self.levels:
            positive_int("level size", n)
            if n == 1:
                raise ValueError("a level of one member moves nothing; leave it out")

    @classmethod
    def for_tile(cls, a: int, b: int) -> DecodeReduction:
        """Over the Q-groups (``a`` members), then the KV-groups (``b``) of an ``a x b`` mesh."""
        return cls(tuple(n for n in (positive_int("a", a), positive_int("b", b)) if n > 1))

    @property
    def world(self) -> int:
        size = 1
        for n in self.levels:
            size *= n
        return size

    def collectives(self, shape: DecodeShape) -> tuple[tuple[str, int, int], ...]:
        """``(op, members, payload bytes)`` of every all-reduce of one call, in the order they run."""
        maxes = tuple(("max", n, shape.lse_bytes) for n in self.levels)
        sums = tuple(("sum", n, shape.sum_bytes) for n in self.levels)
        return maxes + sums

    def bytes_by_level(self, shape: DecodeShape) -> tuple[int, ...]:
        """Bytes one rank sends per call at each level (both all-reduces of that level)."""
        return tuple(sum(2 * (n - 1) * p // n for p in (shape.lse_bytes, shape.sum_bytes)) for n in self.levels)

    def bytes_sent(self, shape: DecodeShape) -> int:
        """Bytes one rank sends per call, all levels."""
        return sum(self.bytes_by_level(shape))
