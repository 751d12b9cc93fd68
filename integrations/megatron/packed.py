"""The documents of Megatron's ``packed_seq_params``: packed rows laid out as one sequence (``sbhd``) or
TransformerEngine's THD layout (Note [THD layout] in :mod:`mesh_cp.core.split`)."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.split import thd_layout
from mesh_cp.runtime.mesh import CPMesh


class PackedDocuments:
    """The documents of a packed row from ``packed_seq_params`` (read once per tensor, shared by the layers).

    mesh_cp shards a packed row as one sequence: the row ``[s, 1]`` (``qkv_format="sbhd"``) is cut into
    zig-zag chunks by ``get_batch_on_this_cp_rank`` like any other, whatever the document lengths, and
    ``cu_seqlens_q`` (equal to ``cu_seqlens_kv``) gives the documents' global boundaries; tokens past the last
    boundary are padding. ``max_seqlen_q = max_seqlen_kv`` is the row's length (Megatron sizes RoPE from it; RoPE
    at global positions is exact within a document, since it depends on the distance between tokens only).
    ``qkv_format="thd"`` is TransformerEngine's layout (every document padded to a multiple of ``2 * CP`` and cut on
    its own, ``get_thd_batch_on_this_cp_rank``), taken as split documents (Note [THD layout] in
    :mod:`mesh_cp.core.split`; :meth:`thd`).
    """

    def __init__(self) -> None:
        self._last: tuple[tuple, tuple, AttentionMask] | None = None
        self._last_thd: tuple[tuple, tuple, tuple] | None = None

    def thd(self, params, mesh: CPMesh, device: torch.device, causal: bool) -> tuple[AttentionMask, Tensor, Tensor]:
        """A THD row's split-layout mask, and this rank's ``order`` (THD rows in the split layout's order) and
        ``back`` (its inverse) on ``device`` (Note [THD layout] in :mod:`mesh_cp.core.split`); read once per
        ``packed_seq_params`` (the same tensors and values)."""
        return self._read("_last_thd", params, mesh, (mesh, device, causal), _thd_layout)

    def __call__(self, params, seq: int, batch: int, mesh: CPMesh) -> AttentionMask | None:
        if params is None:
            return None
        return self._read("_last", params, mesh, (seq, batch), lambda p, *_: _packed_mask(p, seq, batch))

    def _read(self, slot: str, params, mesh: CPMesh, extra: tuple, read):
        """``read(params, *extra)``, or what it gave for the same ``params`` and ``extra`` last time (kept in
        ``slot``)."""
        _check_cp_fields(params, mesh)
        refs, key = _params_key(params, extra)
        last = getattr(self, slot)
        if last is not None and _same(last, refs, key):
            return last[2]
        found = read(params, *extra)
        setattr(self, slot, (refs, key, found))
        return found


_BOUNDARIES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def _params_key(params, extra: tuple) -> tuple[tuple, tuple]:
    """What a cached reading of ``params`` depends on: its boundary tensors (held weakly, with their versions) and
    every other field it reads, with ``extra``."""
    tensors = [getattr(params, name) for name in _BOUNDARIES]
    refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    versions = tuple(None if t is None else t._version for t in tensors)
    return refs, (versions, params.qkv_format, params.max_seqlen_q, params.max_seqlen_kv, *extra)


def _boundary_values(params) -> dict[str, list[int] | None]:
    """The boundary tensors of ``params`` read on the host (once per step: :class:`PackedDocuments` keeps it)."""
    return {n: None if (t := getattr(params, n)) is None else [int(x) for x in t.tolist()] for n in _BOUNDARIES}


def _same(last: tuple, refs: tuple, key: tuple) -> bool:
    """``last`` was read from the same tensors (alive, not modified since) and the same other fields."""
    held = all((a is None) == (b is None) and (a is None or a() is b()) for a, b in zip(last[0], refs, strict=True))
    return held and last[1] == key


def _check_cp_fields(params, mesh: CPMesh) -> None:
    """Megatron's hybrid (dynamic) CP names another CP group per sample in ``local_cp_size`` / ``cp_group``:
    taken only when they name the mesh's own group."""
    local, group = getattr(params, "local_cp_size", None), getattr(params, "cp_group", None)
    if local is None and group is None:
        return
    ranks = None if group is None else dist.get_process_group_ranks(group)
    if local != mesh.size or ranks != dist.get_process_group_ranks(mesh.group):
        raise NotImplementedError(
            f"packed_seq_params local_cp_size={local}, cp_group ranks {ranks}: mesh_cp shards every sample over its "
            f"mesh of {mesh.size} ranks {dist.get_process_group_ranks(mesh.group)} (no hybrid context parallelism); "
            "leave local_cp_size and cp_group unset"
        )


def _thd_layout(params, mesh: CPMesh, device: torch.device, causal: bool) -> tuple[AttentionMask, Tensor, Tensor]:
    """:meth:`PackedDocuments.thd` uncached: one host read of the boundaries."""
    values = _boundary_values(params)
    real, padded = values["cu_seqlens_q"], values["cu_seqlens_q_padded"] or values["cu_seqlens_q"]
    if real is None:
        raise NotImplementedError("packed_seq_params with qkv_format='thd' needs cu_seqlens_q (and _padded)")
    if values["cu_seqlens_kv"] != real or (values["cu_seqlens_kv_padded"] or real) != padded:
        raise NotImplementedError(
            f"packed_seq_params {values}: mesh_cp needs cu_seqlens_kv equal to cu_seqlens_q (self-attention), and "
            "cu_seqlens_kv_padded equal to cu_seqlens_q_padded"
        )
    sizes = [(b - a, d - c) for a, b, c, d in zip(real, real[1:], padded, padded[1:], strict=False)]
    if len(real) != len(padded) or any(not 0 < n <= width for n, width in sizes):
        raise ValueError(
            f"cu_seqlens_q {real} does not fit cu_seqlens_q_padded {padded}: one entry per document in each, every "
            "document at least one token and at most its padded length"
        )
    if not causal and real != padded:
        raise NotImplementedError(
            f"qkv_format='thd' without a causal mask over padded documents ({real} padded to {padded}): a query "
            "would see its document's padding; pad no document, or use attn_mask_type causal"
        )
    longest = max(n for n, _ in sizes)
    lengths = (params.max_seqlen_q, params.max_seqlen_kv)
    if any(n is not None and n < longest for n in lengths):
        raise ValueError(
            f"max_seqlen_q/kv {lengths} with qkv_format='thd' must be at least the longest document, {longest} "
            f"tokens (cu_seqlens_q {real}): Megatron sizes RoPE from them"
        )
    mask, order = thd_layout(padded, world=mesh.size, rank=mesh.rank)
    order = torch.tensor(order, device=device)
    return mask, order, torch.argsort(order)


def _packed_mask(params, seq: int, batch: int) -> AttentionMask:
    """The :class:`~mesh_cp.core.AttentionMask` of ``packed_seq_params`` of a ``[seq, batch=1]`` row."""
    if batch != 1 or params.qkv_format not in (None, "sbhd"):
        raise NotImplementedError(
            f"packed_seq_params (qkv_format {params.qkv_format!r}) for a batch of {batch}: mesh_cp takes one packed "
            f"row ([s, 1], qkv_format='sbhd')"
        )
    values = _boundary_values(params)
    bounds = values["cu_seqlens_q"]
    if bounds is None or any(v is not None and v != bounds for v in values.values()):
        raise NotImplementedError(
            f"packed_seq_params {values}: mesh_cp needs cu_seqlens_q, with cu_seqlens_kv (and any *_padded) equal to it"
        )
    if bounds[0] != 0 or bounds[-1] > seq or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seqlens_q {bounds} must rise from 0 to at most the row's {seq} tokens")
    lengths = (params.max_seqlen_q, params.max_seqlen_kv)
    if any(n is not None and n != seq for n in lengths):
        raise ValueError(
            f"max_seqlen_q/kv {lengths}: with qkv_format='sbhd' Megatron sizes RoPE from them, so they must be the "
            f"packed row's length {seq} (the row is one sequence of global positions), not the longest document"
        )
    return AttentionMask(documents=(tuple(zip(bounds, bounds[1:], strict=False)),))
