"""The FlashAttention 3 kernel (flash-attention's ``hopper/`` build, module ``flash_attn_interface``) on Hopper GPUs:
fp16/bf16, native GQA, head dims padded to a multiple of 8, at most 256.

This is the only module that imports ``flash_attn_interface``.

Note [flash-attn 3 API]
~~~~~~~~~~~~~~~~~~~~~~~
flash-attn 3 has no release: it is built from source, and its private ``_flash_attn_forward`` /
``_flash_attn_backward`` (the public functions do not take a global lse) changed shape across commits. Read from
``hopper/flash_attn_interface.py`` at every commit that touched it:

- 2024 (first release in July to November): ``_flash_attn_forward(q, k, v, softmax_scale, causal, ...)`` with
  5 to 10 parameters, returning ``(out, q, k, v, out_padded, softmax_lse, S_dmask)``. Not called: its lse sits
  elsewhere in the tuple.
- From the refactor of 2025-01-07 (commit 7a80279) on: ``_flash_attn_forward(q, k, v, k_new, v_new[, qv], out |
  out_, cu_seqlens_q, ..., softmax_scale, causal, <window>, ..., softcap, ...)`` with 30 to 34 parameters, returning
  ``(out, softmax_lse, ...)``; ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
  sequed_q, sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal | is_causal, <window>, softcap,
  deterministic, sm_margin)`` writing ``dq, dk, dv`` into the buffers given (returning them too, until the commits
  merged on 2025-11-17 made both functions ``torch.library.custom_op`` s, whose names live in the op's schema, and
  the backward return only ``softmax_d``). ``<window>`` is ``window_size=(-1, -1)`` before that merge and
  ``window_size_left``, ``window_size_right`` after it, when the backward's ``causal`` became ``is_causal``; before
  it, many parameters had no default.

This kernel calls that second form only, every argument by its name: ``q, k, v`` ``(B, S, H, D)`` (``k, v`` with
``Hkv`` heads), the scale, ``causal``, the window ``(-1, -1)`` (no local mask), ``softcap = 0.0``, ``deterministic``
from ``torch.are_deterministic_algorithms_enabled()``, the ``dq, dk, dv`` buffers, ``None`` for every other
parameter that has no default (all of them optional inputs: new keys, varlen offsets, paged KV, rotary, fp8
descales), and defaults for the rest. A function with a parameter outside the names read above, one without a
default that is not such an input, or no ``cu_seqlens_q`` (the 2024 form) is refused with the reason rather than
called. ``softmax_lse`` is ``(B, H, Sq)`` fp32; the C++ requires ``head_dim % 8 == 0`` and ``<= 256``, so q, k, v,
dO and out are padded with zeros here (the scale keeps the original head dim), and with a gradient on the lse above
head dim 248 the backward goes by parts (Note [Gradient of the lse] in :mod:`mesh_cp.kernels.base`). The backward
forms ``rowsum(dO * out)`` itself (its preprocess kernel). ``causal`` is bottom-right aligned, which mesh_cp's
square causal blocks do not tell from top-left. A build that leaves out a head dim, fp16 or the backward
(``FLASHATTENTION_DISABLE_*``) raises from C++ when called.

PyTorch's switch ``torch.nn.attention.activate_flash_attention_impl("FA3")`` (torch >= 2.11) re-registers ATen's
flash ops to these same kernels for the whole process; it is not toggled here: activating it around a call would
redirect every other thread's SDPA calls meanwhile, drop an implementation the user activated (activating restores
the default first) and register seven ATen kernels per call. (torch 2.13's ``_fa3.py`` overrides the dense and
varlen flash ops that ``cuda_flash`` calls, so a user who activated it sends those calls to FA3; that combination is
not tested here.)
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from mesh_cp.kernels.base import Capabilities, backward_by_parts, fused_backward_inputs, pad_head_dim, round_up

MODULE = "flash_attn_interface"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
WINDOW = ("window_size", "window_size_left", "window_size_right")
# Optional inputs: None is "absent" (the C++ takes them as std::optional).
_FORWARD_NONE = frozenset(
    "k_new v_new qv out out_ cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k max_seqlen_q max_seqlen_k "
    "page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary q_descale k_descale v_descale "
    "scheduler_metadata".split()
)
_BACKWARD_NONE = frozenset("cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k".split())
# Every parameter name of the second form (Note [flash-attn 3 API]); the ones a call sets, then the ones left to
# their defaults (all "off": 0, None, (-1, -1), 1 split, rotary settings without rotary tensors).
_FORWARD_SET = frozenset("q k v softmax_scale causal softcap".split()) | set(WINDOW)
_FORWARD_DEFAULTS = frozenset(
    "attention_chunk sink_token_length rotary_interleaved num_splits pack_gqa sm_margin".split()
)
_BACKWARD_SET = frozenset(
    "dout q k v out softmax_lse dq dk dv softmax_scale causal is_causal softcap deterministic".split()
)
_BACKWARD_DEFAULTS = frozenset({"sink_token_length", "sm_margin"}) | set(WINDOW)


def _parameters(fn: object) -> dict[str, bool] | None:
    """``{name: has a default}`` of ``fn``'s parameters: its signature, or for a ``torch.library.custom_op`` (whose
    signature is ``(*args, **kwargs)``) its op schema; ``None`` when neither can be read."""
    try:
        params = [
            p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    if params:
        return {p.name: p.default is not p.empty for p in params}
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    return None if schema is None else {a.name: a.has_default_value() for a in schema.arguments}


@dataclass(frozen=True)
class Api:
    """How to call one install's private functions (Note [flash-attn 3 API])."""

    interface: ModuleType
    split_window: bool
    backward_causal: str
    forward_none: tuple[str, ...]
    backward_none: tuple[str, ...]
    forward_softcap: bool
    backward_softcap: bool

    def window(self) -> dict:
        """No local mask, in this install's form."""
        return {"window_size_left": -1, "window_size_right": -1} if self.split_window else {"window_size": (-1, -1)}

    def forward_options(self) -> dict:
        """The keyword arguments of every forward call besides the tensors, the scale and ``causal``."""
        return {
            **self.window(),
            **({"softcap": 0.0} if self.forward_softcap else {}),
            **dict.fromkeys(self.forward_none),
        }

    def backward_options(self) -> dict:
        """The keyword arguments of every backward call besides the tensors, the scale and ``causal``."""
        softcap = {"softcap": 0.0} if self.backward_softcap else {}
        deterministic = torch.are_deterministic_algorithms_enabled()
        return {**self.window(), **softcap, "deterministic": deterministic, **dict.fromkeys(self.backward_none)}


