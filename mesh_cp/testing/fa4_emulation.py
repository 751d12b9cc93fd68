"""An emulation of FlashAttention 4's ``flash_attn.cute.interface`` (the ``flash-attn-4`` package) on any device.

:func:`installed` puts a fake ``flash_attn``, ``flash_attn.cute`` and ``flash_attn.cute.interface`` into
``sys.modules`` for a ``with`` block. Its ``_flash_attn_fwd`` and ``_flash_attn_bwd`` have the parameters of the real
ones (``flash_attn/cute/interface.py`` at commit 0251105a, 2026-08-15; Note [flash-attn 4 API] in
:mod:`mesh_cp.kernels.flash_attn4`), refuse what the real ones assert (dtypes, shapes, int32 ``cu_seqlens`` and
``seqused`` with stride 1, head dims of the emulated architecture, ``out, lse, dq, dk, dv`` of the exact shape and
dtype; not that tensors are on CUDA: the emulation runs on CPU tensors, one device per call) and compute in fp64
what the kernels compute: per sequence (``seqused`` rows from ``cu_seqlens``), causal and windows bottom-right, the
softcap after the scale, GQA, the backward's ``D = rowsum(out * dout) - dlse``. The tensors it allocates start as
``nan`` (the real ones come from ``torch.empty``), and rows of a sequence's own range past its ``seqused`` are never
written, so a caller reading a row no sequence wrote sees ``nan``. Every call is recorded with its arguments.

Parameters for features it does not emulate (``qv``, paged KV, score/mask mods, learnable sinks, block sparsity, fp8
descales, ...) must keep their defaults; performance knobs (tiles, splits, ``pack_gqa``) are accepted and unused.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

VERSION = "4.0.0b27"
NAMES = ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")
LOW = (torch.float16, torch.bfloat16)


def validate_head_dims(head_dim: int, head_dim_v: int, major: int, alignment: int) -> None:
    """``_validate_head_dims`` of the real interface."""
    aligned = head_dim % alignment == 0 and head_dim_v % alignment == 0
    if major == 9:
        assert 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and aligned, (
            f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM90."
        )
    elif major in (10, 11):
        standard = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
        special = (head_dim, head_dim_v) in ((192, 128), (256, 256)) or (
            head_dim in (64, head_dim_v) and head_dim_v == 512
        )
        assert (standard or special) and aligned, (
            f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM100/SM110."
        )


def resolve_window(causal: bool, left: int | None, right: int | None) -> tuple[bool, bool, int | None, int | None]:
    """``_resolve_causal_local_window`` of the real interface: ``(causal, local, left, right)``."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        return causal, False, None, None
    if left is None and right == 0:
        return True, False, None, None
    return False, True, left, right


def sequence_mask(sq: int, sk: int, causal: bool, left: int | None, right: int | None) -> Tensor:
    """``(sq, sk)`` boolean: the keys each query of one sequence sees (``mask.py``: bottom-right)."""
    causal, local, left, right = resolve_window(causal, left, right)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal or (local and right is not None):
        seen &= j <= i + sk - sq + (0 if causal else right)
    if local and left is not None:
        seen &= j >= i + sk - sq - left
    return seen


