"""The CP mesh: a context-parallel process group, its tiling, and its Q-group / KV-group subgroups."""

from __future__ import annotations

import datetime
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core.layout import check_layout, chunk_ranges
from mesh_cp.core.plan import AttentionShape
from mesh_cp.core.tiling import Tiling
from mesh_cp.runtime.comm import all_gather
from mesh_cp.runtime.groups import group_device, group_timeout, new_subgroups

if TYPE_CHECKING:
    from mesh_cp.sim import Topology


@dataclass(frozen=True, eq=False)
class CPMesh:
    """A context-parallel group of ``P`` ranks tiled ``a x b``; see Note [Mesh tiling] in
    :mod:`mesh_cp.core.plan`.

    Build it with :meth:`create` (collective over ``group``) or :meth:`from_device_mesh`; pass it
    explicitly to :func:`mesh_cp.mesh_attn_func`. There is no default: ``None`` never means "world".

    A mesh is a handle to process groups: ``copy.copy`` and ``copy.deepcopy`` return the mesh itself
    (so a model holding one can be deep-copied), and two meshes are equal only when they are the same.
    """

    group: ProcessGroup
    """The CP process group (rank order = sequence-chunk order)."""
    q_group: ProcessGroup
    """This rank's Q-group: the ``a`` CP ranks whose Q rows it computes."""
    kv_group: ProcessGroup
    """This rank's KV-group: the ``b`` CP ranks whose KV columns it computes."""
    tiling: Tiling
    """The ``a x b`` tiling of the CP group."""
    rank: int
    """This process's rank within the CP group."""
    global_ranks: tuple[int, ...]
    """Global ranks of the CP group, indexed by CP rank."""
    link_cost: tuple[float, float] = (1.0, 1.0)
    """Relative seconds per byte on the Q ring and the KV ring (orders the overlapped schedule)."""
    reason: str = ""
    """Why ``tile="auto"`` chose this tile (empty for an explicit tile)."""
    check_group: ProcessGroup | None = None
    """A twin of :attr:`group` (same members) for the signature checks of :meth:`check_same_call`, so that
    their few bytes are told apart from the attention's (role ``"check"`` of :meth:`role_of`); ``None``:
    they run on :attr:`group`."""
    debug: bool = False
    """Check the signature of every attention call across the CP group (see :meth:`check_same_call`), not
    only of calls whose signature is new on this rank. Costs one small all-gather and a host sync per call."""
    heads: int = 1
    """``u``: the head-parallel degree of the hybrid (Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`);
    ``1``: plain Mesh-Attention over the whole group."""
    head_group: ProcessGroup | None = None
    """With ``heads > 1``: the ``u`` consecutive CP ranks that exchange heads (all-to-all)."""
    inner: CPMesh | None = None
    """With ``heads > 1``: the mesh of the ``P / u`` ranks that hold the same heads, tiled :attr:`tiling`."""
    _seen: set[tuple[int, ...]] = field(default_factory=set, init=False, repr=False)
    """Call signatures already checked across the CP group."""

    @property
    def size(self) -> int:
        """``P``, the ranks of the CP group (``heads x`` the mesh's ranks)."""
        return self.tiling.world * self.heads

    def local_ranges(self, seq_len: int, layout: str) -> tuple[tuple[int, int], ...]:
        """Global ``[start, stop)`` ranges of the tokens this rank holds of a sequence of ``seq_len``, in local
        order: its chunk of ``layout`` over the ``P`` ranks, whatever :attr:`heads` (Note [Head-parallel x mesh])."""
        return chunk_ranges(seq_len, self.size, self.rank, layout)

    def seq_multiple(self, layout: str) -> int:
        """The multiple every global sequence length must be for ``layout`` (pad to it): ``2P`` for zig-zag and
        ``P`` for contiguous, whatever :attr:`heads`."""
        return 2 * self.size if check_layout(layout) == "zigzag" else self.size

    @property
    def tile(self) -> tuple[int, int]:
        return self.tiling.shape

    @classmethod
    def create(
        cls,
        group: ProcessGroup,
        *,
        tile: tuple[int, int] | str,
        heads: int | None = None,
        topology: Topology | str | None = None,
        shape: AttentionShape | None = None,
        memory_budget: int | None = None,
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
    ) -> CPMesh:
        """Tile the CP process group ``group`` as ``tile = (a, b)`` (or ``"axb"``), ``a * b = group size``.

        ``heads = u > 1``: the head-parallel x mesh hybrid (Note [Head-parallel x mesh] in
        :mod:`mesh_cp.runtime.heads`): groups of ``u`` consecutive ranks exchange heads by all-to-all, and the
        ``P / u`` ranks holding the same heads run Mesh-Attention tiled ``tile`` (``a * b = P / u``). ``tile=(1,
        P / u)`` is USP (Ulysses x ring), ``heads=P`` with ``tile=(1, 1)`` is Ulysses. ``None``: ``1`` with an
        explicit tile; with ``tile="auto"`` the cost model chooses ``u`` too (``heads=1`` keeps it to plain meshes).

        ``tile="auto"`` (or any tile with a ``topology``) is :func:`mesh_cp.auto_mesh`: the layout the cost model
        predicts fastest for ``topology`` (a :class:`mesh_cp.sim.Topology` or a preset name such as ``"h100"``)
        and ``shape`` (the per-rank :class:`mesh_cp.core.AttentionShape` of the attention calls), within
        ``memory_budget`` bytes per rank, logged with why (logger ``mesh_cp``; also in :attr:`reason`). With a
        topology the overlapped schedule orders its moves by the two rings' link speeds (Q-groups of
        consecutive ranks sit inside a node when ``a`` divides the ranks per node). The cost model is
        imported only then.

        Collective: every rank of ``group`` must call it with the same tile and ``debug`` (checked). It
        creates this rank's Q-group and KV-group as subgroups of ``group``
        (:func:`mesh_cp.runtime.groups.new_subgroups`: among their members only, or by splitting
        ``group``'s communicator when the default group is bound to a device), so several CP groups (for
        example one per data-parallel replica) can build their meshes at the same time.

        ``timeout`` bounds every collective of the Q- and KV-groups; ``None`` means ``group``'s own
        timeout (the ``init_process_group`` timeout for groups that inherit it), so a stalled rank makes
        the others raise within it. ``debug=True`` checks every attention call's signature across the
        group (:attr:`debug`).

        On NCCL, call ``torch.cuda.set_device(local_rank)`` before this: the checks run on the group's
        bound device, else on the current CUDA device.
        """
        _check_cp_group(group)
        world = dist.get_world_size(group)
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        if not isinstance(debug, bool):
            raise ValueError(f"debug must be True or False, got {debug!r}")
        if tile == "auto" or topology is not None:
            from mesh_cp.auto import auto_mesh  # the cost model is loaded only for a topology

            options = {"shape": shape, "memory_budget": memory_budget, "timeout": timeout, "debug": debug}
            return auto_mesh(group, topology=topology, tile=tile, heads=heads, **options)
        heads = 1 if heads is None else heads
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or world % heads:
            raise ValueError(
                f"heads={heads!r} must be a positive divisor of the CP group size {world} (the head-parallel degree u "
                f"of P = u x mesh ranks); heads=1 is plain Mesh-Attention"
            )
        if shape is not None or memory_budget is not None:
            raise ValueError(
                "shape= and memory_budget= are what tile='auto' chooses from; give them with tile='auto' and topology="
            )
        try:
            tiling = Tiling.parse(tile, world // heads)
        except ValueError as err:
            if heads == 1:
                raise
            raise ValueError(
                f"with heads={heads} the tile tiles P / heads = {world // heads} mesh ranks: {err}"
            ) from None
        return cls.from_tiling(group, tiling, heads=heads, timeout=timeout, debug=debug)

    @classmethod
    def from_tiling(
        cls,
        group: ProcessGroup,
        tiling: Tiling,
        *,
        heads: int = 1,
        link_cost: tuple[float, float] = (1.0, 1.0),
        reason: str = "",
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
    ) -> CPMesh:
        """The mesh of a concrete ``tiling`` of ``group`` (:meth:`create` checks the arguments and calls it;
        :func:`mesh_cp.auto_mesh` calls it with the tile, ``link_cost`` and ``reason`` the cost model gives).
        With ``heads = u > 1``, ``tiling`` tiles the ``P / u`` ranks of each head slice. Collective over ``group``:
        checks that every rank asked for the same tiling, heads and ``debug``."""
        world = dist.get_world_size(group)
        if tiling.world * heads != world:
            raise ValueError(
                f"tiling {tiling} is of {tiling.world} ranks; with heads={heads} the CP group of {world} needs "
                f"{world // heads if world % heads == 0 else world / heads} mesh ranks"
            )
        _check_same_tile(group, tiling, heads, debug)
        global_ranks = tuple(dist.get_process_group_ranks(group))
        if timeout is None:
            timeout = group_timeout(group)
        options = {"group": group, "tiling": tiling, "rank": dist.get_rank(group), "global_ranks": global_ranks}
        options |= {"link_cost": link_cost, "reason": reason, "debug": debug, "heads": heads}
        if heads > 1:
            return cls._hybrid(options, timeout)
        # Every member creates its Q-group first, then its KV-group. Q-groups are disjoint, and so
        # are KV-groups, so the member-local handshakes cannot wait on each other.
        q_group = new_subgroups(
            group, [[global_ranks[r] for r in members] for members in tiling.q_groups()], timeout=timeout
        )
        kv_group = new_subgroups(
            group, [[global_ranks[r] for r in members] for members in tiling.kv_groups()], timeout=timeout
        )
        check_group = new_subgroups(group, [list(global_ranks)], timeout=timeout)
        return cls(q_group=q_group, kv_group=kv_group, check_group=check_group, **options)

    @classmethod
    def _hybrid(cls, options: dict, timeout: datetime.timedelta | None) -> CPMesh:
        """The head groups (consecutive ranks), the mesh groups (ranks ``i, i + u, ...``) and the mesh of this
        rank's mesh group (Note [Head-parallel x mesh])."""
        group, ranks, u, m = options["group"], options["global_ranks"], options["heads"], options["tiling"].world
        head_group = new_subgroups(group, [[ranks[g * u + i] for i in range(u)] for g in range(m)], timeout=timeout)
        mesh_group = new_subgroups(group, [[ranks[g * u + i] for g in range(m)] for i in range(u)], timeout=timeout)
        inner = cls.from_tiling(
            mesh_group, options["tiling"], link_cost=options["link_cost"], timeout=timeout, debug=options["debug"]
        )
        check_group = new_subgroups(group, [list(ranks)], timeout=timeout)
        return cls(
            q_group=inner.q_group,
            kv_group=inner.kv_group,
            check_group=check_group,
            head_group=head_group,
            inner=inner,
            **options,
        )

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh,
        axis: str | int,
        *,
        tile: tuple[int, int] | str,
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
    ) -> CPMesh:
        """Tile the process group of one axis (name or index) of a ``torch.distributed.DeviceMesh``;
        ``tile``, ``timeout`` and ``debug`` as in :meth:`create`."""
        if axis is None:
            raise ValueError("axis=None is not accepted: name the DeviceMesh dimension that is context-parallel")
        names = device_mesh.mesh_dim_names
        if isinstance(axis, str) and (names is None or axis not in names):
            raise ValueError(f"DeviceMesh has no dimension {axis!r}; its dimensions are {names}")
        return cls.create(device_mesh.get_group(axis), tile=tile, timeout=timeout, debug=debug)

    def __copy__(self) -> CPMesh:
        return self

    def __deepcopy__(self, memo: dict) -> CPMesh:
        return self

    def check_same_call(self, signature: Mapping[str, object]) -> None:
        """Raise ``ValueError`` on every rank when the ranks of the CP group call with different ``signature``.

        ``signature`` maps names to ints, bools, floats, strings, shapes (tuples of up to 4 ints) or
        ``None``: the same names, in the same order, on every rank (:func:`mesh_cp.mesh_attn_func` passes
        its shapes, dtypes, device type and options). The error names, for each entry that differs, the
        value of every rank. Collective over the CP group (on :attr:`check_group`) when it checks: once per
        signature new to this rank (one all-gather of a few int64 on the group's device, and a host sync),
        on every call when :attr:`debug` is set. A group of the ``"fake"`` backend moves no data and is
        not checked.

        Limit: a rank whose signature was already checked does not check again (without :attr:`debug`).
        When one rank diverges to a signature it has seen before while the others call with one that
        is new to them, the others wait in the check and that rank in the attention: the mismatch is
        caught by the process groups' timeout, not by this message. ``debug=True`` removes the limit.
        """
        codes = tuple(code for value in signature.values() for code in _code(value))
        if codes in self._seen and not self.debug:
            return
        group = self.group if self.check_group is None else self.check_group
        if str(dist.get_backend(group)) != "fake":
            _check_same(group, signature, codes, what="called mesh_attn_func with different arguments")
        self._seen.add(codes)

    def role_of(self, group_name: str) -> str | None:
        """``"q"``, ``"kv"``, ``"cp"``, ``"heads"`` (:attr:`head_group`), ``"mesh"`` (the inner mesh's group) or ``"check"`` (:attr:`check_group`, and the
        inner mesh's) for this mesh's process-group names, ``None`` for others."""
        inner_check = None if self.inner is None else self.inner.check_group
        mesh_group = None if self.inner is None else self.inner.group
        roles = (("q", self.q_group), ("kv", self.kv_group), ("cp", self.group), ("heads", self.head_group))
        roles += (("mesh", mesh_group),)
        for role, pg in (*roles, ("check", self.check_group), ("check", inner_check)):
            if pg is not None and pg.group_name == group_name:
                return role
        return None

    def __str__(self) -> str:
        if self.inner is not None:
            heads = dist.get_process_group_ranks(self.head_group)
            return f"CP(heads {self.heads} x {self.inner}) rank {self.rank}: head group {heads}"
        a, b = self.tile
        q = [self.global_ranks[r] for r in self.tiling.q_group(self.rank)]
        kv = [self.global_ranks[r] for r in self.tiling.kv_group(self.rank)]
        return f"CP({a}x{b}) rank {self.rank}: Q-group {q}, KV-group {kv}"