def _none_for(fn_name: str, params: dict[str, bool] | None, passed: frozenset, defaults: frozenset, nones: frozenset):
    """The parameters of ``fn_name`` to pass ``None``: its optional inputs without a default. ``RuntimeError`` for a
    parameter this kernel does not know, or one it leaves to its default that has none."""
    where = f"flash-attn 3: {MODULE}.{fn_name}"
    if params is None:
        raise RuntimeError(f"{where} has no readable parameters; use kernel='flash_attn' or 'cuda_flash'")
    unknown = sorted(set(params) - passed - defaults - nones)
    required = sorted(n for n, default in params.items() if not default and n in defaults)
    if unknown or required:
        raise RuntimeError(
            f"{where} takes parameters {unknown or required} that the API mesh_cp calls does not have (Note "
            f"[flash-attn 3 API]); use kernel='flash_attn' or 'cuda_flash'"
        )
    return tuple(sorted(n for n, default in params.items() if not default and n in nones))


def _api(interface: ModuleType) -> Api:
    """The :class:`Api` of an imported ``flash_attn_interface``, or ``RuntimeError`` naming what does not fit."""
    fns = {name: getattr(interface, name, None) for name in ("_flash_attn_forward", "_flash_attn_backward")}
    for name, fn in fns.items():
        if fn is None:
            raise RuntimeError(f"flash-attn 3: {MODULE} has no {name}; use kernel='flash_attn' or 'cuda_flash'")
    fwd, bwd = (_parameters(fn) for fn in fns.values())
    forward_none = _none_for("_flash_attn_forward", fwd, _FORWARD_SET, _FORWARD_DEFAULTS, _FORWARD_NONE)
    backward_none = _none_for("_flash_attn_backward", bwd, _BACKWARD_SET, _BACKWARD_DEFAULTS, _BACKWARD_NONE)
    causal = [n for n in ("causal", "is_causal") if n in bwd]
    split = [("window_size" in p, "window_size_left" in p and "window_size_right" in p) for p in (fwd, bwd)]
    needed = {"q", "k", "v", "softmax_scale", "causal", "cu_seqlens_q"} - set(fwd)
    needed |= {"dout", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "deterministic"} - set(bwd)
    if needed or len(causal) != 1 or split[0] != split[1] or split[0][0] == split[0][1]:
        raise RuntimeError(
            f"flash-attn 3: {MODULE}'s _flash_attn_forward {sorted(fwd)} and _flash_attn_backward {sorted(bwd)} are "
            f"not the API mesh_cp calls (the 2025 form, Note [flash-attn 3 API]); use kernel='flash_attn' or "
            f"'cuda_flash'"
        )
    return Api(interface, split[0][1], causal[0], forward_none, backward_none, "softcap" in fwd, "softcap" in bwd)


