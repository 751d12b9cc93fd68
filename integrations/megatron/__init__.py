"""Megatron-core: Mesh-Attention as the ``core_attention`` of a layer spec, and CP on a 2-D mesh.

::

    from megatron.core import parallel_state
    from mesh_cp.integrations import megatron as mcp

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=4)
    layout = mcp.MeshLayout.from_parallel_state(tile=(2, 2), ranks_per_node=8)
    print(layout)                                  # TP(2)-CP(2x2)-DP(2) rank 5: Q-group [...], KV-group [...]
    spec = mcp.get_gpt_layer_mesh_spec(mesh=layout.mesh)          # the local spec, core_attention swapped
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)

Megatron's rank order is ``tp-cp-ep-dp-pp``: global rank ``tp + TP * (cp + CP * dp)``. Its CP group
(CP rank = zig-zag chunk index, as in ``get_batch_on_this_cp_rank``) is tiled ``a x b``: the Q-group
of CP rank ``g`` is the ``a`` consecutive CP ranks ``g // a * a + i`` and its KV-group the ``b`` ranks
``g % a + j * a`` (Note [Mesh tiling] in :mod:`mesh_cp.core.plan`); both are subgroups of the CP
group. Consecutive CP ranks are ``TP`` global ranks apart, so a node of ``R`` GPUs holds ``R / TP``
consecutive CP ranks, and Q-groups stay inside a node when ``a`` divides ``R / TP``.

For Megatron-LM's ``pretrain_gpt.py``: ``--spec mesh_cp.integrations.megatron gpt_layer_mesh_spec``
(most square tile of the CP size, LayerNorm) or ``gpt_layer_mesh_spec_rmsnorm``; see docs/megatron.md.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

import mesh_cp
from mesh_cp.core import AttentionShape, Tiling, factorizations, most_square_tile
from mesh_cp.runtime.device_checks import check_on_device
from mesh_cp.runtime.mesh import CPMesh

logger = logging.getLogger("mesh_cp")

SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)
"""Mask types the mesh computes itself: causal over global positions, or none (full attention)."""
SUPPORTED_CP_COMM_TYPES = (None, "p2p")
"""``cp_comm_type`` values accepted (Megatron-LM's default is ``"p2p"``); the mesh tile decides the traffic."""


def _cp_group(pg_collection) -> dist.ProcessGroup:
    """The CP group: ``pg_collection.cp`` when given, else Megatron's ``parallel_state``."""
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "no context-parallel group: pass pg_collection with a cp group, or call "
            "megatron.core.parallel_state.initialize_model_parallel(...) before building the model"
        )
    return parallel_state.get_context_parallel_group()


