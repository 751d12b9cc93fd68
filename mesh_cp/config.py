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
from mesh_cp.core.tiling import Tiling, most_square_tile

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
        """The checks of an enabled block that need no process group (``cp_size`` against the world is
        :meth:`tile_for`'s)."""
        if self.cp_size is None:
            raise ValueError(f'"{BLOCK}": "enabled": true needs "cp_size" (ranks per context-parallel group)')
        self._check_head_parallel()
        if self.tile == "auto":
            missing = [k for k in ("topology", "seq_len") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f'"{BLOCK}": "tile": "auto" predicts the fastest tile and needs {missing} '
                    f'(for example "topology": "h100", "seq_len": 131072), or give a tile such as "2x2"'
                )
        elif self.tile is not None:
            self._check_tile()
        if self.topology is not None:
            from mesh_cp.sim.topology import Topology

            Topology.preset(self.topology)
        if self.seq_len is not None and self.seq_len % self.seq_multiple:
            raise ValueError(
                f'"{BLOCK}": "seq_len" {self.seq_len} must be a multiple of 2 * cp_size = {self.seq_multiple} '
                f"(the zig-zag layout gives every rank two equal half-chunks)"
            )

    def _check_head_parallel(self) -> None:
        """``head_parallel`` divides ``cp_size``."""
        if self.head_parallel is not None:
            reason = head_parallel_unavailable(self.cp_size, self.head_parallel)
            if reason is not None:
                raise ValueError(f'"{BLOCK}": {reason} ("cp_size")')

    def _check_tile(self) -> None:
        try:
            Tiling.parse(self.tile, self.mesh_ranks)
        except ValueError as err:
            if self.mesh_ranks == self.cp_size:
                raise
            raise ValueError(
                f'"{BLOCK}": "tile" {self.tile} must tile cp_size / head_parallel = {self.cp_size} / {self.head_parallel} = '
                f"{self.mesh_ranks} mesh ranks: {err}"
            ) from None

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
        """The tile to build, after checking that ``cp_size`` divides ``world``."""
        if world % self.cp_size:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f'"{BLOCK}": "cp_size" {self.cp_size} does not divide the {world} ranks; choose one of {divisors}'
            )
        return self.tile or most_square_tile(self.mesh_ranks)

    @property
    def attention_options(self) -> dict[str, str]:
        """The options of :func:`mesh_cp.mesh_attn_func` the block sets."""
        return {"schedule": self.schedule, "backward": self.backward}


def _check_type(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind):
        raise ValueError(f'"{BLOCK}": "{name}" must be a {kind.__name__}, got {value!r}')
