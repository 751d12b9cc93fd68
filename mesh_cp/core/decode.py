"""Tree-Attention decoding as data: the all-gathers that combine the ranks' partial results, and their bytes.

Note [Tree decoding]
~~~~~~~~~~~~~~~~~~~~
Decoding ``k`` new tokens with a K/V cache sharded along the sequence over ``P`` ranks: the queries are replicated,
rank ``g`` attends them to the keys of its shard that each may see and gets ``o_g`` (fp32) and ``lse_g`` per query
row and head (``o_g = 0``, ``lse_g = -inf`` where it holds none). The exact result is::

    m = max_g lse_g,   w_g = exp(lse_g - m),   o = sum_g w_g o_g / sum_g w_g,   lse = m + log(sum_g w_g)

(Note [LSE merge] for many pieces at once; a row with ``lse_g = -inf`` on every rank gets ``o = 0``, ``lse =
-inf``). One collective per level: each rank packs ``[o_g, lse_g]`` into one ``(B, k, Hq, D + 1)`` fp32 tensor,
the level's all-gather hands every member all ``n`` pieces, and each merges them itself; the merged result is its
piece at the next level. The levels are the mesh's Q-group, then its KV-group (a hybrid mesh's head group first).
They partition the CP group (Q-group of rank ``g``: ``g // a * a + i``; KV-group: ``g % a + j * a``, Note [Mesh
tiling]), so merging over the Q-group and then over the KV-group merges every rank's piece, and every rank ends
with the result. With a node-local tile (``a`` = ranks per node) the first level stays inside a node and the
second crosses nodes once per rank: the topology-aware reduction. ``1 x P`` (or a plain process group) is one
all-gather per layer and call.

Bytes a rank sends per call (the all-gather of ``n`` members moves ``(n - 1)`` pieces, as :mod:`mesh_cp.debug`
counts it): per level ``(n - 1) * B * k * Hq * (D + 1)`` fp32. Against the MAX and SUM all-reduces the same merge
could use, the all-gather pays one collective's latency instead of two and sends ``n / 2`` times the sum's
bytes: decode payloads are a few KiB, where latency and launches, not bytes, set the time. Nothing depends on the
context length; passing the cache around a ring moves ``(P - 1)`` shards per call.
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
    def piece_bytes(self) -> int:
        """One rank's piece of a level's all-gather: its ``[out, lse]`` of every query row and head, ``(B, k, Hq,
        D + 1)`` fp32."""
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
    """The levels of tree decoding over a CP group: their sizes, in the order they run (one all-gather each)."""

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
        """``(op, members, bytes of one member's piece)`` of every collective of one call, in the order they run:
        one ``"all_gather"`` per level."""
        return tuple(("all_gather", n, shape.piece_bytes) for n in self.levels)

    def bytes_by_level(self, shape: DecodeShape) -> tuple[int, ...]:
        """Bytes one rank sends per call at each level: ``n - 1`` pieces."""
        return tuple((n - 1) * shape.piece_bytes for n in self.levels)

    def bytes_sent(self, shape: DecodeShape) -> int:
        """Bytes one rank sends per call, all levels."""
        return sum(self.bytes_by_level(shape))
