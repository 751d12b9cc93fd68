# ruff: noqa: E402  (the version check runs before the imports)
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

The head-parallel x mesh hybrid: ``MeshLayout.from_parallel_state(tile=(1, 2), head_parallel=2)`` (or
``head_parallel=`` of :func:`get_gpt_layer_mesh_spec`) exchanges heads in groups of ``head_parallel`` consecutive CP
ranks and tiles the ``CP / head_parallel`` ranks holding the same heads, on Megatron's own zig-zag layout
(``get_batch_on_this_cp_rank`` and its RoPE unchanged: Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`).
Megatron's own ``cp_comm_type="a2a+p2p"`` with ``hierarchical_context_parallel_sizes=[u, m]`` runs as
``head_parallel=u``, and ``"a2a"`` as ``head_parallel=CP``; ``"all_gather"`` is refused.

For Megatron-LM's ``pretrain_gpt.py``: ``--spec mesh_cp.integrations.megatron gpt_layer_mesh_spec``
(most square tile of the CP size, LayerNorm) or ``gpt_layer_mesh_spec_rmsnorm``; see docs/megatron.md.
"""

from mesh_cp.integrations.versions import require

require("megatron-core")  # first: an unsupported release is refused before a module here imports it

from mesh_cp.integrations.megatron.attention import (
    SUPPORTED_CP_COMM_TYPES,
    SUPPORTED_MASK_TYPES,
    MaskCheck,
    MeshCoreAttention,
    MeshProvider,
)
from mesh_cp.integrations.megatron.mesh import build_mesh, cp_ranks_per_node, node_local_tile
from mesh_cp.integrations.megatron.spec import (
    MeshLayout,
    get_gpt_layer_mesh_spec,
    gpt_layer_mesh_spec,
    gpt_layer_mesh_spec_rmsnorm,
)

__all__ = [
    "SUPPORTED_CP_COMM_TYPES",
    "SUPPORTED_MASK_TYPES",
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
