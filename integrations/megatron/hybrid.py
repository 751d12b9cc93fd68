"""Megatron-core hybrid stacks (Mamba + attention, ``MambaModel``) with Mesh-Attention in their attention layers.

::

    from megatron.core.models.mamba import MambaModel
    from mesh_cp.integrations.megatron.hybrid import get_mamba_stack_mesh_spec

    spec = get_mamba_stack_mesh_spec(mesh=layout.mesh)      # megatron's mamba_stack_spec, core_attention swapped
    model = MambaModel(config=config, mamba_stack_spec=spec, hybrid_override_pattern="M*M*", ...)

For Megatron-LM's ``pretrain_mamba.py``, whose ``--spec MODULE NAME`` reads a module attribute, a module of one line
(``mamba_stack_mesh_spec = get_mamba_stack_mesh_spec()``, the most square tile of the CP size) and ``--spec MODULE
mamba_stack_mesh_spec``: this module builds no spec when imported, since megatron-core's Mamba specs import Triton.

Note [Mamba CP beside the mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``MambaStack`` runs its Mamba layers under context parallelism with megatron-core's own ``MambaContextParallel``
(``megatron/core/ssm/mamba_context_parallel.py``), over the same CP group (``pg_collection.cp``) the attention layers'
mesh tiles: after the input projection an all-to-all over the CP group gives every rank the whole sequence for
``1 / CP`` of the heads, the concatenation of the ``CP`` ranks' shards in CP-rank order, and
``_undo_attention_load_balancing`` puts it in sequence order, assuming Megatron's zig-zag: ``2 * CP`` chunks, rank
``r`` holding chunks ``r`` and ``2CP-1-r``. ``_redo_attention_load_balancing`` and the inverse all-to-all give every
rank its shard back before the output projection. That is the layout mesh_cp's Megatron integration shards a batch
into (``training.shard_batch``, through Megatron's ``get_batch_on_this_cp_rank``; ``mesh_cp.core.layout.
chunk_ranges(..., "zigzag")``), and the layout :class:`~mesh_cp.integrations.megatron.attention.MeshCoreAttention`
computes on, with or without head-parallel ranks (``CPMesh.local_ranges`` is the zig-zag over all ``P`` CP ranks
whatever ``head_parallel``; Note [Head-parallel x mesh] in :mod:`mesh_cp.runtime.heads`). The two layers' CP thus
compose with no reordering between them.

Packed rows: with any ``packed_seq_params`` (whatever its ``qkv_format``) megatron-core's Mamba reorders by
TransformerEngine's THD partition of ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``): every document padded to a
multiple of ``2 * CP`` and cut on its own. That is what ``compat.thd_batch_on_this_cp_rank`` shards (``qkv_format=
"thd"``), not mesh_cp's packed row sharded zig-zag as one sequence (``qkv_format="sbhd"``), whose tokens the Mamba
layers would take in the wrong order. :class:`HybridMeshCoreAttention` refuses the latter under CP.

megatron-core 0.16's ``GatedDeltaNet`` has no context parallelism (``TransformerConfig`` asserts
``context_parallel_size == 1`` for ``experimental_attention_variant="gated_delta_net"``, whose layers live in GPT
layer specs, not in a ``MambaStack``): a spec holding one is refused.
"""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from mesh_cp.core import AttentionShape
from mesh_cp.integrations.megatron.attention import MeshCoreAttention, MeshProvider
from mesh_cp.runtime.mesh import CPMesh

__all__ = ["HybridMeshCoreAttention", "check_packed_for_mamba", "get_mamba_stack_mesh_spec"]

_MAMBA_MIXER = ("megatron.core.ssm.mamba_mixer", "MambaMixer")
_REFUSED_MIXERS = ("GatedDeltaNet",)


class HybridMeshCoreAttention(MeshCoreAttention):
    """:class:`MeshCoreAttention` for the attention layers of a Mamba hybrid stack: the same attention, and under CP
    a packed row must come as THD (``qkv_format="thd"``), the partition megatron-core's Mamba layers undo (Note
    [Mamba CP beside the mesh])."""

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
        """As :meth:`MeshCoreAttention.forward`; ``packed_seq_params`` other than THD under CP is refused
        (``NotImplementedError``) by :func:`check_packed_for_mamba`."""
        check_packed_for_mamba(packed_seq_params, self.mesh.size)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)


def check_packed_for_mamba(packed_seq_params, cp_size: int) -> None:
    """Refuse (``NotImplementedError``, naming the fix) ``packed_seq_params`` whose ``qkv_format`` is not ``"thd"``
    when ``cp_size > 1``: megatron-core's Mamba layers reorder any packed row by the THD partition."""
    if packed_seq_params is None or cp_size == 1 or packed_seq_params.qkv_format == "thd":
        return
    raise NotImplementedError(
        f"packed_seq_params with qkv_format={packed_seq_params.qkv_format!r} under CP {cp_size} in a Mamba hybrid: "
        "megatron-core's MambaMixer reorders every packed row by TransformerEngine's THD partition "
        "(_undo_attention_load_balancing), not as one zig-zag sequence; shard packed rows with "
        "compat.thd_batch_on_this_cp_rank(...) and pass its PackedSeqParams (qkv_format='thd')"
    )


