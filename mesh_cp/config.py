"""The switch-on block of mesh_cp in a framework's config (DeepSpeed's ``"mesh_attention"``), validated once.

::

    "mesh_attention": {"enabled": true, "cp_size": 4, "tile": "2x2", "schedule": "overlap"}
    "mesh_attention": {"enabled": true, "cp_size": 8, "head_parallel": 2, "tile": "2x2"}   # head-parallel x mesh
    "mesh_attention": {"enabled": true, "cp_size": 8, "tile": "auto", "topology": "h100", "seq_len": 131072}

Pure Python (no torch): read by the DeepSpeed adapter and by the Hugging Face ``Trainer`` given a
DeepSpeed config; :func:`mesh_cp.integrations.parallel_from_config` builds the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mesh_cp.core.head_parallel import head_parallel_unavailable
from mesh_cp.core.options import Backward, Schedule, check_option, positive_int, refuse_renamed
from mesh_cp.core.tiling import most_square_tile, parse_tile

BLOCK = "mesh_attention"
"""The name of the block in a DeepSpeed config."""


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The ``"mesh_attention"`` block: every key checked, an unknown key refused by name."""

    enabled: bool = False
    """Switch Mesh-Attention on (``False``: the block is ignored)."""
    cp_size: int | None = None
    """Ranks per context-parallel group (consecutive ranks); must divide the world size."""
    head_parallel: int | None = None
    """``u``, the head-parallel degree of the head-parallel x mesh hybrid (Note [Head-parallel x mesh] in
    :mod:`mesh_cp.runtime.heads`): groups of ``u`` consecutive CP ranks exchange heads by all-to-all and
    ``tile`` tiles the ``cp_size / u`` ranks that then hold the same heads; ``u`` must divide ``cp_size`` and
    the model's query heads. ``1``: plain Mesh-Attention. Left out (``None``): 1 with a tile, and with ``"tile":
    "auto"`` chosen by the cost model with the tile (given: the tile for that ``u``), as
    :func:`mesh_cp.auto_mesh`'s ``head_parallel=None``. The former key ``"heads"`` is refused, naming this one."""
    tile: str | None = None
    """``"AxB"`` with ``A * B = cp_size / head_parallel``, or ``"auto"`` (needs ``topology`` and ``seq_len``); default the
    most square tile."""
    schedule: Schedule = "overlap"
    """``"overlap"`` or ``"collective"`` (:func:`mesh_cp.mesh_attn_func`)."""
    backward: Backward = "regather"
    """``"regather"`` or ``"reuse"`` (:func:`mesh_cp.mesh_attn_func`)."""
    topology: str | None = None
    """A :class:`mesh_cp.sim.Topology` preset (``"h100"``, ``"a100"``): orders the overlapped schedule's
    transfers by link speed, and is what ``tile="auto"`` predicts for."""
    seq_len: int | None = None
    """Tokens per sequence (the whole sequence, before sharding); needed by ``tile="auto"``."""

    def __post_init__(self) -> None:
        _check_type("enabled", self.enabled, bool)
        for name in ("cp_size", "seq_len", "head_parallel"):
            if getattr(self, name) is not None:
                try:
                    positive_int(f'"{name}"', getattr(self, name))
                except ValueError as err:
                    raise ValueError(f'"{BLOCK}": {err}') from None
        for name in ("tile", "topology"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), str)
        for name in ("schedule", "backward"):
            try:
                check_option(name, getattr(self, name))
            except ValueError as err:
                raise ValueError(f'"{BLOCK}": {err}') from None
        if self.enabled:
            self._check_enabled()

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> MeshConfig | None:
        """Validate a loaded block (``None``: there is none)."""
        if block is None:
            return None
        if not isinstance(block, Mapping):
            raise ValueError(f'"{BLOCK}" must be a JSON object, got {block!r}')
        refuse_renamed(block, where=f'"{BLOCK}"')
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise ValueError(f'"{BLOCK}": unknown key "{unknown[0]}" (the keys are: {", ".join(known)})')
        return cls(**block)

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any]) -> MeshConfig | None:
        """The block of a loaded DeepSpeed config; ``None`` when there is none."""
        return cls.from_dict(config.get(BLOCK))

    def _check_enabled(self) -> None:
        """The checks of an enabled block that need no world size; how ``cp_size``, ``head_parallel``, ``tile`` and
        ``seq_len`` fit together and the world is :meth:`check_world`'s, all at once."""
        if self.cp_size is None:
            raise ValueError(f'"{BLOCK}": "enabled": true needs "cp_size" (ranks per context-parallel group)')
        if self.tile == "auto":
            missing = [k for k in ("topology", "seq_len") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f'"{BLOCK}": "tile": "auto" predicts the fastest tile and needs {missing} '
                    f'(for example "topology": "h100", "seq_len": 131072), or give a tile such as "2x2"'
                )
        elif self.tile is not None:
            try:
                parse_tile(self.tile)
            except ValueError as err:
                raise ValueError(f'"{BLOCK}": {err}') from None
        if self.topology is not None:
            from mesh_cp.sim.topology import Topology

            Topology.preset(self.topology)

    @property
    def mesh_ranks(self) -> int:
        """The ranks the tile tiles: ``cp_size / head_parallel`` (``cp_size`` when it is left out)."""
        return self.cp_size // (self.head_parallel or 1)

    @property
    def seq_multiple(self) -> int:
        """The multiple a sequence length must be (zig-zag layout): ``2 * cp_size``, whatever ``head_parallel``
        (:meth:`mesh_cp.CPMesh.seq_multiple`)."""
        return 2 * self.cp_size

    def tile_for(self, world: int) -> str | tuple[int, int]:
        """The tile to build on ``world`` ranks, after :meth:`check_world`."""
        self.check_world(world)
        return self.tile or most_square_tile(self.mesh_ranks)

    def check_world(self, world: int) -> None:
        """Check every constraint of the layout on ``world`` ranks at once: ``cp_size`` divides ``world``,
        ``head_parallel`` divides ``cp_size``, the tile ``a x b`` has ``a * b * head_parallel == cp_size`` and
        ``seq_len`` is a multiple of ``2 * cp_size``. ``ValueError`` names each one broken with its values, every
        rule, and blocks that satisfy them all on ``world`` ranks (so following the advice cannot meet another
        of these errors)."""
        broken = self._broken(world)
        if not broken:
            return
        rules = (
            f"cp_size divides the {world} ranks, head_parallel divides cp_size, a tile a x b with a * b * "
            f"head_parallel == cp_size" + (", seq_len a multiple of 2 * cp_size" if self.seq_len else "")
        )
        raise ValueError(
            f'"{BLOCK}" on {world} ranks: {"; ".join(broken)}. The block needs all of: {rules}; '
            f"on {world} ranks use {', or '.join(self._valid_blocks(world))}"
        )

    def _broken(self, world: int) -> list[str]:
        """Each constraint of :meth:`check_world` this block breaks on ``world`` ranks, with its values."""
        cp, u, tile = self.cp_size, self.head_parallel or 1, self._tile_pair()
        broken = []
        if world % cp:
            broken.append(f'"cp_size" {cp} does not divide the {world} ranks (divisors: {_divisors(world)})')
        if head_parallel_unavailable(cp, u) is not None:  # the one check of the degree, worded here
            broken.append(f'"head_parallel" {u} does not divide cp_size {cp} (divisors: {_divisors(cp)})')
        if tile is not None and tile[0] * tile[1] * u != cp:
            broken.append(
                f'"tile" {tile[0]}x{tile[1]} with head_parallel {u} spans {tile[0] * tile[1] * u} ranks, not '
                f"cp_size {cp}"
            )
        if self.seq_len is not None and self.seq_len % (2 * cp):
            broken.append(f'"seq_len" {self.seq_len} is not a multiple of 2 * cp_size = {2 * cp}')
        return broken

    def _valid_blocks(self, world: int) -> list[str]:
        """Two blocks that satisfy :meth:`check_world` on ``world`` ranks, nearest to this one first: its tile and
        ``head_parallel`` with the ``cp_size`` they span, then each ``cp_size`` dividing ``world`` from the nearest
        to its own, with the largest ``head_parallel`` up to its own that divides it and the most square tile;
        ``seq_len`` rounded up to a multiple of ``2 * cp_size`` where it is not one."""
        u, tile = self.head_parallel or 1, self._tile_pair()
        sizes = sorted((d for d in range(1, world + 1) if world % d == 0), key=lambda d: (abs(d - self.cp_size), -d))
        blocks = [(tile[0] * tile[1] * u, u, tile)] if tile is not None and tile[0] * tile[1] * u in sizes else []
        for cp in sizes:
            v = max(d for d in range(1, u + 1) if cp % d == 0)
            blocks.append((cp, v, most_square_tile(cp // v)))
        shown = []
        for cp, v, (a, b) in dict.fromkeys(blocks):
            text = f"cp_size {cp}" + (f", head_parallel {v}" if self.head_parallel is not None else "")
            text += "" if self.tile == "auto" else f" with tile {a}x{b}"
            if self.seq_len is not None and self.seq_len % (2 * cp):
                text += f" and seq_len {-(-self.seq_len // (2 * cp)) * 2 * cp}"
            shown.append(text)
        return shown[:2]

    def _tile_pair(self) -> tuple[int, int] | None:
        """``(a, b)`` of a concrete tile; ``None`` for the default or ``"auto"``."""
        return None if self.tile in (None, "auto") else parse_tile(self.tile)

    @property
    def attention_options(self) -> dict[str, str]:
        """The options of :func:`mesh_cp.mesh_attn_func` the block sets."""
        return {"schedule": self.schedule, "backward": self.backward}


def _check_type(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind):
        raise ValueError(f'"{BLOCK}": "{name}" must be a {kind.__name__}, got {value!r}')


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
