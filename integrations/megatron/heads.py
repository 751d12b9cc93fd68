"""Megatron's ``cp_comm_type`` mapped to mesh_cp's head-parallel x mesh hybrid.

Note [Hybrid on Megatron's layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron gives CP rank ``r`` of ``P`` the zig-zag half-chunks ``r`` and ``2P-1-r`` of ``2P``
(``get_batch_on_this_cp_rank``), and so does mesh_cp with or without head-parallel ranks (Note [Head-parallel x
mesh] in :mod:`mesh_cp.runtime.heads`), so Megatron's sharding, RoPE and causal mask stay as they are. The hybrid
places its levels as TransformerEngine's ``a2a+p2p`` does with ``hierarchical_context_parallel_sizes = [u, m]``
(level 0: ``u`` consecutive CP ranks, all-to-all; level 1: the ``m`` ranks ``i, u + i, ...``, here a mesh instead
of a ring), and Megatron's ``"a2a"`` (Ulysses) is the hybrid with ``u = P``: both are taken as the hybrid with
that ``u`` (``head_parallel = u``).
"""

from __future__ import annotations

CP_COMM_TYPES: dict[object, str] = {
    None: "the mesh as the spec builds it (head_parallel= of the spec / MeshLayout)",
    "p2p": "Megatron-LM's default: the mesh as the spec builds it (head_parallel= of the spec / MeshLayout)",
    "a2a": "Ulysses: the hybrid with head_parallel = CP size (tile 1x1)",
    "a2a+p2p": "the hybrid with head_parallel = hierarchical_context_parallel_sizes[0] and the tile over the rest",
}
"""``cp_comm_type`` values :class:`MeshCoreAttention` takes, and what each runs (module docstring)."""


def comm_type_head_parallel(cp_comm_type: str | None, config) -> tuple[int | None, str]:
    """The head-parallel degree Megatron's ``cp_comm_type`` (with ``hierarchical_context_parallel_sizes``) asks
    for (``None`` when it leaves it to the spec), and the setting named. Refuses, by name and with the fix, what
    has no exact mapping."""
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    cp = config.context_parallel_size
    named = f"cp_comm_type {cp_comm_type!r}" + (f" with hierarchical_context_parallel_sizes {sizes}" if sizes else "")
    if cp_comm_type not in CP_COMM_TYPES:
        raise NotImplementedError(
            f"cp_comm_type {cp_comm_type!r} selects TransformerEngine's CP communication, which mesh_cp does not "
            f"run; it takes {sorted(map(str, CP_COMM_TYPES))}: leave cp_comm_type at 'p2p' and choose the mesh "
            f"tile (and head_parallel=) of the spec"
        )
    if cp_comm_type == "a2a+p2p":
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != cp:
            raise NotImplementedError(
                f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a, p2p] with a2a * p2p = CP "
                f"size {cp}, got {sizes}; mesh_cp runs it as head_parallel = a2a over a tile of the p2p ranks"
            )
        return sizes[0], named
    if sizes:
        raise NotImplementedError(
            f"hierarchical_context_parallel_sizes {sizes} is read by cp_comm_type 'a2a+p2p' only (got "
            f"{cp_comm_type!r}); leave it unset, or set cp_comm_type='a2a+p2p' for the head-parallel x mesh hybrid"
        )
    return (cp if cp_comm_type == "a2a" and cp > 1 else None), named
