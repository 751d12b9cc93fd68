"""Mesh-Attention as Megatron-core's ``core_attention``: the layer, the mesh provider its layer spec gives
it, and the check of the ``attention_mask`` it is handed."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

import mesh_cp
from mesh_cp.core import AttentionShape
from mesh_cp.core.head_parallel import HeadCounts, check_head_parallel
from mesh_cp.core.layout import local_positions
from mesh_cp.core.masks import AttentionMask
from mesh_cp.integrations.megatron.heads import CP_COMM_TYPES, comm_type_head_parallel
from mesh_cp.integrations.megatron.mesh import build_mesh
from mesh_cp.integrations.megatron.packed import PackedDocuments
from mesh_cp.runtime.device_checks import check_on_device
from mesh_cp.runtime.mesh import CPMesh

SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)
"""Mask types the mesh computes itself: causal over global positions, or none (full attention)."""
SUPPORTED_CP_COMM_TYPES = tuple(CP_COMM_TYPES)
"""``cp_comm_type`` values accepted (Megatron-LM's default is ``"p2p"``): ``None`` and ``"p2p"`` run the spec's mesh,
``"a2a"`` and ``"a2a+p2p"`` the head-parallel x mesh hybrid they are (:data:`~mesh_cp.integrations.megatron.heads.
CP_COMM_TYPES`)."""


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


class MaskCheck:
    """Checks that Megatron's ``attention_mask`` is the causal mask of the zig-zag chunks, without a host
    synchronisation per layer or per step.

    The first mask of each (shape, device, dtype) is compared on the host (a clear error, one
    synchronisation). A later mask of that kind, a new tensor every step from the data loader, is compared
    where it is with ``torch._assert_async`` (on a GPU a wrong mask stops the run with a device-side
    assertion at the next synchronisation; on the CPU the same ``NotImplementedError`` at once), :attr:`ROWS` rows
    at a time against this rank's cached positions, never a second mask-sized tensor. The layers of a model share
    one check, and a mask already checked (the same tensor, not modified since) is not compared again, so a step
    costs at most one comparison and no synchronisation.
    """

    MESSAGE = (
        "attention_mask is not the causal mask of the zig-zag chunks: padding and arbitrary masks are not "
        "supported by mesh_cp; pass no mask (Megatron-LM --no-create-attention-mask-in-dataloader)"
    )

    def __init__(self) -> None:
        self._kinds: set[tuple] = set()
        self._rows: dict[tuple, Tensor] = {}
        self._last: tuple[weakref.ref, int] | None = None

    ROWS = 1024
    """Mask rows compared at once: the comparison holds ``ROWS x seq`` booleans, not the whole mask again."""

    def _matches(self, mask: Tensor, mesh: CPMesh, seq: int) -> Tensor:
        """A 0-dim boolean on the mask's device: ``mask`` is the causal mask of this rank's zig-zag rows (Megatron's
        zig-zag over all P CP ranks, also under head-parallel ranks: Note [Head-parallel x mesh]). The expected
        mask is never built: row ``i`` must hide exactly the keys after its global position ``rows[i]``, compared
        ``ROWS`` rows at a time."""
        key = (seq, mesh.size, mesh.rank, mask.device)
        if key not in self._rows:
            positions = local_positions(seq, mesh.size, mesh.rank, "zigzag")
            self._rows[key] = torch.tensor(positions, device=mask.device)
        rows, keys = self._rows[key], torch.arange(seq, device=mask.device)
        same = torch.ones((), dtype=torch.bool, device=mask.device)
        for start in range(0, rows.numel(), self.ROWS):
            part = rows[start : start + self.ROWS]
            same &= (mask[..., start : start + self.ROWS, :] == (part[:, None] < keys[None, :])).all()
        return same

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
        same = self._matches(mask, mesh, seq)
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
    head_parallel: int | None = None
    """``u``, the head-parallel degree of the head-parallel x mesh hybrid (``tile`` then tiles ``CP / u`` ranks;
    Note [Head-parallel x mesh]); ``None``: what the layers' ``cp_comm_type`` asks for (``"a2a+p2p"``:
    ``hierarchical_context_parallel_sizes[0]``, ``"a2a"``: the CP size), else 1 (``tile="auto"``: the cost
    model's choice)."""
    mesh: CPMesh | None = None
    """A mesh built beforehand (for example by :class:`MeshLayout`); then the fields above are unused."""
    _meshes: dict = field(default_factory=dict, repr=False)
    mask_check: MaskCheck = field(default_factory=lambda: MaskCheck(), repr=False)
    documents: PackedDocuments = field(default_factory=lambda: PackedDocuments(), repr=False)
    """Reads the documents of ``packed_seq_params`` (shared by the layers: once per step, not per layer)."""
    """Checks the ``attention_mask`` the layers get (shared by them: a mask is checked once, not per layer)."""

    def mesh_for(self, cp_group: dist.ProcessGroup, *, comm_head_parallel: int | None = None, comm: str = "") -> CPMesh:
        """The mesh over ``cp_group`` (created on first use, collective over the group). ``comm_head_parallel``:
        the head-parallel degree the layer's ``cp_comm_type`` asks for (``comm`` names it), which
        :attr:`head_parallel` and a pinned :attr:`mesh` must agree with."""
        ranks = tuple(dist.get_process_group_ranks(cp_group))
        u = comm_head_parallel
        if u is not None and self.head_parallel is not None and self.head_parallel != u:
            raise ValueError(
                f"{comm} asks for head_parallel={u} but the layer spec's MeshProvider has head_parallel="
                f"{self.head_parallel}; give the same (head_parallel= of get_gpt_layer_mesh_spec / "
                f"MeshLayout.from_parallel_state) or leave one out"
            )
        u = u if u is not None else self.head_parallel
        if self.mesh is not None:
            if self.mesh.global_ranks != ranks:
                raise ValueError(
                    f"the mesh tiles global ranks {list(self.mesh.global_ranks)} but this layer's CP group is "
                    f"{list(ranks)}; build the mesh over the model's CP group (MeshLayout.from_parallel_state)"
                )
            if u is not None and self.mesh.head_parallel != u:
                raise ValueError(
                    f"{comm or 'the MeshProvider'} asks for head_parallel={u} but the mesh it was given has "
                    f"head_parallel={self.mesh.head_parallel}; build it with head_parallel={u} "
                    f"(MeshLayout.from_parallel_state(head_parallel={u}))"
                )
            return self.mesh
        # Keyed by the group object (kept alive by the key): a re-initialized parallel_state makes new
        # groups over the same ranks, which need a new mesh.
        key = (cp_group, u)
        if key not in self._meshes:
            self._meshes[key] = build_mesh(
                cp_group,
                tile=self.tile,
                head_parallel=u,
                ranks_per_node=self.ranks_per_node,
                topology=self.topology,
                shape=self.shape,
            )
        return self._meshes[key]


class MeshCoreAttention(MegatronModule):
    """Megatron core attention over the CP group's ``a x b`` mesh (exact, forward and backward).

    Constructed by Megatron's attention with ``config, layer_number, attn_mask_type, attention_type,
    cp_comm_type, softmax_scale, pg_collection``; ``mesh_provider`` comes from the spec's params. The
    CP group is ``pg_collection.cp`` when given, else ``parallel_state``'s. Inputs are this CP rank's
    zig-zag chunks ``r`` and ``2CP-1-r`` (``get_batch_on_this_cp_rank``), or with ``packed_seq_params`` in
    ``qkv_format="thd"`` its parts of every padded document (``get_thd_batch_on_this_cp_rank``), RoPE already applied.
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
        _refuse_unsupported(config, attention_dropout, attn_mask_type)
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
        u, comm = comm_type_head_parallel(cp_comm_type, config)
        self.mesh = mesh_provider.mesh_for(cp_group, comm_head_parallel=u, comm=comm)
        self._from_parallel_state = getattr(pg_collection, "cp", None) is None
        self._state_checked = False
        if self.mesh.head_parallel > 1:  # this rank's heads (after TP) must split over the head-parallel ranks
            tp = config.tensor_model_parallel_size
            counts = HeadCounts(config.num_attention_heads // tp, max(1, config.num_query_groups // tp))
            check_head_parallel(self.mesh.size, self.mesh.head_parallel, counts)
        self.mask_check = mesh_provider.mask_check
        self.head_dim = config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside its softmax (an fp16 range trick); the product is the plain scale.
        self.softmax_scale = self.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.window = _layer_window(config, self.layer_number, attn_mask_type)
        self.documents = mesh_provider.documents

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
        -> ``[sq, b, heads * d]``: attention over the whole sequence of the CP group (THD: :meth:`_forward_thd`)."""
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
        if not self._state_checked:
            self._check_parallel_state()
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, attention_mask, causal, packed_seq_params)
        if attention_mask is not None:
            self._check_mask(attention_mask, causal, query.shape[0], query.shape[1])
        mask = self.documents(packed_seq_params, query.shape[0] * self.mesh.size, query.shape[1], self.mesh)
        if self.window is not None:
            mask = AttentionMask(documents=None if mask is None else mask.documents, window=self.window)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        options = {"causal": causal, "softmax_scale": self.softmax_scale, "mask": mask}
        # Megatron's zig-zag over the CP group is mesh_cp's, with or without head-parallel ranks.
        out = mesh_cp.mesh_attn_func(q, k, v, mesh=self.mesh, layout="zigzag", **options)
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, causal: bool, params) -> Tensor:
        """``query [t, heads, d]``, ``key/value [t, kv_heads, d]`` in TransformerEngine's THD layout (this CP rank's
        parts ``r`` and ``2CP-1-r`` of every padded document, Note [THD layout] in :mod:`mesh_cp.core.split`) ->
        ``[t, heads * d]``: reordered into the split layout, attended over the mesh, and back."""
        if attention_mask is not None:
            raise NotImplementedError(
                f"an attention_mask of shape {tuple(attention_mask.shape)} with qkv_format='thd': the documents of "
                "packed_seq_params are the mask; pass attention_mask=None"
            )
        if self.window is not None:
            raise NotImplementedError(
                f"a window of {self.window} tokens with qkv_format='thd': mesh_cp takes windows over packed rows "
                "laid out as one sequence (qkv_format='sbhd'), not over split documents"
            )
        mask, order, back = self.documents.thd(params, self.mesh, query.device, causal)
        rows = query.shape[0]
        if order.numel() != rows:
            raise ValueError(
                f"qkv_format='thd' query of {rows} tokens on this CP rank, but cu_seqlens_q_padded gives "
                f"{order.numel()} (its last entry over the CP size {self.mesh.size})"
            )
        q, k, v = (t.index_select(0, order)[None] for t in (query, key, value))
        options = {"causal": causal, "softmax_scale": self.softmax_scale, "mask": mask}
        out = mesh_cp.mesh_attn_func(q, k, v, mesh=self.mesh, layout="zigzag", **options)
        return out[0].index_select(0, back).reshape(rows, -1)

    def _check_parallel_state(self) -> None:
        """At the first step: a layer built on Megatron's ``parallel_state`` still sees, in it, the CP group its mesh
        tiles (the batch is cut over that group: ``get_batch_on_this_cp_rank``). ``parallel_state`` destroyed or
        initialized again in another layout since the model was built is refused (``ValueError``), as the shards
        would no longer be the mesh's. No collective, no host read of a tensor."""
        if self._from_parallel_state:
            if not parallel_state.model_parallel_is_initialized():
                raise ValueError(
                    f"Megatron's parallel_state is not initialized, but this layer's mesh was built over its CP group "
                    f"{list(self.mesh.global_ranks)}; keep parallel_state initialized while the model runs"
                )
            ranks = tuple(dist.get_process_group_ranks(parallel_state.get_context_parallel_group()))
            if ranks != self.mesh.global_ranks:
                raise ValueError(
                    f"Megatron's parallel_state CP group of rank {dist.get_rank()} is {list(ranks)} (world "
                    f"{dist.get_world_size()}), but this layer's mesh tiles {list(self.mesh.global_ranks)}: "
                    f"parallel_state was initialized again in another layout after the model was built; build the "
                    f"model (and MeshLayout.from_parallel_state) after initialize_model_parallel"
                )
        self._state_checked = True

    def _check_mask(self, mask: Tensor, causal: bool, seq_local: int, batch: int) -> None:
        """Accept only the mask the mesh applies anyway: Megatron's causal mask (``True`` = masked) for
        this rank's zig-zag queries over the global keys, as ``get_batch_on_this_cp_rank`` shards it
        (:class:`MaskCheck`: no host synchronisation per layer or step)."""
        self.mask_check(mask, self.mesh, causal, seq_local, batch)


def _layer_window(config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType) -> int | None:
    """This layer's left window in tokens (query ``i`` sees keys ``i - left .. i``: ``left + 1``), from
    ``config.window_size = (left, right)`` and ``window_attn_skip_freq`` as Megatron's own attention reads them;
    ``None`` for full attention."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, _right = config.window_size  # under causal attention no key right of the query is seen anyway
    if attn_mask_type != AttnMaskType.causal:
        raise NotImplementedError(
            f"window_size {config.window_size} with attn_mask_type {attn_mask_type.name}: mesh_cp computes left "
            f"windows under causal attention only"
        )
    return None if left < 0 else left + 1


def _refuse_unsupported(
    config: TransformerConfig, attention_dropout: float | None, attn_mask_type: AttnMaskType
) -> None:
    """Refuse, by name and with the setting to change, what :class:`MeshCoreAttention` cannot compute
    exactly: dropout, a softmax other than vanilla, a mask other than causal or none (``cp_comm_type`` is
    :func:`~mesh_cp.integrations.megatron.heads.comm_type_head_parallel`'s)."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise NotImplementedError(
            f"attention dropout {dropout} is not supported by mesh_cp; set attention_dropout=0.0 "
            f"(Megatron-LM: --attention-dropout 0.0)"
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
