"""The lengths form of decoding and its flash decode kernel (Note [Flash decode] in :mod:`mesh_cp.runtime.decode`).

``aten._flash_attention_forward`` with ``seqused_k`` and a ``block_table`` (PyTorch's ``mha_varlen_fwd`` over a
paged cache) runs on CPU under a dispatch mode that reads every argument by its schema name and does what the C++
does with them: it checks the paged shapes (pages of a multiple of 256 rows, an int32 block table and lengths of
one entry per sequence), finds key ``i`` of sequence ``b`` at row ``i % page`` of page ``block_table[b, i //
page]`` through the key tensor's own strides, reads only the first ``seqused_k[b]`` of them, and returns ``(H,
total_q)`` fp32 statistics. Through it, :func:`mesh_cp.kernels.cuda_flash.decode_forward` over a ``(B, Hkv, C, D)``
cache read as its ``.transpose(1, 2)`` view must equal an fp64 softmax over each row's first ``lengths[b]`` entries
(fp16 and bf16, MHA and GQA, a row of length 0, a full row, unfilled slots holding large values) and the lengths
form's other step (the positions form's local step), and the lengths form refuses what it cannot take by name. The
emulation also does what PyTorch 2.13's kernels do wrong (Note [Flash decode]): an unswapped call of several rows
left to pick its own splits leaves rows unwritten, and an empty row's lse lands on another row's; the call must
steer clear of both (the test fails without either guard).
"""

from __future__ import annotations

import logging

import pytest
import torch

import mesh_cp.kernels.cuda_flash as cuda_flash
from mesh_cp.runtime.decode import flash_decode_reasons, lengths_attention
from tests.core.test_kernel_emulation import EmulatedCudaAttention, _flash_varlen_fwd
from tests.runtime.test_decode import reference as decode_reference

TOL = 2e-2
"""fp16/bf16 against fp64 over the same rounded values."""


