"""Tree-Attention decoding (``mesh_cp.decode_attn_func``, Note [Tree decoding]) against single-process attention.

One gloo group per P (2, 3, 4: the first P ranks of one spawned group of 4) runs every case on a flat process
group and on meshes of every tile (and a head-parallel hybrid at P = 4): a batch of 3 rows of different lengths
whose cache entries are dealt to the ranks unevenly (one rank holds nothing of row 0, another nothing at all in one
case), padding slots at position -1, 1 or 3 new tokens per row (causal among them), MHA, GQA and MQA. Every rank's
output and lse must equal an fp64 single-process softmax over the visible entries within 1e-5 (fp32), the bytes it
sent must equal the plan's, and its collectives must be one all-gather per level of the mesh (one in all over a
process group or a ``1 x P`` mesh). With one new token the same shards in the lengths form (each row's entries
first, other values after them; Note [Flash decode]) give the same result.
A bf16 cache (``(B, Hkv, L, D)`` storage read through ``.transpose(1, 2)``, as the generation cache passes it)
gives the fp64 softmax of the same bf16 values within 2e-2.

In one process: the local step (Note [Decode local step]) makes no copy of a bf16 shard and no fp32 tensor larger
than a quarter of it, where the reference kernel's step makes an fp32 copy of the shard (the same check fails it),
and the many-piece merge of the combine equals a chain of ``merge_``, rows empty everywhere included.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mesh_cp
from mesh_cp.core import DecodeShape
from mesh_cp.core.numerics import merge_
from mesh_cp.debug import CommCounter
from mesh_cp.kernels import get_kernel
from mesh_cp.runtime.decode import local_attention, merge_pieces, reduction_groups
from mesh_cp.testing import expect_error, spawn_gloo
from tests.group_sizes import by_group_size, size_results

TOL = 1e-5
BF16_TOL = 2e-2
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
LENGTHS = (13, 5, 9)
"""Cached tokens of each row before the new ones."""
DIM = 8


def full_cache(heads: tuple[int, int], new: int, seed: int):
    """fp64 queries of ``new`` tokens per row and the whole cache (new tokens' K/V included) of every row, padded to
    one length with position -1."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    total = max(LENGTHS) + new
    q = torch.randn(len(LENGTHS), new, hq, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(len(LENGTHS), total, hkv, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    positions = torch.full((len(LENGTHS), total), -1, dtype=torch.long)
    q_positions = torch.zeros(len(LENGTHS), new, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        positions[b, : n + new] = torch.arange(n + new)
        q_positions[b] = torch.arange(n, n + new)
    return q, k, v, positions, q_positions


def reference(q, k, v, positions, q_positions):
    g = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5
    seen = (positions[:, None, None, :] >= 0) & (positions[:, None, None, :] <= q_positions[:, None, :, None])
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2), lse


def owners(slots: int, world: int, empty: bool) -> torch.Tensor:
    """The rank holding each cache slot: pairs of slots dealt round-robin; with ``empty``, rank 0's go to rank 1
    (rank 0 holds nothing)."""
    owner = (torch.arange(slots) // 2) % world
    if empty and world > 1:
        owner[owner == 0] = 1
    return owner


def run_cases(group, rank: int, world: int) -> dict[str, float]:
    meshes = {"group": group}
    for a in (a for a in range(1, world + 1) if world % a == 0):
        meshes[f"{a}x{world // a}"] = mesh_cp.CPMesh.create(group, tile=(a, world // a))
    if world == 4:
        meshes["2 heads x 1x2"] = mesh_cp.CPMesh.create(group, tile=(1, 2), head_parallel=2)
    errors: dict[str, float] = {}
    seed = 0
    for name, heads in HEADS.items():
        for new in (1, 3):
            for empty in (False, True):
                seed += 1
                q, k, v, positions, q_positions = full_cache(heads, new, seed)
                owner = owners(k.shape[1], world, empty)
                if world > 1:  # the last rank's slots of row 0 hold nothing: it has no entry for that row
                    positions[0, owner == world - 1] = -1
                want, want_lse = reference(q, k, v, positions, q_positions)
                mine = owner == rank
                ks, vs, ps = k[:, mine].float(), v[:, mine].float(), positions[:, mine]
                shape = DecodeShape(len(LENGTHS), new, heads[0], heads[1], DIM, k.shape[1], 4)
                for label, mesh in meshes.items():
                    with torch.no_grad(), CommCounter() as counter:
                        out, lse = mesh_cp.decode_attn_func(
                            q.float(), ks, vs, mesh=mesh, q_positions=q_positions, k_positions=ps, return_lse=True
                        )
                    case = f"{name} new {new}{' empty rank' if empty else ''} {label}"
                    errors[f"{case} out"] = (out.double() - want).abs().max().item()
                    errors[f"{case} lse"] = (lse.double() - want_lse).abs().max().item()
                    _, plan = reduction_groups(mesh)
                    errors[f"{case} bytes"] = abs(counter.bytes_sent() - plan.bytes_sent(shape))
                    ops = [r.op for r in counter.records]
                    errors[f"{case} collectives"] = float(ops != ["all_gather"] * len(plan.levels))
                    if label in ("group", f"1x{world}"):
                        errors[f"{case} one collective"] = abs(len(ops) - 1)
                    if new == 1:  # the lengths form: each row's entries first, the rest holding other values
                        kc, vc, lengths = compacted(ks, vs, ps)
                        with torch.no_grad():
                            out, lse = mesh_cp.decode_attn_func(
                                q.float(), kc, vc, mesh=mesh, k_lengths=lengths, return_lse=True
                            )
                        errors[f"{case} lengths out"] = (out.double() - want).abs().max().item()
                        errors[f"{case} lengths lse"] = (lse.double() - want_lse).abs().max().item()
    errors.update(bf16_case(group, rank, world))
    return errors


def compacted(k, v, positions):
    """The shard in the lengths form: each row's entries (position >= 0) moved to its first slots, in order, the
    slots after them filled with 1e3; and the int32 lengths."""
    seen = positions >= 0
    kc, vc = torch.full_like(k, 1e3), torch.full_like(v, 1e3)
    for b in range(k.shape[0]):
        n = int(seen[b].sum())
        kc[b, :n], vc[b, :n] = k[b, seen[b]], v[b, seen[b]]
    return kc, vc, seen.sum(1).to(torch.int32)


def bf16_case(group, rank: int, world: int) -> dict[str, float]:
    """GQA with 3 new tokens over a bf16 cache stored ``(B, Hkv, L, D)`` and passed as its ``.transpose(1, 2)``
    view, on the flat group: the error against fp64 over the same bf16 values."""
    q, k, v, positions, q_positions = full_cache(HEADS["GQA"], 3, 99)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    want, want_lse = reference(q.double(), k.double(), v.double(), positions, q_positions)
    mine = owners(k.shape[1], world, False) == rank
    ks, vs = (t[:, mine].transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    with torch.no_grad():
        out, lse = mesh_cp.decode_attn_func(
            q, ks, vs, mesh=group, q_positions=q_positions, k_positions=positions[:, mine], return_lse=True
        )
    return {
        "bf16 dtype": float(out.dtype != torch.bfloat16 or lse.dtype != torch.float32),
        "bf16 out": max(0.0, (out.double() - want).abs().max().item() - BF16_TOL + TOL),
        "bf16 lse": max(0.0, (lse.double() - want_lse).abs().max().item() - BF16_TOL + TOL),
    }


class Maskless:
    """A block kernel that declares no mask support."""

    name = "maskless"

    def forward(self, q, k, v, *, causal, scale):
        raise AssertionError("never called")

    def backward(self, do, q, k, v, lse, delta, *, causal, scale, lse_grad=False):
        raise AssertionError("never called")


def refusals(group) -> dict:
    results: dict = {}
    q, kv = torch.zeros(1, 1, 4, 8), torch.zeros(1, 5, 2, 8)
    qp, kp = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)
    call = mesh_cp.decode_attn_func
    expect_error(
        results, "grad", RuntimeError, r"is for inference: call it under torch.no_grad\(\)",
        lambda: call(q.requires_grad_(), kv, kv, mesh=group, q_positions=qp, k_positions=kp),
    )  # fmt: skip
    q = q.detach()
    with torch.no_grad():
        expect_error(
            results, "positions shape", ValueError, r"q_positions \(1, 2\) must be \(B, k\) = \(1, 1\)",
            lambda: call(q, kv, kv, mesh=group, q_positions=torch.zeros(1, 2, dtype=torch.long), k_positions=kp),
        )  # fmt: skip
        expect_error(
            results, "float positions", ValueError, r"k_positions must be an integer tensor",
            lambda: call(q, kv, kv, mesh=group, q_positions=qp, k_positions=kp.float()),
        )  # fmt: skip
        expect_error(
            results, "heads", ValueError, r"Hq a multiple of Hkv",
            lambda: call(torch.zeros(1, 1, 3, 8), kv, kv, mesh=group, q_positions=qp, k_positions=kp),
        )  # fmt: skip
        expect_error(
            results, "kernel", ValueError, r"kernel 'maskless' takes no mask",
            lambda: call(q, kv, kv, mesh=group, q_positions=qp, k_positions=kp, kernel=Maskless()),
        )  # fmt: skip
        expect_error(
            results, "mesh", ValueError, r"mesh must be a mesh_cp.CPMesh or a torch.distributed ProcessGroup",
            lambda: call(q, kv, kv, mesh="world", q_positions=qp, k_positions=kp),
        )  # fmt: skip
    return results


WORLDS = (2, 3, 4)


def worker(rank: int, world: int) -> dict[int, tuple[dict, dict]]:
    return by_group_size(WORLDS, lambda group, r, p: (run_cases(group, r, p), refusals(group)), rank, world)


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, tuple[dict, dict]]]:
    """One spawned group of 4 ranks; P = 2 and 3 run on its first P ranks."""
    return spawn_gloo(worker, max(WORLDS))


@pytest.fixture(scope="module", params=WORLDS)
def results(request, spawned) -> list:
    return size_results(spawned, request.param)


def test_decode_equals_single_process(results) -> None:
    for rank, (errors, _) in enumerate(results):
        assert len(errors) >= 36, sorted(errors)
        worst = {k: e for k, e in errors.items() if e > (0 if k.endswith("bytes") else TOL)}
        assert not worst, (rank, worst)


def test_refusals(results) -> None:
    for _, refused in results:
        assert len(refused) == 6 and all(v is True for v in refused.values()), refused


class Allocations(TorchDispatchMode):
    """Records the op, dtype and size of every tensor an op returns in new memory (views and in-place results of
    its inputs left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.made.append((str(func), t.dtype, t.numel()))
        return out


def local_step_allocations(block, layout: str) -> tuple[int, list, float]:
    """The shard's elements, the tensors the local step made, and its error against fp64 over the same values:
    GQA 8:2, 3 new tokens, 2 rows of 512 cached bf16 entries (row 1 sees 300), head dim 64."""
    gen = torch.Generator().manual_seed(5)
    batch, length, kv_heads, dim = 2, 512, 2, 64
    q = torch.randn(batch, 3, 8, dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen).to(torch.bfloat16) for _ in "kv")
    if layout == "(B, L, Hkv, D)":
        k, v = (t.transpose(1, 2).contiguous() for t in (k, v))
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    k_positions = torch.arange(length).expand(batch, -1).clone()
    k_positions[1, 300:] = -1
    q_positions = torch.tensor([[509, 510, 511], [509, 510, 511]])
    with torch.no_grad(), Allocations() as seen:
        out, lse = local_attention(block, q, k, v, q_positions, k_positions, dim**-0.5)
    want, want_lse = reference(q.double(), k.double(), v.double(), k_positions, q_positions)
    error = max((out.double() - want).abs().max().item(), (lse.double() - want_lse).abs().max().item())
    return k.numel(), seen.made, error


@pytest.mark.parametrize("layout", ["(B, L, Hkv, D)", "transposed (B, Hkv, L, D)"])
def test_local_step_makes_no_fp32_copy_of_the_shard(layout: str) -> None:
    shard, made, error = local_step_allocations(None, layout)
    fp32 = max(n for _, dtype, n in made if dtype == torch.float32)
    assert fp32 <= shard // 4, (fp32, shard)  # the scores: B Hq k L = shard * k G / D
    if layout.startswith("transposed"):  # the layout of the generation cache: not even a bf16 copy
        assert max(n for _, _, n in made) < shard, [m for m in made if m[2] >= shard]
    assert error < BF16_TOL, error
    # The same check fails the reference kernel's step, which upcasts the shard.
    shard, made, _ = local_step_allocations(get_kernel("reference"), layout)
    assert max(n for _, dtype, n in made if dtype == torch.float32) >= shard


def test_many_piece_merge_is_a_chain_of_merges() -> None:
    gen = torch.Generator().manual_seed(3)
    outs = torch.randn(4, 2, 3, 5, 8, generator=gen)
    lses = torch.randn(4, 2, 3, 5, generator=gen) * 4
    lses[1:3, 0, 1] = float("-inf")  # pieces that saw nothing of a row
    lses[:, 1, 2] = float("-inf")  # a row no piece saw
    outs[lses.isinf()] = 0.0
    out, lse = merge_pieces(outs, lses)
    o_acc, lse_acc = torch.zeros(2, 3, 5, 8), torch.full((2, 5, 3), float("-inf"))
    for o, piece_lse in zip(outs, lses, strict=True):
        merge_(o_acc, lse_acc, o, piece_lse.transpose(1, 2))
    assert torch.allclose(out, o_acc, atol=1e-6) and torch.equal(lse.isinf(), lse_acc.transpose(1, 2).isinf())
    assert torch.allclose(lse, lse_acc.transpose(1, 2)) and torch.all(out[1, 2] == 0)
