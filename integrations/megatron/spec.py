"""GPT layer specs with :class:`MeshCoreAttention` as ``core_attention``, and Megatron's TP x CP x DP layout
with its CP group tiled as a mesh."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from mesh_cp.core import AttentionShape, Tiling
from mesh_cp.core.options import refuse_keywords, refuse_renamed
from mesh_cp.integrations.megatron.attention import MeshCoreAttention, MeshProvider
from mesh_cp.integrations.megatron.mesh import build_mesh
from mesh_cp.runtime.mesh import CPMesh


def get_gpt_layer_mesh_spec(
    *,
    mesh: CPMesh | None = None,
    tile: tuple[int, int] | str = "square",
    head_parallel: int | None = None,
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
    ``head_parallel`` (the head-parallel degree; ``None``: what Megatron's ``cp_comm_type`` asks for, else 1, or
    with ``tile="auto"`` the cost model's choice), ``ranks_per_node``,
    ``topology`` and ``shape`` (see :class:`MeshProvider`), and all layers share it. The former keyword ``heads``
    (which arrives among ``local_spec_options``) is refused, naming ``head_parallel``.
    """
    refuse_renamed(local_spec_options, where="get_gpt_layer_mesh_spec")
    if base_spec is not None and local_spec_options:
        raise ValueError(f"pass base_spec or local spec options {sorted(local_spec_options)}, not both")
    spec = copy.deepcopy(base_spec) if base_spec is not None else get_gpt_layer_local_spec(**local_spec_options)
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is None:
        raise ValueError(
            "base_spec has no submodules.self_attention.submodules.core_attention slot; pass a transformer layer "
            "spec such as get_gpt_layer_local_spec()"
        )
    provider = MeshProvider(
        tile=tile,
        head_parallel=head_parallel,
        ranks_per_node=ranks_per_node,
        topology=topology,
        shape=shape,
        mesh=mesh,
    )
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
        head_parallel: int | None = None,
        ranks_per_node: int | None = None,
        topology=None,
        shape: AttentionShape | None = None,
        **refused,
    ) -> MeshLayout:
        """Read the sizes from ``parallel_state`` (initialized beforehand) and build the mesh over its CP
        group (collective over every CP group at once); arguments as for :func:`build_mesh` (``head_parallel >
        1``: the head-parallel x mesh hybrid on Megatron's own layout, Note [Head-parallel x mesh]). The former
        keyword ``heads`` is refused, naming ``head_parallel``."""
        refuse_keywords(refused, where="MeshLayout.from_parallel_state")
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("call megatron.core.parallel_state.initialize_model_parallel(...) first")
        mesh = build_mesh(
            parallel_state.get_context_parallel_group(),
            tile=tile,
            head_parallel=head_parallel,
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
        pp = f"-PP({self.pp})" if self.pp > 1 else ""
        node = f", {self.ranks_per_node} ranks per node" if self.ranks_per_node else ""
        layout = f"TP({self.tp})-CP({self.mesh.layout_name})-DP({self.dp}){pp}"
        return f"{layout} rank {self.rank}: {self.mesh.describe_groups()}{node}"


def _default_spec(**options) -> ModuleSpec:
    return get_gpt_layer_mesh_spec(**options)


gpt_layer_mesh_spec = _default_spec()
"""For Megatron-LM ``--spec mesh_cp.integrations.megatron gpt_layer_mesh_spec``: the local GPT layer
(LayerNorm) with Mesh-Attention on the most square tile of the CP size."""
gpt_layer_mesh_spec_rmsnorm = _default_spec(normalization="RMSNorm")
"""As :data:`gpt_layer_mesh_spec` with RMSNorm (``--normalization RMSNorm``)."""