def cp_ranks_per_node(cp_ranks: tuple[int, ...], ranks_per_node: int) -> int | None:
    """How many consecutive CP ranks share a node of ``ranks_per_node`` GPUs (global rank // R is the
    node), when every node holds the same number of consecutive CP ranks; ``None`` otherwise."""
    nodes = [r // ranks_per_node for r in cp_ranks]
    runs: list[int] = []
    for i, node in enumerate(nodes):
        if i and node == nodes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs[0] if len(set(runs)) == 1 else None


def node_local_tile(cp_size: int, per_node: int) -> tuple[int, int]:
    """The most square ``a x b`` of ``cp_size`` whose Q-groups (``a`` consecutive CP ranks) fit in a node
    of ``per_node`` CP ranks: ``a`` divides ``per_node`` (the whole CP group when it fits in a node)."""
    if per_node >= cp_size:
        return most_square_tile(cp_size)
    fits = [t for t in factorizations(cp_size) if per_node % t[0] == 0]
    return min(fits, key=lambda t: (abs(math.log(t[0] / t[1])), -t[0]))


class MaskCheck:
    """Checks that Megatron's ``attention_mask`` is the causal mask of the zig-zag chunks, without a host
    synchronisation per layer or per step.

    The first mask of each (shape, device, dtype) is compared on the host (a clear error, one
    synchronisation). A later mask of that kind, a new tensor every step from the data loader, is compared
    where it is with ``torch._assert_async`` (on a GPU a wrong mask stops the run with a device-side
    assertion at the next synchronisation; on the CPU the same ``NotImplementedError`` at once). The layers of a model share one check, and a mask already
    checked (the same tensor, not modified since) is not compared again, so a step costs at most one
    comparison and no synchronisation.
    """

    MESSAGE = (
        "attention_mask is not the causal mask of the zig-zag chunks: padding and arbitrary masks are not "
        "supported by mesh_cp; pass no mask (Megatron-LM --no-create-attention-mask-in-dataloader)"
    )

    def __init__(self) -> None:
        self._kinds: set[tuple] = set()
        self._last: tuple[weakref.ref, int] | None = None

    def __call__(self, mask: Tensor, mesh: CPMesh, causal: bool, seq_local: int, batch: int) -> None:
        seq = seq_local * mesh.size
        if mask.dim() != 4 or tuple(mask.shape[-2:]) != (seq_local, seq) or mask.shape[0] not in (1, batch):
            raise NotImplementedError(
                f"attention_mask of shape {tuple(mask.shape)} is not supported by mesh_cp: only the causal mask "
                f"[b, 1, {seq_local}, {seq}] is accepted (or none: Megatron-LM --no-create-attention-mask-in-dataloader)"
            )
        if not causal:
            raise NotImplementedError(self.MESSAGE)
        if self._last is not None and self._last[0]() is mask and self._last[1] == mask._version:
            return
        rows = mesh_cp.position_ids(seq, mesh=mesh, layout="zigzag", device=mask.device)
        expected = rows[:, None] < torch.arange(seq, device=mask.device)[None, :]
        same = (mask == expected).all()
        kind = (tuple(mask.shape), mask.device, mask.dtype)
        if kind in self._kinds:
            check_on_device(same, NotImplementedError(self.MESSAGE))
        elif not bool(same):
            raise NotImplementedError(self.MESSAGE)
        self._kinds.add(kind)
        self._last = (weakref.ref(mask), mask._version)


@dataclass(eq=False)
class MeshProvider:
    """Builds, once per CP group, the :class:`CPMesh` every core-attention layer of a model shares.

    It travels in the layer spec's ``params`` (no module-level state): the first layer constructed on a
    CP group creates the mesh (collective over that group), the others reuse it. ``mesh`` pins one
    already built (it must tile the layers' CP group).
    """

    tile: tuple[int, int] | str = "square"
    """``(a, b)``, ``"axb"``, ``"square"`` (the most square; with ``ranks_per_node`` the most square whose
    Q-groups stay inside a node) or ``"auto"`` (the cost model's choice; needs ``topology`` and ``shape``)."""
    ranks_per_node: int | None = None
    """GPUs per node, when known: places Q-groups inside nodes and tells the schedule which ring is slow."""
    topology: object = None
    """A :class:`mesh_cp.sim.Topology` or preset name (``"h100"``) of the whole cluster, for ``tile="auto"``
    and the overlapped schedule's move order; its ``ranks_per_node`` is rescaled to CP ranks per node."""
    shape: AttentionShape | None = None
    """Per-rank attention shape, for ``tile="auto"``."""
    mesh: CPMesh | None = None
    """A mesh built beforehand (for example by :class:`MeshLayout`); then the fields above are unused."""
    _meshes: dict = field(default_factory=dict, repr=False)
    mask_check: MaskCheck = field(default_factory=lambda: MaskCheck(), repr=False)
    """Checks the ``attention_mask`` the layers get (shared by them: a mask is checked once, not per layer)."""

    def mesh_for(self, cp_group: dist.ProcessGroup) -> CPMesh:
        """The mesh over ``cp_group`` (created on first use, collective over the group)."""
        ranks = tuple(dist.get_process_group_ranks(cp_group))
        if self.mesh is not None:
            if self.mesh.global_ranks != ranks:
                raise ValueError(
                    f"the mesh tiles global ranks {list(self.mesh.global_ranks)} but this layer's CP group is "
                    f"{list(ranks)}; build the mesh over the model's CP group (MeshLayout.from_parallel_state)"
                )
            return self.mesh
        # Keyed by the group object (kept alive by the key): a re-initialized parallel_state makes new
        # groups over the same ranks, which need a new mesh.
        if cp_group not in self._meshes:
            self._meshes[cp_group] = build_mesh(
                cp_group,
                tile=self.tile,
                ranks_per_node=self.ranks_per_node,
                topology=self.topology,
                shape=self.shape,
            )
        return self._meshes[cp_group]


def build_mesh(
    cp_group: dist.ProcessGroup,
    *,
    tile: tuple[int, int] | str = "square",
    ranks_per_node: int | None = None,
    topology=None,
    shape: AttentionShape | None = None,
) -> CPMesh:
    """Tile Megatron's CP group ``a x b`` (collective over ``cp_group``); see :class:`MeshProvider`.

    With ``ranks_per_node`` (or a topology) the CP ranks per node are counted from the global ranks, a
    ``"square"`` tile keeps Q-groups inside a node, and an explicit tile whose Q-groups cross nodes is
    logged as a warning (the Q ring then runs over the inter-node network).
    """
    if cp_group is None:
        raise ValueError("cp_group=None is not accepted: pass Megatron's context-parallel group")
    cp_size = dist.get_world_size(cp_group)
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    if topology is not None:
        from mesh_cp.sim import Topology

        if isinstance(topology, str):
            topology = Topology.preset(topology, ranks_per_node=ranks_per_node or 8)
        ranks_per_node = ranks_per_node or topology.ranks_per_node
    per_node = cp_ranks_per_node(ranks, ranks_per_node) if ranks_per_node else None
    if ranks_per_node and per_node is None:
        logger.warning(
            "mesh_cp: CP group %s does not hold the same number of consecutive ranks on every node of %d GPUs; "
            "Q-groups are not placed by node",
            list(ranks),
            ranks_per_node,
        )
    if tile == "square":
        tile = node_local_tile(cp_size, per_node) if per_node else most_square_tile(cp_size)
    cp_topology = replace(topology, ranks_per_node=per_node) if topology is not None and per_node else None
    if tile == "auto" and cp_topology is None:
        raise ValueError(
            "tile='auto' needs topology= (a mesh_cp.sim.Topology or preset name such as 'h100') whose "
            "ranks_per_node places every CP rank on a node, and shape= (per-rank AttentionShape)"
        )
    mesh = CPMesh.create(cp_group, tile=tile, topology=cp_topology, shape=shape)
    if per_node:
        a = mesh.tile[0]
        if per_node < cp_size and per_node % a:
            logger.warning(
                "mesh_cp: tile %dx%d puts Q-groups of %d CP ranks across nodes of %d CP ranks; tile %s keeps them "
                "inside a node",
                *mesh.tile,
                a,
                per_node,
                "x".join(map(str, node_local_tile(cp_size, per_node))),
            )
    return mesh


class MeshCoreAttention(MegatronModule):
    """Megatron core attention over the CP group's ``a x b`` mesh (exact, forward and backward).

    Constructed by Megatron's attention with ``config, layer_number, attn_mask_type, attention_type,
    cp_comm_type, softmax_scale, pg_collection``; ``mesh_provider`` comes from the spec's params. The
    CP group is ``pg_collection.cp`` when given, else ``parallel_state``'s. Inputs are this CP rank's
    zig-zag chunks ``r`` and ``2CP-1-r`` (``get_batch_on_this_cp_rank``), RoPE already applied.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        mesh_provider: MeshProvider,
        **mesh_options,
    ):
        super().__init__(config=config)
        if mesh_options:
            raise ValueError(f"unknown MeshCoreAttention options {sorted(mesh_options)}; the options are mesh_provider")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(
                f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0.0 "
                f"(Megatron-LM: --attention-dropout 0.0)"
            )
        if config.window_size is not None:
            raise NotImplementedError(
                f"sliding window {config.window_size} is not supported by mesh_cp yet; set window_size=None"
            )
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"softmax_type {config.softmax_type!r} is not supported by mesh_cp; use softmax_type='vanilla'"
            )
        if attn_mask_type not in SUPPORTED_MASK_TYPES:
            raise NotImplementedError(
                f"attn_mask_type {attn_mask_type.name} is not supported by mesh_cp; it computes "
                f"{[t.name for t in SUPPORTED_MASK_TYPES]} itself (padding and arbitrary masks are not supported)"
            )
        if cp_comm_type not in SUPPORTED_CP_COMM_TYPES:
            raise NotImplementedError(
                f"cp_comm_type {cp_comm_type!r} selects TransformerEngine's CP communication; with mesh_cp the "
                f"mesh tile decides it: leave cp_comm_type at {SUPPORTED_CP_COMM_TYPES[1]!r} (or None)"
            )
        if getattr(config, "hierarchical_context_parallel_sizes", None):
            raise NotImplementedError(
                f"hierarchical_context_parallel_sizes {config.hierarchical_context_parallel_sizes} is for "
                f"TransformerEngine's a2a+p2p CP; with mesh_cp leave it unset and choose the mesh tile"
            )
        if not isinstance(mesh_provider, MeshProvider):
            raise ValueError(
                f"mesh_provider must be a MeshProvider, got {type(mesh_provider).__name__}; "
                f"build the spec with get_gpt_layer_mesh_spec()"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        cp_group = _cp_group(pg_collection)
        if cp_group.size() != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size {config.context_parallel_size} differs from the CP group's size "
                f"{cp_group.size()}; build the TransformerConfig with the CP size of parallel_state"
            )
        self.mesh = mesh_provider.mesh_for(cp_group)
        self.mask_check = mesh_provider.mask_check
        self.head_dim = config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside its softmax (an fp16 range trick); the product is the plain scale.
        self.softmax_scale = self.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """``query [sq, b, heads, d]``, ``key/value [sk, b, kv_heads, d]`` (this CP rank's zig-zag chunks)
        -> ``[sq, b, heads * d]``: attention over the whole sequence of the CP group."""
        if packed_seq_params is not None:
            raise NotImplementedError(
                "packed sequences (packed_seq_params, THD format) are not supported by mesh_cp; "
                "pass unpacked [s, b, ...] batches"
            )
        if attention_bias is not None:
            raise NotImplementedError(
                f"attention_bias of shape {tuple(attention_bias.shape)} is not supported by mesh_cp; "
                f"use a position embedding that does not bias scores (RoPE or learned absolute)"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in SUPPORTED_MASK_TYPES:
            raise NotImplementedError(
                f"attn_mask_type {mask_type.name} is not supported by mesh_cp; only "
                f"{[t.name for t in SUPPORTED_MASK_TYPES]} (padding and arbitrary masks are not supported)"
            )
        causal = mask_type == AttnMaskType.causal
        if attention_mask is not None:
            self._check_mask(attention_mask, causal, query.shape[0], query.shape[1])
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        out = mesh_cp.mesh_attn_func(
            q, k, v, mesh=self.mesh, causal=causal, softmax_scale=self.softmax_scale, layout="zigzag"
        )
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _check_mask(self, mask: Tensor, causal: bool, seq_local: int, batch: int) -> None:
        """Accept only the mask the mesh applies anyway: Megatron's causal mask (``True`` = masked) for
        this rank's zig-zag queries over the global keys, as ``get_batch_on_this_cp_rank`` shards it
        (:class:`MaskCheck`: no host synchronisation per layer or step)."""
        self.mask_check(mask, self.mesh, causal, seq_local, batch)


def get_gpt_layer_mesh_spec(
    *,
    mesh: CPMesh | None = None,
    tile: tuple[int, int] | str = "square",
    ranks_per_node: int | None = None,
    topology=None,
    shape: AttentionShape | None = None,
    base_spec: ModuleSpec | None = None,
    **local_spec_options,
) -> ModuleSpec:
    """A GPT layer spec whose ``core_attention`` is :class:`MeshCoreAttention`; nothing else changes.

    ``base_spec`` (default: ``get_gpt_layer_local_spec(**local_spec_options)``, for example
    ``normalization="RMSNorm"``) is copied and only its self-attention's ``core_attention`` swapped.
    ``mesh`` pins a prebuilt mesh; otherwise the first layer builds one over the CP group with ``tile``,
    ``ranks_per_node``, ``topology`` and ``shape`` (see :class:`MeshProvider`), and all layers share it.
    """
    if base_spec is not None and local_spec_options:
        raise ValueError(f"pass base_spec or local spec options {sorted(local_spec_options)}, not both")
    spec = copy.deepcopy(base_spec) if base_spec is not None else get_gpt_layer_local_spec(**local_spec_options)
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is None:
        raise ValueError(
            "base_spec has no submodules.self_attention.submodules.core_attention slot; pass a transformer layer "
            "spec such as get_gpt_layer_local_spec()"
        )
    provider = MeshProvider(tile=tile, ranks_per_node=ranks_per_node, topology=topology, shape=shape, mesh=mesh)
    attention.submodules.core_attention = ModuleSpec(module=MeshCoreAttention, params={"mesh_provider": provider})
    return spec


@dataclass(frozen=True, eq=False)
class MeshLayout:
    """Megatron's TP x CP x DP (x PP) layout with its CP group tiled as a mesh; ``str()`` prints it."""

    tp: int
    cp: int
    dp: int
    pp: int
    rank: int
    """Global rank of this process."""
    mesh: CPMesh
    """This rank's CP mesh (a subgroup tiling of Megatron's CP group)."""
    ranks_per_node: int | None = None

    @classmethod
    def from_parallel_state(
        cls,
        *,
        tile: tuple[int, int] | str = "square",
        ranks_per_node: int | None = None,
        topology=None,
        shape: AttentionShape | None = None,
    ) -> MeshLayout:
        """Read the sizes from ``parallel_state`` (initialized beforehand) and build the mesh over its CP
        group (collective over every CP group at once); arguments as for :func:`build_mesh`."""
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("call megatron.core.parallel_state.initialize_model_parallel(...) first")
        mesh = build_mesh(
            parallel_state.get_context_parallel_group(),
            tile=tile,
            ranks_per_node=ranks_per_node,
            topology=topology,
            shape=shape,
        )
        return cls(
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            cp=parallel_state.get_context_parallel_world_size(),
            dp=parallel_state.get_data_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            rank=dist.get_rank(),
            mesh=mesh,
            ranks_per_node=ranks_per_node,
        )

    def layer_spec(self, **options) -> ModuleSpec:
        """:func:`get_gpt_layer_mesh_spec` with this layout's mesh."""
        return get_gpt_layer_mesh_spec(mesh=self.mesh, **options)

    @property
    def tiling(self) -> Tiling:
        return self.mesh.tiling

    def __str__(self) -> str:
        a, b = self.mesh.tile
        pp = f"-PP({self.pp})" if self.pp > 1 else ""
        q = [self.mesh.global_ranks[r] for r in self.mesh.tiling.q_group(self.mesh.rank)]
        kv = [self.mesh.global_ranks[r] for r in self.mesh.tiling.kv_group(self.mesh.rank)]
        node = f", {self.ranks_per_node} ranks per node" if self.ranks_per_node else ""
        return f"TP({self.tp})-CP({a}x{b})-DP({self.dp}){pp} rank {self.rank}: Q-group {q}, KV-group {kv}{node}"


def _default_spec(**options) -> ModuleSpec:
    return get_gpt_layer_mesh_spec(**options)


gpt_layer_mesh_spec = _default_spec()
"""For Megatron-LM ``--spec mesh_cp.integrations.megatron gpt_layer_mesh_spec``: the local GPT layer
(LayerNorm) with Mesh-Attention on the most square tile of the CP size."""
gpt_layer_mesh_spec_rmsnorm = _default_spec(normalization="RMSNorm")
"""As :data:`gpt_layer_mesh_spec` with RMSNorm (``--normalization RMSNorm``)."""

__all__ = [
    "MaskCheck",
    "MeshCoreAttention",
    "MeshLayout",
    "MeshProvider",
    "build_mesh",
    "cp_ranks_per_node",
    "get_gpt_layer_mesh_spec",
    "gpt_layer_mesh_spec",
    "gpt_layer_mesh_spec_rmsnorm",
    "node_local_tile",
]