def _paged_fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
               scale, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
               block_table=None, num_splits=None):  # fmt: skip
    """``mha_varlen_fwd`` with a paged cache (``block_table``), else the plain varlen emulation."""
    if block_table is None:
        return _flash_varlen_fwd(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale,
            window_size_left, window_size_right, seqused_k, alibi_slopes,
        )  # fmt: skip
    batch = cum_seq_q.numel() - 1
    pages, page = key.shape[:2]
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
    assert all(t.stride(-1) == 1 for t in (query, key, value)), "Input tensor must have contiguous last dimension"
    assert key.dim() == value.dim() == 4 and key.shape == value.shape, "num_blocks x page_block_size x Hkv x D"
    assert page % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1 and block_table.shape[0] == batch
    assert cum_seq_q.dtype == cum_seq_k.dtype == torch.int32 and cum_seq_k.shape == (batch + 1,)
    assert seqused_k is not None and seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,)
    assert seqused_k.is_contiguous() and dropout_p == 0.0 and not return_debug_mask and alibi_slopes is None
    assert window_size_left in (None, -1) and window_size_right in (None, -1) and num_splits in (None, 0, 1)
    assert query.shape[1] % key.shape[2] == 0 and query.shape[2] == key.shape[3] <= 256 and key.shape[3] % 8 == 0
    group = query.shape[1] // key.shape[2]
    swapped = max_q == 1 and group > 1  # seqlenq_ngroups_swapped: the GQA heads of one query as its rows
    cu_q, used, table = cum_seq_q.tolist(), seqused_k.tolist(), block_table.tolist()
    out = torch.zeros_like(query)
    lse = torch.full((query.shape[1], query.shape[0]), float("inf"))  # a query that sees nothing
    empty = []
    for b in range(batch):
        n = used[b]
        assert 0 <= n <= max_k and n <= page * len(table[b]), (n, max_k)
        if n == 0:
            empty.append(b)
        if n == 0 or cu_q[b] == cu_q[b + 1]:
            continue
        rows = [(table[b][i // page], i % page) for i in range(n)]
        assert all(0 <= p < pages for p, _ in rows)
        keys = torch.stack([key[p, r] for p, r in rows]).double().repeat_interleave(group, 1)  # (n, H, D)
        values = torch.stack([value[p, r] for p, r in rows]).double().repeat_interleave(group, 1)
        q = query[cu_q[b] : cu_q[b + 1]].double()  # (sq, H, D)
        s = torch.einsum("qhd,khd->hqk", q, keys) * (query.shape[-1] ** -0.5 if scale is None else scale)
        if is_causal and max_q > 1:
            raise AssertionError("a causal paged call is not emulated")
        lse[:, cu_q[b] : cu_q[b + 1]] = torch.logsumexp(s, -1).float()
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), values).to(query.dtype)
    # PyTorch 2.13's faults (Note [Flash decode]): several splits of an unswapped call write every row at row 0's
    # place, leaving the others unwritten; an empty sequence writes +inf at a padded index of the unpadded lse.
    if num_splits in (None, 0) and not swapped and batch > 1:
        out[cu_q[1] :] = float("nan")
    for b in empty:
        lse.view(-1)[b * query.shape[1] : (b + 1) * query.shape[1]] = float("inf")
    rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse, *rng, torch.empty(0, dtype=query.dtype)


class EmulatedPagedFlash(EmulatedCudaAttention):
    IMPLS = {**EmulatedCudaAttention.IMPLS, torch.ops.aten._flash_attention_forward.default: _paged_fwd}


@pytest.fixture
def flash_runs(monkeypatch):
    """The flash decode kernel's device checks passed on CPU (the op itself is emulated)."""
    monkeypatch.setattr(cuda_flash, "decode_reasons", lambda device, dtype, head_dim: ())


def cache(batch: int, heads: tuple[int, int], dim: int, slots: int, lengths: list[int], dtype, seed: int):
    """``q (B, 1, Hq, D)``, ``k, v`` as ``.transpose(1, 2)`` views of ``(B, Hkv, C, D)`` storage whose unfilled
    slots hold large values, int32 ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads[0], dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads[1], slots, dim, generator=gen) for _ in "kv")
    for b, n in enumerate(lengths):
        k[b, :, n:], v[b, :, n:] = 1e3, -1e3
    k, v = (t.to(dtype).transpose(1, 2) for t in (k, v))
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def reference(q, k, v, lengths):
    """fp64 softmax of each row's one query over its first ``lengths[b]`` entries (test_decode's reference over those
    positions): ``(out (B, 1, Hq, D), lse (B, Hq, 1))``, ``0`` and ``-inf`` for a row of none."""
    slots = torch.arange(k.shape[1])
    positions = torch.where(slots < lengths[:, None].long(), slots, -1)
    q_positions = torch.full((q.shape[0], 1), k.shape[1])
    out, lse = decode_reference(*(t.double() for t in (q, k, v)), positions, q_positions)
    return out.nan_to_num(0.0), lse  # a row of none: softmax over nothing


CASES = [
    ("MHA bf16", (4, 4), 64, 256, [0, 7, 256], torch.bfloat16),
    ("GQA bf16", (8, 2), 128, 512, [300, 1, 0], torch.bfloat16),
    ("GQA fp16", (6, 3), 64, 256, [255, 100, 3], torch.float16),
    ("MQA fp16", (4, 1), 8, 256, [17, 0, 256], torch.float16),
]


@pytest.mark.parametrize("name, heads, dim, slots, lengths, dtype", CASES, ids=[c[0] for c in CASES])
def test_flash_decode_equals_fp64_and_the_local_step(flash_runs, name, heads, dim, slots, lengths, dtype) -> None:
    q, k, v, used = cache(3, heads, dim, slots, lengths, dtype, seed=len(name) + dim)
    want, want_lse = reference(q, k, v, used)
    assert k.shape[2] == 1 or not k.is_contiguous()  # the cache's own storage, read through its strides
    with EmulatedPagedFlash() as mode:
        out, lse = lengths_attention("auto", q, k, v, used, dim**-0.5)
    assert "_flash_attention_forward.default" in mode.ran
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == want_lse.shape
    assert (out.double() - want).abs().max() <= TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert (lse.double() - want_lse)[finite].abs().max() <= TOL
    local, local_lse = lengths_attention("reference", q, k, v, used, dim**-0.5)  # the positions form's step
    assert (out - local).abs().max() <= TOL and torch.equal(torch.isinf(lse), torch.isinf(local_lse))


def test_auto_runs_the_local_step_where_flash_cannot_and_logs_why(caplog) -> None:
    q, k, v, used = cache(2, (4, 2), 8, 256, [3, 0], torch.bfloat16, seed=1)
    reasons = flash_decode_reasons(q, k)
    assert any("cpu" in r for r in reasons), reasons
    with caplog.at_level(logging.INFO, logger="mesh_cp"), EmulatedPagedFlash() as mode:
        out, lse = lengths_attention("auto", q, k, v, used, 8**-0.5)
    assert "_flash_attention_forward.default" not in mode.ran
    want, want_lse = reference(q, k, v, used)
    assert (out.double() - want).abs().max() <= TOL
    assert "not the flash decode kernel" in caplog.text


def test_refusals(flash_runs) -> None:
    import mesh_cp

    q, k, v, used = cache(2, (4, 2), 8, 256, [3, 0], torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=r"pages of a multiple of 256 rows .* got 200 rows"):
        cuda_flash.decode_forward(q[:, 0], k[:, :200], v[:, :200], used, scale=1.0)
    for slots in (200, 0):  # an empty shard reads no page either
        with pytest.raises(NotImplementedError, match=rf"{slots} slots are not a positive multiple of 256"):
            lengths_attention("cuda_flash", q, k[:, :slots], v[:, :slots], used, 1.0)
    calls = {
        r"one new token per row, got q \(2, 2, 4, 8\)": dict(q=q.expand(2, 2, 4, 8), k_lengths=used),
        r"k_lengths must be a \(B,\) = \(2,\) int32 tensor": dict(q=q, k_lengths=used.long()),
        r"one form: k_lengths alone": dict(q=q, k_lengths=used, k_positions=used.long()[:, None]),
        r"needs q_positions and k_positions, or k_lengths": dict(q=q),
    }
    for message, args in calls.items():
        with pytest.raises(ValueError, match=message), torch.no_grad():
            mesh_cp.decode_attn_func(k=k, v=v, mesh=None, **args)


def test_named_kernel_names_every_reason_on_cpu() -> None:
    q, k, v, used = cache(2, (4, 2), 12, 256, [3, 0], torch.float32, seed=3)
    with pytest.raises(NotImplementedError, match=r"cannot run this step: .*float32.*multiple of 8"):
        lengths_attention("cuda_flash", q, k, v, used, 1.0)


@pytest.mark.parametrize(
    "version, batch, heads, want",
    [("2.13.0", 2, (4, 4), True), ("2.13.0.dev20260501", 3, (8, 8), True), ("2.12.1", 2, (4, 4), False),
     ("2.13.0", 1, (4, 4), False), ("2.13.0", 4, (8, 2), False)],
)  # fmt: skip
def test_one_split_only_where_the_kernels_own_splits_would_corrupt_rows(monkeypatch, version, batch, heads, want):
    """2.12 refuses ``num_splits`` for FlashAttention 2 (and does not split a paged call itself); from 2.13 an
    unswapped call of several rows must pass ``num_splits=1``."""
    monkeypatch.setattr(torch, "__version__", version)
    assert cuda_flash._splits_corrupt(batch, *heads) is want


def test_lengths_outside_the_page_are_held_to_it_as_the_local_step_reads_them(flash_runs) -> None:
    """On a device ``k_lengths`` are not read back, so the kernel holds them to ``0 .. C``: a longer length reads
    the whole page (not the next row's), a negative one none, as the local step reads them."""
    q, k, v, _ = cache(3, (4, 2), 8, 256, [256, 0, 5], torch.bfloat16, seed=3)
    wild = torch.tensor([300, -4, 5], dtype=torch.int32)
    with EmulatedPagedFlash() as mode:
        out, lse = cuda_flash.decode_forward(q[:, 0], k, v, wild, scale=8**-0.5)
    assert "_flash_attention_forward.default" in mode.ran
    local, local_lse = lengths_attention("reference", q, k, v, wild, 8**-0.5)
    assert (out.float() - local[:, 0]).abs().max() <= TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(local_lse[..., 0])) and torch.isinf(lse[1]).all()
