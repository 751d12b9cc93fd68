"""The CP mesh: a handle to a context-parallel process group, its tiling, its head-parallel degree and the
subgroups they need (head groups, Q-groups, KV-groups).

It holds process groups and what they are; choosing a tile from a cluster topology is :func:`mesh_cp.auto_mesh`,
the cross-rank call check is :mod:`mesh_cp.runtime.check`, and naming groups for the byte counter is
:func:`mesh_cp.debug.group_roles`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from mesh_cp.core.head_parallel import check_head_parallel, head_group_ranks, mesh_group_ranks
from mesh_cp.core.layout import check_layout, chunk_ranges
from mesh_cp.core.options import Layout, refuse_keywords, refuse_renamed
from mesh_cp.core.tiling import Tiling
from mesh_cp.runtime.check import check_same
from mesh_cp.runtime.groups import group_timeout, new_subgroups

_AUTO = (
    "choosing the tile from a cluster topology is mesh_cp.auto_mesh(group, topology=..., shape=..., "
    "memory_budget=...); CPMesh.create takes a concrete tile=(a, b) and head_parallel"
)


@dataclass(frozen=True, eq=False)
class CPMesh:
    """A context-parallel group of ``P = head_parallel * a * b`` ranks: groups of ``u = head_parallel`` consecutive
    ranks exchange heads (Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`; none for ``u = 1``) and the
    ``m = P / u`` ranks holding the same heads are tiled ``a x b`` (Note [Mesh tiling] in :mod:`mesh_cp.core.tiling`).

    Build it with :meth:`create` (collective over ``group``) or :meth:`from_device_mesh`, or let the cost model
    choose with :func:`mesh_cp.auto_mesh`; pass it explicitly to :func:`mesh_cp.mesh_attn_func`. There is no
    default: ``None`` never means "world".

    A mesh is a handle to process groups: ``copy.copy`` and ``copy.deepcopy`` return the mesh itself
    (so a model holding one can be deep-copied), and two meshes are equal only when they are the same.
    """

    group: ProcessGroup
    """The CP process group (rank order = sequence-chunk order)."""
    tiling: Tiling
    """The ``a x b`` tiling of the ``m`` mesh ranks of each mesh group (of all ``P`` ranks when ``u = 1``)."""
    rank: int
    """This process's rank within the CP group."""
    global_ranks: tuple[int, ...]
    """Global ranks of the CP group, indexed by CP rank."""
    q_group: ProcessGroup
    """This rank's Q-group: the ``a`` ranks of its mesh group whose Q rows it computes."""
    kv_group: ProcessGroup
    """This rank's KV-group: the ``b`` ranks of its mesh group whose KV columns it computes."""
    check_group: ProcessGroup
    """A twin of :attr:`group` (same members) for the call checks of :mod:`mesh_cp.runtime.check`, so that their
    few bytes are told apart from the attention's."""
    head_parallel: int = 1
    """``u``: ranks per head group (Note [Head-parallel x mesh]); ``1``: plain Mesh-Attention over the whole group."""
    head_group: ProcessGroup | None = None
    """With ``u > 1``: the ``u`` consecutive CP ranks that exchange heads (all-to-all)."""
    link_cost: tuple[float, float] = (1.0, 1.0)
    """Relative seconds per byte on the Q ring and the KV ring (orders the overlapped schedule)."""
    reason: str = ""
    """Why :func:`mesh_cp.auto_mesh` chose this layout (empty for an explicit tile)."""
    debug: bool = False
    """Check the signature of every attention call across the CP group (:mod:`mesh_cp.runtime.check`), not
    only of calls whose signature is new on this rank. Costs one small all-gather and a host sync per call."""

    @property
    def size(self) -> int:
        """``P``, the ranks of the CP group: ``head_parallel`` times the ``tiling.world`` mesh ranks."""
        return self.tiling.world * self.head_parallel

    @property
    def mesh_rank(self) -> int:
        """This rank's rank in its mesh group (``rank // head_parallel``): the rank of the plan's blocks."""
        return self.rank // self.head_parallel

    @property
    def tile(self) -> tuple[int, int]:
        return self.tiling.shape

    def local_ranges(self, seq_len: int, layout: Layout) -> tuple[tuple[int, int], ...]:
        """Global ``[start, stop)`` ranges of the tokens this rank holds of a sequence of ``seq_len``, in local
        order: its chunk of ``layout`` over the ``P`` ranks, whatever :attr:`head_parallel`."""
        return chunk_ranges(seq_len, self.size, self.rank, layout)

    def seq_multiple(self, layout: Layout) -> int:
        """The multiple every global sequence length must be for ``layout`` (pad to it): ``2P`` for zig-zag and
        ``P`` for contiguous, whatever :attr:`head_parallel`."""
        return 2 * self.size if check_layout(layout) == "zigzag" else self.size

    @classmethod
    def create(
        cls,
        group: ProcessGroup,
        *,
        tile: tuple[int, int] | str,
        head_parallel: int = 1,
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
        **refused,
    ) -> CPMesh:
        """Tile the CP process group ``group``: ``head_parallel = u`` consecutive ranks exchange heads and the
        ``P / u`` ranks holding the same heads are tiled ``tile = (a, b)`` (or ``"axb"``), ``a * b = P / u``.

        ``head_parallel=1`` (the default) is plain Mesh-Attention over all ``P`` ranks; ``tile=(1, P / u)`` is
        USP (Ulysses x ring); ``head_parallel=P`` with ``tile=(1, 1)`` is Ulysses. A layout chosen by the cost model
        for a cluster is :func:`mesh_cp.auto_mesh`.

        Collective: every rank of ``group`` must call it with the same tile, ``head_parallel`` and ``debug``
        (checked). It creates this rank's subgroups of ``group``
        (:func:`mesh_cp.runtime.groups.new_subgroups`: among their members only, or by splitting ``group``'s
        communicator when the default group is bound to a device), so several CP groups (for example one per
        data-parallel replica) can build their meshes at the same time.

        ``timeout`` bounds every collective of the subgroups; ``None`` means ``group``'s own timeout (the
        ``init_process_group`` timeout for groups that inherit it), so a stalled rank makes the others raise within
        it. ``debug=True`` checks every attention call's signature across the group (:attr:`debug`).

        On NCCL, call ``torch.cuda.set_device(local_rank)`` before this: the checks run on the group's
        bound device, else on the current CUDA device.
        """
        _refuse(refused, "CPMesh.create")
        if tile == "auto":
            raise ValueError(f"tile='auto': {_AUTO}")
        _check_cp_group(group)
        world = dist.get_world_size(group)
        check_head_parallel(world, head_parallel)
        try:
            tiling = Tiling.parse(tile, world // head_parallel)
        except ValueError as err:
            if head_parallel == 1:
                raise
            raise ValueError(
                f"with head_parallel={head_parallel} the tile tiles P / head_parallel = {world // head_parallel} mesh "
                f"ranks: {err}"
            ) from None
        return cls.from_tiling(group, tiling, head_parallel=head_parallel, timeout=timeout, debug=debug)

    @classmethod
    def from_tiling(
        cls,
        group: ProcessGroup,
        tiling: Tiling,
        *,
        head_parallel: int = 1,
        link_cost: tuple[float, float] = (1.0, 1.0),
        reason: str = "",
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
    ) -> CPMesh:
        """The mesh of a concrete ``tiling`` of the ``P / head_parallel`` mesh ranks of ``group`` (:meth:`create`
        parses a tile and calls it; :func:`mesh_cp.auto_mesh` calls it with the tile, ``link_cost`` and ``reason``
        the cost model gives). Collective over ``group``: checks that every rank asked for the same tiling,
        ``head_parallel`` and ``debug``."""
        _check_cp_group(group)
        world = dist.get_world_size(group)
        u = check_head_parallel(world, head_parallel)
        if tiling.world * u != world:
            raise ValueError(
                f"tiling {tiling} is of {tiling.world} ranks; with head_parallel={u} the CP group of {world} needs "
                f"{world // u} mesh ranks"
            )
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        if not isinstance(debug, bool):
            raise ValueError(f"debug must be True or False, got {debug!r}")
        wanted = {"tile": str(tiling), "head_parallel": u, "debug": debug}
        check_same(group, wanted, what="asked for different meshes")
        ranks = tuple(dist.get_process_group_ranks(group))
        timeout = group_timeout(group) if timeout is None else timeout

        def subgroups(members_of) -> ProcessGroup:  # one subgroup per distinct member list, this rank's returned
            members = sorted({members_of(r) for r in range(world)})
            return new_subgroups(group, [[ranks[r] for r in m] for m in members], timeout=timeout)

        # Every member creates its groups in the same order; groups of one kind are disjoint, so the member-local
        # handshakes cannot wait on each other. Mesh rank g of mesh group i is CP rank g * u + i.
        def in_mesh(rank: int, mesh_members) -> tuple[int, ...]:
            g, i = divmod(rank, u)
            return tuple(m * u + i for m in mesh_members(g))

        head_group = subgroups(lambda r: head_group_ranks(world, u, r)) if u > 1 else None
        q_group = subgroups(lambda r: in_mesh(r, tiling.q_group))
        kv_group = subgroups(lambda r: in_mesh(r, tiling.kv_group))
        check_group = new_subgroups(group, [list(ranks)], timeout=timeout)
        return cls(
            group=group,
            tiling=tiling,
            rank=dist.get_rank(group),
            global_ranks=ranks,
            q_group=q_group,
            kv_group=kv_group,
            check_group=check_group,
            head_parallel=u,
            head_group=head_group,
            link_cost=link_cost,
            reason=reason,
            debug=debug,
        )

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh,
        axis: str | int,
        *,
        tile: tuple[int, int] | str,
        head_parallel: int = 1,
        timeout: datetime.timedelta | None = None,
        debug: bool = False,
    ) -> CPMesh:
        """Tile the process group of one axis (name or index) of a ``torch.distributed.DeviceMesh``;
        ``tile``, ``head_parallel``, ``timeout`` and ``debug`` as in :meth:`create`."""
        if axis is None:
            raise ValueError("axis=None is not accepted: name the DeviceMesh dimension that is context-parallel")
        names = device_mesh.mesh_dim_names
        if isinstance(axis, str) and (names is None or axis not in names):
            raise ValueError(f"DeviceMesh has no dimension {axis!r}; its dimensions are {names}")
        group = device_mesh.get_group(axis)
        return cls.create(group, tile=tile, head_parallel=head_parallel, timeout=timeout, debug=debug)

    def __copy__(self) -> CPMesh:
        return self

    def __deepcopy__(self, memo: dict) -> CPMesh:
        return self

    @property
    def layout_name(self) -> str:
        """``"2x2"``, or ``"head_parallel 2 x 2x2"`` with head groups."""
        tile = f"{self.tiling.a}x{self.tiling.b}"
        return tile if self.head_parallel == 1 else f"head_parallel {self.head_parallel} x {tile}"

    def describe_groups(self) -> str:
        """This rank's groups in global ranks: ``"head group [..], Q-group [..], KV-group [..]"`` (no head group for
        ``head_parallel = 1``)."""
        mesh = [self.global_ranks[r] for r in mesh_group_ranks(self.size, self.head_parallel, self.rank)]
        q = [mesh[g] for g in self.tiling.q_group(self.mesh_rank)]
        kv = [mesh[g] for g in self.tiling.kv_group(self.mesh_rank)]
        text = f"Q-group {q}, KV-group {kv}"
        if self.head_parallel == 1:
            return text
        heads = [self.global_ranks[r] for r in head_group_ranks(self.size, self.head_parallel, self.rank)]
        return f"head group {heads}, {text}"

    def __str__(self) -> str:
        return f"CP({self.layout_name}) rank {self.rank}: {self.describe_groups()}"


def _refuse(refused: dict, where: str) -> None:
    """Name the fix for a keyword that is not :meth:`CPMesh.create`'s: a former spelling, or the cost model's."""
    refuse_renamed(refused, where=where)
    auto = [name for name in ("topology", "shape", "memory_budget") if name in refused]
    if auto:
        raise ValueError(f"{where} got {auto[0]}=: {_AUTO}")
    refuse_keywords(refused, where=where)


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