def get_mamba_stack_mesh_spec(
    *,
    mesh: CPMesh | None = None,
    tile: tuple[int, int] | str = "square",
    head_parallel: int | None = None,
    ranks_per_node: int | None = None,
    topology=None,
    shape: AttentionShape | None = None,
    base_spec: ModuleSpec | None = None,
) -> ModuleSpec:
    """A copy of megatron-core's ``mamba_stack_spec`` (or ``base_spec``) whose attention layer's ``core_attention``
    is :class:`HybridMeshCoreAttention` with a :class:`MeshProvider`; everything else, the Mamba layers included
    (their CP is megatron-core's ``MambaContextParallel`` over the same CP group), is unchanged.

    ``mesh``, ``tile``, ``head_parallel``, ``ranks_per_node``, ``topology`` and ``shape`` are those of
    :func:`~mesh_cp.integrations.megatron.spec.get_gpt_layer_mesh_spec`. The copy copies the spec tree (module
    specs, their submodules and containers) and shares its classes and functions, so the base spec is not modified.
    A base spec without ``submodules.attention_layer.submodules.self_attention.submodules.core_attention``, without
    a ``submodules.mamba_layer`` whose mixer is megatron-core's ``MambaMixer``, or holding a ``GatedDeltaNet``, is
    refused (``ValueError``) by name.
    """
    spec = _copy_spec(base_spec if base_spec is not None else _megatron_mamba_stack_spec())
    _check_stack(spec)
    provider = MeshProvider(
        tile=tile,
        head_parallel=head_parallel,
        ranks_per_node=ranks_per_node,
        topology=topology,
        shape=shape,
        mesh=mesh,
    )
    attention = spec.submodules.attention_layer.submodules.self_attention
    attention.submodules.core_attention = ModuleSpec(module=HybridMeshCoreAttention, params={"mesh_provider": provider})
    return spec


def _megatron_mamba_stack_spec() -> ModuleSpec:
    """megatron-core's ``mamba_stack_spec`` (imported here: its ``MambaMixer`` module imports Triton)."""
    try:
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    except ImportError as error:
        raise ImportError(
            f"megatron-core's mamba_stack_spec could not be imported ({error}); megatron.core.ssm.mamba_mixer needs "
            "triton (and, to run, mamba_ssm and CUDA); install them, or pass base_spec="
        ) from error
    return mamba_stack_spec


def _copy_spec(value):
    """``value`` with its module specs, dataclasses (a copy of which is another object) and containers copied, and
    every other object (classes, functions, enums) shared."""
    if isinstance(value, dict):
        return {key: _copy_spec(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_copy_spec(item) for item in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        if copied is value:  # a handle (CPMesh): shared on purpose
            return value
        for field in dataclasses.fields(value):
            object.__setattr__(copied, field.name, _copy_spec(getattr(value, field.name)))
        return copied
    return value


def _module_names(module) -> list[tuple[str, str]]:
    """``(module path, class name)`` of a spec's ``module`` and its base classes (a ``(path, name)`` tuple as is)."""
    if isinstance(module, tuple) and len(module) == 2 and all(isinstance(part, str) for part in module):
        return [module]
    return [(getattr(c, "__module__", ""), getattr(c, "__qualname__", "")) for c in getattr(module, "__mro__", ())]


def _walk(value, path: str):
    """Every :class:`ModuleSpec` in ``value`` with its path (``submodules.mamba_layer.submodules.mixer``)."""
    if isinstance(value, ModuleSpec):
        yield path, value
        yield from _walk(value.submodules, f"{path}.submodules" if path else "submodules")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name), f"{path}.{field.name}")


def _check_stack(spec) -> None:
    """Refuse (``ValueError``) a spec that is not a Mamba hybrid stack this module composes with the mesh."""
    fix = "pass megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec or a spec of its form"
    submodules = getattr(spec, "submodules", None)
    attention_layer = getattr(submodules, "attention_layer", None)
    attention = getattr(getattr(attention_layer, "submodules", None), "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is None:
        gpt = " (a GPT layer spec: use get_gpt_layer_mesh_spec)" if hasattr(submodules, "self_attention") else ""
        raise ValueError(
            f"base_spec has no submodules.attention_layer.submodules.self_attention.submodules.core_attention slot"
            f"{gpt}; {fix}"
        )
    mamba_layer = getattr(submodules, "mamba_layer", None)
    mixer = getattr(getattr(mamba_layer, "submodules", None), "mixer", None)
    if not isinstance(mixer, ModuleSpec) or _MAMBA_MIXER not in _module_names(mixer.module):
        found = getattr(mixer, "module", mixer if mixer is not None else mamba_layer)
        raise ValueError(
            f"base_spec's submodules.mamba_layer.submodules.mixer is {found!r}, not a ModuleSpec of megatron-core's "
            f"MambaMixer, whose CP (MambaContextParallel) is the one composed with the mesh; {fix}"
        )
    for path, node in _walk(spec, ""):
        names = {name for _, name in _module_names(node.module)}
        refused = names & set(_REFUSED_MIXERS)
        if refused:
            raise ValueError(
                f"base_spec holds {sorted(refused)[0]} at {path or 'the root'}: megatron-core 0.16's GatedDeltaNet has "
                "no context parallelism (TransformerConfig asserts context_parallel_size == 1 for it), and this spec "
                "composes only MambaMixer's with the mesh; use Mamba layers, or CP 1"
            )