def _check_cp_group(group: ProcessGroup) -> None:
    """Raise ``ValueError`` unless ``group`` is a process group this rank belongs to."""
    if group is None and not dist.is_initialized():  # dist.group.WORLD is None until then
        raise ValueError(
            "no default process group: call torch.distributed.init_process_group(...) first (or launch with torchrun "
            "/ accelerate launch), then pass dist.group.WORLD"
        )
    if group is None:
        raise ValueError(
            "group=None is not accepted: pass the context-parallel process group explicitly "
            "(for example torch.distributed.group.WORLD, or the CP group of your DP x CP layout); "
            "new_group(..., use_local_synchronization=True) returns None to ranks outside the group, "
            "so call CPMesh.create only on the group's members"
        )
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the CP group it passed (new_group returns "
            f"GroupMember.NON_GROUP_MEMBER to ranks outside the group); call CPMesh.create only on the "
            f"group's members, with the group they belong to"
        )
    if not isinstance(group, ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized; call init_process_group() first")
    cp_rank = dist.get_rank(group)
    if cp_rank < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the CP group it passed "
            f"(members {dist.get_process_group_ranks(group)}); pass the group this rank belongs to"
        )


def _check_same_tile(group: ProcessGroup, tiling: Tiling, heads: int, debug: bool) -> None:
    """Raise on every rank when the members of ``group`` asked for different tiles, heads or ``debug`` flags."""
    mine = torch.tensor([tiling.a, tiling.b, heads, int(debug)], dtype=torch.int64, device=group_device(group))
    tiles = [tuple(row) for row in all_gather(mine, group).tolist()]
    if len({(a, b, u) for a, b, u, _ in tiles}) != 1:
        listing = ", ".join(
            f"rank {r}: {a}x{b}" + (f" heads={u}" if u != 1 else "") for r, (a, b, u, _) in enumerate(tiles)
        )
        raise ValueError(
            f"ranks of the CP group asked for different tiles ({listing}); pass the same tile and heads on every rank"
        )
    if len({flag for *_, flag in tiles}) != 1:
        listing = ", ".join(f"rank {r}: {bool(flag)}" for r, (*_, flag) in enumerate(tiles))
        raise ValueError(f"ranks of the CP group passed different debug= ({listing}); pass the same on every rank")


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


def _check_same(group: ProcessGroup, signature: Mapping[str, object], codes: tuple[int, ...], *, what: str) -> None:
    """All-gather ``codes`` over ``group``; on a difference, gather the readable ``signature`` of every rank
    and raise ``ValueError`` on every rank naming, per differing entry, each rank's value."""
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
