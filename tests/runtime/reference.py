"""One distributed attention call against the single-process fp64 reference, shared by the runtime tests."""

from __future__ import annotations

import torch

import mesh_cp
from mesh_cp.core.numerics import reference_attention


def _objective(out: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """A loss on the output and on the lse (rows that attend nothing, ``lse = -inf``, left out); on the output only
    when ``dlse`` is ``None``."""
    if dlse is None:
        return (out * do).sum()
    return (out * do).sum() + (torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) * dlse).sum()


def errors_against_reference(
    mesh,
    shape: tuple[int, int, int, int, int],
    *,
    seed: int,
    layout: str,
    lse_loss: bool = True,
    dtype: torch.dtype = torch.float32,
    **options,
) -> dict[str, float]:
    """Max abs errors of ``mesh_attn_func`` on this rank's shards of random ``q, k, v`` of ``shape = (batch, seq,
    heads, kv_heads, head_dim)`` (fp32) against :func:`reference_attention` in fp64: ``out``, ``lse`` (``inf`` when
    the rows that attend nothing differ) and ``dq, dk, dv`` of a loss on out and lse (on out only, the lse returned
    but unread, when not ``lse_loss``). ``options``: ``causal``,
    ``mask`` and ``softcap`` (both sides), ``schedule`` and ``kernel`` (the mesh's call); the mesh's inputs are in
    ``dtype``."""
    batch, seq, heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=gen) for _ in range(2))
    do, dlse = torch.randn(batch, seq, heads, dim, generator=gen), torch.randn(batch, heads, seq, generator=gen)
    both = {name: options.pop(name) for name in ("causal", "mask", "softcap") if name in options}

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref, **both)
    _objective(ref_out, ref_lse, do.double(), dlse.double() if lse_loss else None).backward()

    def shard(t, dim=1):
        return mesh_cp.shard_sequence(t, mesh=mesh, dim=dim, layout=layout)

    local = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = mesh_cp.mesh_attn_func(*local, mesh=mesh, layout=layout, return_lse=True, **both, **options)
    _objective(out, lse, shard(do).to(dtype), shard(dlse, dim=2) if lse_loss else None).backward()
    want_lse = shard(ref_lse.detach(), dim=2)
    finite = ~torch.isinf(want_lse)
    same_empty = torch.equal(torch.isinf(lse), ~finite)
    errors = {
        "out": (out.double() - shard(ref_out.detach())).abs().max().item(),
        "lse": (lse.double()[finite] - want_lse[finite]).abs().max().item() if same_empty else float("inf"),
    }
    for name, got, want in zip(("dq", "dk", "dv"), local, ref, strict=True):
        errors[name] = (got.grad.double() - shard(want.grad)).abs().max().item()
    return errors