def _scores(q: Tensor, k: Tensor, seen: Tensor, scale: float, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """fp64 ``(H, sq, sk)`` logits of one sequence (masked: ``-inf``) and ``tanh(logit / softcap)`` when capped."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().repeat_interleave(group, 1)
    raw = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(raw / softcap)
        raw = softcap * tanh
    return raw.masked_fill(~seen, -math.inf), tanh


def attend(q, k, v, seen, scale, softcap) -> tuple[Tensor, Tensor]:
    """fp64 ``out (sq, H, D)`` and ``lse (H, sq)`` of one sequence; a query that sees no key gets ``nan`` in both
    (what the real kernel writes there was not read)."""
    s, _ = _scores(q, k, seen, scale, softcap)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
    blind = ~seen.any(-1)
    return out.masked_fill(blind[:, None, None], math.nan), lse.masked_fill(blind[None], math.nan)


def attend_backward(q, k, v, dout, lse, d, seen, scale, softcap) -> tuple[Tensor, Tensor, Tensor]:
    """fp64 ``dq (sq, H, D)``, ``dk, dv (sk, Hkv, D)`` of one sequence from its ``lse (H, sq)`` and ``D (H, sq)``."""
    group = q.shape[1] // k.shape[1]
    s, tanh = _scores(q, k, seen, scale, softcap)
    p = torch.exp(s - lse.double()[..., None]).nan_to_num(0.0)
    kh, vh = (t.double().repeat_interleave(group, 1) for t in (k, v))
    dp = torch.einsum("qhd,khd->hqk", dout.double(), vh)
    ds = p * (dp - d.double()[..., None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    dq = torch.einsum("hqk,khd->qhd", ds, kh) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.double()) * scale
    dv = torch.einsum("hqk,qhd->khd", p, dout.double())
    return dq, *(t.reshape(t.shape[0], -1, group, t.shape[-1]).sum(2) for t in (dk, dv))


def _check_index(t: Tensor | None, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if t is None:
        return
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert t.stride(0) == 1, f"{name} must be contiguous"
    assert tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}"
    assert t.device == device, f"{name} is on {t.device}, the inputs on {device}"


def _check_output(t: Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """``_validate_tensor`` and ``validate_output_layout`` of the real interface (but for the CUDA check)."""
    assert tuple(t.shape) == shape, f"{name} shape {tuple(t.shape)} != expected {shape}"
    assert t.dtype == dtype, f"{name} dtype {t.dtype} != expected {dtype}"
    assert t.device == device, f"{name} device {t.device} != expected {device}"
    assert 0 not in t.stride() and t.stride(-1) == 1, f"{name} must have aligned strides and a contiguous last dim"


def _defaults(**given) -> None:
    """Refuse a feature the emulation does not implement (its parameter set away from the default)."""
    bad = sorted(name for name, (value, default) in given.items() if value is not default and value != default)
    if bad:
        raise NotImplementedError(f"the FA4 emulation does not implement {bad}")


FORWARD = (
    "q k v qv=None cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None "
    "max_seqlen_k=None min_seqlen_k=None page_table=None softmax_scale=None causal=False softcap=None "
    "window_size_left=None window_size_right=None learnable_sink=None tile_mn=None mma_pv_is_rs=None "
    "intra_wg_overlap=None num_threads=384 num_splits=1 pack_gqa=None _arch=None score_mod=None mask_mod=None "
    "block_sparse_tensors=None return_lse=False out=None lse=None aux_tensors=None aux_scalars=None q_descale=None "
    "k_descale=None v_descale=None gather_kv_indices=None scheduler_metadata=None seqlen_k_per_split=None "
    "disable_scheduler_metadata=False"
)
"""The parameters of ``_flash_attn_fwd``, in order, with their defaults."""
BACKWARD = (
    "q k v out dout lse softmax_scale=None causal=False softcap=0.0 window_size_left=None window_size_right=None "
    "m_block_size=64 n_block_size=128 num_threads=256 pack_gqa=False num_stages_Q=2 num_stages_dO=2 SdP_swapAB=False "
    "dKV_swapAB=False dQ_swapAB=False AtomLayoutMSdP=2 AtomLayoutNdKV=2 AtomLayoutMdQ=2 V_in_regs=False "
    "cu_seqlens_q=None cu_seqlens_k=None seqused_q=None seqused_k=None max_seqlen_q=None max_seqlen_k=None "
    "deterministic=False dq=None dk=None dv=None score_mod=None score_mod_bwd=None mask_mod=None aux_tensors=None "
    "aux_scalars=None block_sparse_tensors=None dlse=None learnable_sink=None"
)
"""The parameters of ``_flash_attn_bwd``, in order, with their defaults."""
_FORWARD_OFF = (
    "qv min_seqlen_k page_table learnable_sink score_mod mask_mod block_sparse_tensors aux_tensors aux_scalars "
    "q_descale k_descale v_descale gather_kv_indices scheduler_metadata seqlen_k_per_split"
).split()
_BACKWARD_OFF = "score_mod score_mod_bwd mask_mod aux_tensors aux_scalars block_sparse_tensors learnable_sink".split()


def signature(spec: str) -> inspect.Signature:
    """The signature written as ``spec``: ``name`` (no default) or ``name=<literal>``, apart by spaces."""
    params = []
    for token in spec.split():
        name, _, default = token.partition("=")
        value = ast.literal_eval(default) if default else inspect.Parameter.empty
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=value))
    return inspect.Signature(params)


def _function(name: str, spec: str, body) -> Any:
    """A function called ``name`` with the signature ``spec`` that calls ``body`` with every argument by name."""
    sig = signature(spec)

    def function(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(dict(bound.arguments))

    function.__name__ = function.__qualname__ = name
    function.__signature__ = sig
    return function


@dataclass(frozen=True)
class Side:
    """The sequences of one side of a call: ``(start, length)`` of each in the flat rows, ``dense`` for
    ``(B, S, ...)`` inputs (start ``b * S``)."""

    spans: tuple[tuple[int, int], ...]
    dense: bool
    seq: int

    @classmethod
    def of(cls, cu: Tensor | None, used: Tensor | None, batch: int, seq: int, rows: int, most: int | None) -> Side:
        """From ``cu_seqlens`` (lengths ``seqused`` where given) or ``batch`` dense rows of ``seq``. Every span must
        lie in the ``rows`` rows and be at most ``most`` long (``max_seqlen``), or the real kernel reads past them."""
        cuts = cu.tolist() if cu is not None else [b * seq for b in range(batch + 1)]
        lengths = used.tolist() if used is not None else [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
        spans = tuple(zip(cuts[:-1], lengths, strict=True))
        assert all(0 <= s and 0 <= n and s + n <= rows for s, n in spans), f"sequences {spans} outside {rows} rows"
        assert most is None or all(n <= most for _, n in spans), f"a sequence of {spans} is over max_seqlen {most}"
        return cls(spans, cu is None, seq)

    def rows(self, t: Tensor, b: int) -> Tensor:
        """Sequence ``b``'s rows of ``t`` (``(B, S, ...)`` or ``(total, ...)``), a view."""
        start, n = self.spans[b]
        return t[b, :n] if self.dense else t[start : start + n]

    def stats(self, t: Tensor, b: int) -> Tensor:
        """Sequence ``b``'s ``(H, n)`` of a statistic laid out as the lse: ``(B, H, S)`` or ``(H, total)``."""
        start, n = self.spans[b]
        return t[b, :, :n] if self.dense else t[:, start : start + n]


def _nan(shape, dtype, device) -> Tensor:
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def _check_inputs(a: dict, batch: int, dense_q: bool, arch: int) -> tuple[int, int]:
    """The checks both directions share; ``(heads, kv_heads)``."""
    q, k, v = a["q"], a["k"], a["v"]
    assert q.dim() == (4 if dense_q else 3) and k.dim() == v.dim(), (
        "q is (B, S, H, D), or (total, H, D) with cu_seqlens"
    )
    if v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise NotImplementedError("the FA4 emulation does not implement fp8")
    assert v.dtype in LOW, "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype, "q, k, v must have the same dtype"
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        _check_index(a[name], name, (batch + 1,), v.device)
    for name in ("seqused_q", "seqused_k"):
        _check_index(a[name], name, (batch,), v.device)
    assert all(t.device == v.device for t in (q, k)), "inputs must be on one device"
    heads, kv_heads = q.shape[-2], k.shape[-2]
    assert heads % kv_heads == 0, "num_head must be divisible by num_head_kv"
    if arch // 10 not in (8, 12):
        validate_head_dims(q.shape[-1], v.shape[-1], arch // 10, 16 // v.element_size())
    return heads, kv_heads


@dataclass
class Emulation:
    """One installed emulation: the architecture it reports (``major * 10 + minor``) and every call made, as
    ``(name, arguments by name)``."""

    arch: int = 90
    version: str = VERSION
    calls: list[tuple[str, dict]] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        """A fresh ``flash_attn.cute.interface`` whose functions run on this emulation."""
        interface = types.ModuleType(NAMES[2])
        interface.__version__ = self.version
        interface._flash_attn_fwd = _function("_flash_attn_fwd", FORWARD, self.forward)
        interface._flash_attn_bwd = _function("_flash_attn_bwd", BACKWARD, self.backward)
        return interface

    def forward(self, a: dict) -> tuple:
        self.calls.append(("_flash_attn_fwd", a))
        _defaults(**{name: (a[name], None) for name in _FORWARD_OFF})
        q, k, v, cu_q = a["q"], a["k"], a["v"], a["cu_seqlens_q"]
        batch = q.shape[0] if cu_q is None else cu_q.shape[0] - 1
        total_q, sk, dim_v = q.shape[0] if cu_q is not None else q.shape[0] * q.shape[1], v.shape[-3], v.shape[-1]
        kv_shape = (sk, k.shape[-2]) if a["cu_seqlens_k"] is not None else (batch, sk, k.shape[-2])
        assert k.shape == (*kv_shape, q.shape[-1]) and v.shape == (*kv_shape, dim_v), "k, v shapes"
        arch = a["_arch"] or self.arch
        assert arch // 10 in (8, 9, 10, 11, 12), "Unsupported compute capability"
        heads, _ = _check_inputs(a, batch, cu_q is None, arch)
        out_shape = (*q.shape[:-1], dim_v)
        lse_shape = (batch, heads, q.shape[1]) if cu_q is None else (heads, total_q)
        out, lse = a["out"], a["lse"]
        if out is None:
            out = _nan(out_shape, q.dtype, q.device)
        _check_output(out, "out", out_shape, q.dtype, q.device)
        if lse is None and (a["return_lse"] or any(t.requires_grad for t in (q, k, v))):
            lse = _nan(lse_shape, torch.float32, q.device)
        if lse is not None:
            _check_output(lse, "lse", lse_shape, torch.float32, q.device)
        if sk == 0 or total_q == 0:
            return out.zero_(), None if lse is None else lse.fill_(-math.inf), None, None
        qs = Side.of(cu_q, a["seqused_q"], batch, q.shape[1] if cu_q is None else 0, total_q, a["max_seqlen_q"])
        total_k = k.shape[0] * (sk if a["cu_seqlens_k"] is None else 1)
        ks = Side.of(a["cu_seqlens_k"], a["seqused_k"], batch, sk, total_k, a["max_seqlen_k"])
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else 1 / math.sqrt(q.shape[-1])
        softcap = a["softcap"] or None
        for b, ((_, nq), (_, nk)) in enumerate(zip(qs.spans, ks.spans, strict=True)):
            seen = sequence_mask(nq, nk, a["causal"], a["window_size_left"], a["window_size_right"])
            o, row_lse = attend(qs.rows(q, b), ks.rows(k, b), ks.rows(v, b), seen, scale, softcap)
            qs.rows(out, b).copy_(o)
            if lse is not None:
                qs.stats(lse, b).copy_(row_lse)
        return out, lse, None, None

    def backward(self, a: dict) -> tuple:
        self.calls.append(("_flash_attn_bwd", a))
        _defaults(**{name: (a[name], None) for name in _BACKWARD_OFF})
        assert self.arch // 10 in (9, 10, 11, 12), "Unsupported compute capability. Supported: 9.x, 10.x, 11.x, 12.x"
        q, k, v, out, dout, lse, dlse = (a[n] for n in ("q", "k", "v", "out", "dout", "lse", "dlse"))
        cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
        if not isinstance(a["softcap"], float):  # `softcap != 0.0` would build a score_mod of it
            raise TypeError(f"softcap must be a float (0.0: none), got {a['softcap']!r}")
        batch = k.shape[0] if cu_k is None else cu_k.shape[0] - 1
        total_q = q.shape[0] * (q.shape[1] if cu_q is None else 1)
        kv_shape = (k.shape[0],) if cu_k is not None else (batch, k.shape[1])
        assert k.shape == (*kv_shape, k.shape[-2], q.shape[-1]) and v.shape[:-1] == k.shape[:-1], "k, v shapes"
        heads, _ = _check_inputs(a, batch, cu_q is None, self.arch)
        out_shape = (*q.shape[:-1], v.shape[-1])
        lse_shape = (batch, heads, q.shape[1]) if cu_q is None else (heads, total_q)
        assert out.shape == out_shape and dout.shape == out_shape, "out and dout must have q's rows and v's head dim"
        assert lse.shape == lse_shape and lse.dtype == torch.float32, f"lse must be float32 of shape {lse_shape}"
        assert out.dtype == dout.dtype == q.dtype, "inputs must have the same dtype"
        assert dlse is None or (dlse.dtype == torch.float32 and dlse.shape == lse.shape), "dLSE must be fp32 like lse"
        if self.arch // 10 in (10, 11) and q.shape[-1] == v.shape[-1] == 256:
            assert a["softcap"] == 0.0 and dlse is None and a["seqused_q"] is None and a["seqused_k"] is None
        assert self.arch // 10 != 12 or (a["softcap"] == 0.0 and not a["deterministic"]), "not supported on SM 12.0"
        grads = []
        for name, like in (("dq", q), ("dk", k), ("dv", v)):
            given = a[name]
            if given is not None:
                _check_output(given, name, tuple(like.shape), like.dtype, like.device)
            grads.append(given if given is not None else _nan(like.shape, like.dtype, like.device))
        rows = (out.float() * dout.float()).sum(-1)
        d = (rows.transpose(1, 2) if cu_q is None else rows.t()) - (0 if dlse is None else dlse)
        qs = Side.of(cu_q, a["seqused_q"], batch, q.shape[1] if cu_q is None else 0, total_q, a["max_seqlen_q"])
        sk = k.shape[1] if cu_k is None else 0
        ks = Side.of(cu_k, a["seqused_k"], batch, sk, k.shape[0] * max(sk, 1), a["max_seqlen_k"])
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else 1 / math.sqrt(q.shape[-1])
        for b, ((_, nq), (_, nk)) in enumerate(zip(qs.spans, ks.spans, strict=True)):
            seen = sequence_mask(nq, nk, a["causal"], a["window_size_left"], a["window_size_right"])
            inputs = (qs.rows(q, b), ks.rows(k, b), ks.rows(v, b), qs.rows(dout, b), qs.stats(lse, b), qs.stats(d, b))
            for side, grad, value in zip(
                (qs, ks, ks), grads, attend_backward(*inputs, seen, scale, a["softcap"] or None), strict=True
            ):
                side.rows(grad, b).copy_(value)
        return tuple(grads)


@contextlib.contextmanager
def installed(arch: int = 90, version: str = VERSION) -> Iterator[Emulation]:
    """``flash_attn.cute.interface`` emulated (as ``sys.modules`` entries) inside the block; what was there before
    (a real flash-attn, another fake, nothing) is put back after it."""
    emulation = Emulation(arch, version)
    saved = {name: sys.modules[name] for name in NAMES if name in sys.modules}
    package, cute = types.ModuleType(NAMES[0]), types.ModuleType(NAMES[1])
    package.__path__, cute.__path__ = [], []
    interface = emulation.module()
    package.cute, cute.interface = cute, interface
    sys.modules.update(zip(NAMES, (package, cute, interface), strict=True))
    try:
        yield emulation
    finally:
        for name in NAMES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