def load() -> Api:
    """The :class:`Api` of the installed flash-attn 3, or ``RuntimeError`` naming why it is unusable (an import that
    fails, as a missing or binary-mismatched build does, or private functions of another form)."""
    try:
        interface = importlib.import_module(MODULE)
    except (ImportError, OSError, RuntimeError) as err:
        raise RuntimeError(
            f"flash-attn 3 cannot be imported ({type(err).__name__}: {err}); build and install it from "
            f"flash-attention's hopper/ directory against this torch (it has no release to pip install)"
        ) from err
    return _api(interface)


class FlashAttn3Kernel:
    """``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` (Note [flash-attn 3 API])."""

    name = "flash_attn3"
    capabilities = Capabilities(
        devices=("cuda",),
        dtypes=DTYPES,
        head_dim_multiple=HEAD_DIM_MULTIPLE,
        max_head_dim=MAX_HEAD_DIM,
        dq_in_input_dtype=True,
    )
    """No optional keyword: masked tiles go to the reference kernel; a softcap with this kernel named is refused."""

    def __init__(self, *, check_device: bool = True) -> None:
        self._api = load()
        if check_device and not torch.cuda.is_available():
            raise RuntimeError("kernel 'flash_attn3' needs CUDA; on CPU use kernel='cpu_flash'")

    @classmethod
    def without_device_check(cls) -> FlashAttn3Kernel:
        """The kernel without the CUDA-availability check, for tests that run it on emulated flash-attn 3 modules
        with CPU tensors. flash-attn 3 itself still needs CUDA tensors."""
        return cls(check_device=False)

    @classmethod
    def not_supported_reasons(cls, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
        """Every reason this kernel cannot run such inputs (empty: it can): its capabilities' limits, ROCm, on a
        CUDA device a compute capability other than 9.x (Hopper), and a flash-attn 3 that :func:`load` refuses."""
        reasons = list(cls.capabilities.not_supported_reasons(device, dtype, head_dim))
        if torch.version.hip:
            reasons.append("flash-attn 3 on ROCm is another implementation; not offered there")
        elif device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if major != 9:
                reasons.append(f"flash-attn 3 is offered on Hopper (compute capability 9.x) only, got {major}.{minor}")
        try:
            load()
        except RuntimeError as err:
            reasons.append(str(err))
        return tuple(reasons)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        batch, rows, heads, dim = q.shape
        padded = round_up(dim, HEAD_DIM_MULTIPLE)
        q, k, v = (pad_head_dim(t, padded).contiguous() for t in (q, k, v))
        api = self._api
        result = api.interface._flash_attn_forward(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, **api.forward_options()
        )
        out, lse = result[0], result[1]
        if tuple(lse.shape) != (batch, heads, rows) or tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"flash-attn 3 returned out {tuple(out.shape)} and softmax_lse {tuple(lse.shape)} for q "
                f"{tuple(q.shape)}, not the 2025 API's (Note [flash-attn 3 API]); use kernel='flash_attn' or 'cuda_flash'"
            )
        return out[..., :dim], lse

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        lse_grad: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dim = q.shape[-1]
        if lse_grad and round_up(dim + 1, HEAD_DIM_MULTIPLE) > MAX_HEAD_DIM:
            return backward_by_parts(self, do, q, k, v, lse, delta, causal=causal, scale=scale)
        # The kernel forms rowsum(dO * out) itself: Note [Gradient of the lse] in mesh_cp.kernels.base.
        do, q, k, v, out = fused_backward_inputs(do, q, k, v, delta, lse_grad=lse_grad, multiple=HEAD_DIM_MULTIPLE)
        do, q, k, v, out = (t.contiguous() for t in (do, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        api = self._api
        api.interface._flash_attn_backward(
            dout=do, q=q, k=k, v=v, out=out, softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv,
            softmax_scale=scale, **{api.backward_causal: causal}, **api.backward_options(),
        )  # fmt: skip
        return dq[..., :dim], dk[..., :dim], dv[..., :dim]
