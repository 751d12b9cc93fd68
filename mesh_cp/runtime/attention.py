"""``mesh_attn_func``: exact attention over a sequence sharded across a CP mesh."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mesh_cp.core.masks import AttentionMask
from mesh_cp.core.numerics import SUPPORTED_DTYPES, autocast_dtype, autocast_inputs, document_ids
from mesh_cp.core.options import Backward, Layout, Schedule, check_option, positive_or_none
from mesh_cp.core.plan import make_plan
from mesh_cp.core.shape import AttentionShape
from mesh_cp.kernels import BlockKernel, KernelName, resolve_kernel, takes
from mesh_cp.runtime.call import AttentionCall, Saved, by_segments, row_partials
from mesh_cp.runtime.check import check_same, check_same_call
from mesh_cp.runtime.executors import EXECUTORS
from mesh_cp.runtime.heads import grads_from_heads, grads_to_heads, inputs_to_heads, outputs_from_heads
from mesh_cp.runtime.mesh import CPMesh


class MeshAttnFunc(torch.autograd.Function):
    """Autograd function of Mesh-Attention; use :func:`mesh_attn_func` rather than calling it directly.

    ``forward(q, k, v, call) -> out`` (``(out, lse)`` when the plan returns the lse) with ``call`` the
    :class:`AttentionCall` (mesh, plan, kernel, scale, ``lse_grad``), kept on ``ctx`` for backward. It runs the
    whole plan: with ``head_parallel > 1`` the head exchange (:mod:`mesh_cp.runtime.heads`) in, the executor of the
    blocks (the plan's ``schedule``), the exchange out; backward is the adjoint, on the head-layout tensors saved
    in forward.

    Gradients are not materialised: an output that no loss reads arrives in ``backward`` as ``None``
    (and is taken as zeros; an lse without a gradient is neither made nor sent through the head exchange, as
    ``plan.all_to_alls("backward", lse_grad=False)`` counts, so the ranks of a head group must agree on whether
    their loss reads it; ``mesh.debug`` checks that they do). ``call.lse_grad`` (``mesh_attn_func``'s ``return_lse``, equal on every rank of
    the mesh by its call check) says whether the lse may receive a gradient: the fused block kernels
    then take the exact path for any ``dlse``, otherwise their cheaper one (Note [Gradient of the lse]
    in :mod:`mesh_cp.kernels.base`). Every block of a row is computed with the same choice whichever
    rank computes it, and nothing is decided from data (no host sync). Backward is collective: every
    rank must back-propagate through every call (a gradient that reaches only one of the two outputs
    is enough; the other is taken as zeros), or the ranks that do wait for those that do not.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall):
        ctx.set_materialize_grads(False)
        mesh, plan, dtype = call.mesh, call.plan, q.dtype
        ctx.kv_heads = k.shape[2]
        if plan.head_parallel > 1:
            q, k, v = inputs_to_heads(q, k, v, mesh, plan)
        out, lse, gathered = EXECUTORS[plan.schedule].forward(call, q, k, v)
        out = out.to(dtype)
        ctx.save_for_backward(q, k, v, out, lse, *gathered)
        ctx.call = call
        if plan.head_parallel > 1:
            out, lse = outputs_from_heads(out, lse if plan.return_lse else None, mesh, plan)
        return (out, lse) if plan.return_lse else out

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, *gathered = ctx.saved_tensors
        call: AttentionCall = ctx.call
        mesh, plan, u = call.mesh, call.plan, call.plan.head_parallel
        if dout is None:  # only the lse reaches a loss (or neither, on this rank: backward is still collective)
            dout = out.new_zeros(_token_shape(out.shape, u, tokens_at=1, heads_at=2))
        if not call.lse_grad:
            dlse = None  # None (no loss reads the lse) stays None: the head exchange sends no lse gradient
        elif u > 1 and mesh.debug:
            _check_lse_read_alike(mesh, dlse is not None)
        if u > 1:
            dout, dlse = grads_to_heads(dout, dlse, mesh, plan)
        saved = Saved(q=q, k=k, v=v, out=out, lse=lse, gathered=tuple(gathered))
        dq, dk, dv = EXECUTORS[plan.schedule].backward(call, dout, dlse, saved)
        if u > 1:
            dq, dk, dv = grads_from_heads(dq, dk, dv, ctx.kv_heads, mesh, plan)
        return dq, dk, dv, None


def _check_lse_read_alike(mesh: CPMesh, read: bool) -> None:
    """With ``mesh.debug``: every rank's loss reads the returned lse, or none does. A head group sends the lse's
    gradient only when a loss reads it, so ranks that disagree would pair unlike all-to-alls."""
    check_same(
        mesh.check_group,
        {"a loss reads the returned lse": read},
        what="back-propagated through mesh_attn_func(return_lse=True) with and without a loss reading the lse (with "
        "head_parallel > 1 its gradient is exchanged only where one does; add 0 * lse.sum() to the loss of the ranks "
        "that do not read it)",
    )


def _token_shape(shape: torch.Size, u: int, *, tokens_at: int, heads_at: int) -> tuple[int, ...]:
    """The shape in this rank's token layout of a head-layout tensor of ``shape`` (``S / m`` tokens at dim
    ``tokens_at``, ``H / u`` heads at dim ``heads_at``): ``u`` times fewer tokens, ``u`` times more heads."""
    shape = list(shape)
    shape[tokens_at], shape[heads_at] = shape[tokens_at] // u, shape[heads_at] * u
    return tuple(shape)


# Note [Opaque to torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.compile (Dynamo) cannot trace mesh attention: the check of a new call signature gathers it over the CP
# group (mesh_cp.runtime.check) and the schedules post point-to-point and collective communication on process
# groups, whose members Dynamo refuses to read (UnsafeScriptObjectError), around a plan of host-side Python
# objects. So mesh_attn_func is an opaque region: torch.compiler.disable makes Dynamo break the graph at the
# call and run it eagerly, and the code around it is compiled. Autograd is unaffected: MeshAttnFunc records
# its backward as in eager mode, and the compiled backward of the graph after the call hands it the gradient.
@torch.compiler.disable(reason="mesh attention communicates over the CP group; it runs eagerly")
def mesh_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: CPMesh,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    layout: Layout | None = None,
    kernel: KernelName | Literal["auto"] | BlockKernel = "auto",
    schedule: Schedule = "overlap",
    backward: Backward = "regather",
    buffer_budget: int | None = None,
    mask: AttentionMask | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact softmax attention over the whole sequence, from this rank's shard of it.

    Args:
        q: ``(batch, seq_local, heads, head_dim)``, this rank's shard of the queries.
        k, v: ``(batch, seq_local, kv_heads, head_dim)``; ``heads % kv_heads == 0`` (GQA/MQA). K and V
            travel with ``kv_heads`` heads; they are expanded only inside the block kernel.
        mesh: the :class:`CPMesh` the sequence is sharded over (required; there is no default group).
        causal: causal (top-left aligned over global positions) or full attention.
        softmax_scale: scale of ``q k^T``; ``None`` means ``head_dim ** -0.5``.
        return_lse: also return the log-sum-exp of every query row.
        layout: how the global sequence is sharded: ``"zigzag"`` (rank ``g`` holds half-chunks ``g``
            and ``2P-1-g``) or ``"contiguous"`` (rank ``g`` holds chunk ``g``). ``None`` means
            ``"zigzag"`` when causal (balanced work) and ``"contiguous"`` otherwise. Use
            :func:`mesh_cp.shard_sequence` with the same layout to shard inputs.
        kernel: block kernel: ``"auto"``, one of :data:`mesh_cp.kernels.KERNEL_NAMES`, or an object
            implementing :class:`mesh_cp.kernels.BlockKernel`.
        schedule: ``"overlap"`` (p2p rings, transfers overlapped with block compute; see Note
            [Overlapped schedule] in :mod:`mesh_cp.core.schedule`) or ``"collective"`` (all-gather,
            compute, reduce). Both send the same bytes.
        backward: ``"regather"`` gathers Q, dO and K,V again in backward (less memory);
            ``"reuse"`` keeps the chunks gathered in forward (less traffic, more memory).
            :func:`mesh_cp.sim.memory.peak_bytes` reports what each holds.
        buffer_budget: most bytes of Q/KV chunks the overlapped schedule may hold at once
            (``None``: no limit); a budget below what any path needs raises with that minimum.
        mask: packed documents, padding and a left window over the *global* positions of each batch row
            (:class:`mesh_cp.core.masks.AttentionMask`); blocks it empties are skipped, blocks it cuts run as
            varlen calls of their documents or with an explicit mask (Note [Masked blocks]). A query that attends nothing gets 0 and lse ``-inf``.
        softcap: logits ``softcap * tanh(s / softcap)`` (Gemma 2); computed by ``"flash_attn"`` (CUDA) and by the
            reference kernel, tile by tile where ``"auto"`` chose a kernel that cannot; other named kernels
            refuse it.

    Returns:
        ``out`` shaped like ``q`` in ``q.dtype``; with ``return_lse``, ``(out, lse)`` where ``lse`` is
        ``(batch, heads, seq_local)`` in fp32 (fp64 for fp64 inputs). Both are differentiable.
        Outputs, lse and all gradients are accumulated in fp32 whatever the input dtype.

    Under autocast (enabled for the inputs' device type, for example ``torch.autocast("cuda",
    dtype=torch.bfloat16)`` around a model with fp32 weights) it does what autocast does for
    ``scaled_dot_product_attention``: q, k, v (fp16/bf16/fp32) are cast to the autocast dtype, the
    output is in that dtype, and gradients reach the inputs in their own dtypes. Outside autocast, q, k
    and v must share one dtype.

    Collective over ``mesh``: every rank of the CP group calls it with the same shapes, dtype, device
    type and options. That is checked (:func:`mesh_cp.runtime.check.check_same_call`) the first time this rank makes
    a call with new ones, and on every call when ``mesh.debug`` is set; a difference raises
    ``ValueError`` on every rank, naming each rank's value.

    Under ``torch.compile`` the call is an opaque region, run eagerly between the compiled graphs (Note [Opaque
    to torch.compile]).
    """
    _check_arguments(mesh, q, k, v)
    cast_to = autocast_dtype(q.device.type)
    if cast_to is not None:
        q, k, v = autocast_inputs((q, k, v), cast_to)
    options = CallOptions(
        causal=bool(causal),
        return_lse=bool(return_lse),
        layout=("zigzag" if causal else "contiguous") if layout is None else layout,
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None and q.dim() > 0 else softmax_scale,
        kernel=kernel,
        schedule=schedule,
        backward=backward,
        buffer_budget=buffer_budget,
        mask=mask,
        softcap=softcap,
    )
    call = _prepare_call(q, k, v, mesh, options)
    # Under autocast the inputs are cast; autocast must not recast what the kernels compute in fp32.
    with torch.autocast(q.device.type, enabled=False) if cast_to is not None else contextlib.nullcontext():
        return MeshAttnFunc.apply(q, k, v, call)


@dataclass(frozen=True)
class CallOptions:
    """The options of one :func:`mesh_attn_func` call, checked once here (the plan checks what it holds)."""

    causal: bool
    return_lse: bool
    layout: Layout
    softmax_scale: float | None
    kernel: KernelName | Literal["auto"] | BlockKernel
    schedule: Schedule
    backward: Backward
    buffer_budget: int | None
    mask: AttentionMask | None
    softcap: float | None

    def __post_init__(self) -> None:
        for name in ("layout", "schedule", "backward"):
            check_option(name, getattr(self, name))
        positive_or_none("buffer_budget", self.buffer_budget, unit="bytes")
        positive_or_none("softcap", self.softcap)
        if self.softcap is not None:
            object.__setattr__(self, "softcap", float(self.softcap))
            if self.kernel != "auto" and not takes(self.kernel, "softcap"):
                name = self.kernel if isinstance(self.kernel, str) else type(self.kernel).__name__
                raise NotImplementedError(
                    f"kernel {name!r} does not softcap logits; softcap {self.softcap} runs on kernel='flash_attn' "
                    f"(CUDA), 'reference' or 'auto' (which uses the reference kernel tile by tile where the fused "
                    f"kernel cannot)"
                )

    @property
    def kernel_name(self) -> str:
        kernel = self.kernel
        return kernel if isinstance(kernel, str) else getattr(kernel, "name", type(kernel).__qualname__)

    def signature(self, *, debug: bool = False) -> dict[str, object]:
        """The options every rank of the CP group must call with (:func:`mesh_cp.runtime.check.check_same_call`).
        A mask enters by its form (rows, window): its documents change every step of a packed run, and a signature
        new on every step would gather and sync on every step; with ``debug`` its contents are compared too."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        mask = self.mask
        values |= {"kernel": self.kernel_name, "mask": None if mask is None else mask.form()}
        return values | ({"mask contents": None if mask is None else mask.code()} if debug else {})


def _check_arguments(mesh: CPMesh, q: Tensor, k: Tensor, v: Tensor) -> None:
    if not isinstance(mesh, CPMesh):
        raise ValueError(
            f"mesh must be a mesh_cp.CPMesh (build one with CPMesh.create(group, tile=(a, b))), "
            f"got {type(mesh).__name__}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _prepare_call(q: Tensor, k: Tensor, v: Tensor, mesh: CPMesh, options: CallOptions) -> AttentionCall:
    """Check the call across the CP group and plan it (the head exchange and the blocks, one plan).

    The block kernel is resolved before the call check, so a kernel that cannot run on one rank only
    (a flash-attn that fails to import on one node, GPUs of two kinds) raises on every rank.
    """
    try:
        head_dim = q.shape[-1] if q.dim() else None
        needs = (("mask|segments",) if options.mask is not None else ()) + (("softcap",) if options.softcap else ())
        block_kernel = resolve_kernel(options.kernel, q.device, q.dtype, head_dim=head_dim, needs=needs)
        kernel_error = None
    except (ValueError, NotImplementedError, RuntimeError) as err:
        block_kernel, kernel_error = None, err
    block = getattr(block_kernel, "name", None) if kernel_error is None else "cannot run"
    signature = {**_tensor_signature(q, k, v), **options.signature(debug=mesh.debug), "block kernel": block}
    check_same_call(mesh.check_group, signature, debug=mesh.debug)
    if kernel_error is not None:
        raise kernel_error
    plan_options = {
        "causal": options.causal,
        "layout": options.layout,
        "backward": options.backward,
        "schedule": options.schedule,
        "link_cost": mesh.link_cost,
        "buffer_budget": options.buffer_budget,
        "mask": options.mask,
        "head_parallel": mesh.head_parallel,
        "return_lse": options.return_lse,
    }
    plan = make_plan(mesh.tiling, attention_shape(q, k, v), **plan_options)
    partials = row_partials(plan, block_kernel, options.softcap)
    if partials != plan.partials:  # the same blocks and calls, other bytes on the wire
        plan = make_plan(mesh.tiling, attention_shape(q, k, v), **plan_options, partials=partials)
    mask = options.mask
    # Dense masks are built from document ids on the device; a kernel that takes segments (and softcaps, if asked)
    # gets every masked block as varlen sequences and needs none: no copy to the device per packing.
    no_ids = by_segments(block_kernel) and (options.softcap is None or takes(block_kernel, "softcap"))
    doc_ids = None if mask is None or no_ids else document_ids(mask, mask.rows or 1, plan.seq_len, q.device)
    return AttentionCall(
        mesh=mesh,
        plan=plan,
        kernel=block_kernel,
        scale=float(options.softmax_scale),
        lse_grad=options.return_lse,
        softcap=options.softcap,
        doc_ids=doc_ids,
    )


def _tensor_signature(q: Tensor, k: Tensor, v: Tensor) -> dict[str, object]:
    """The shapes, dtypes and device type every rank of the CP group must call with."""
    return {
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "v shape": tuple(v.shape),
        "dtypes": f"{q.dtype}, {k.dtype}, {v.dtype}",
        "device type": q.device.type,
        "requires grad": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    }


def attention_shape(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Validate the local ``q, k, v`` of :func:`mesh_attn_func` and return their plan shape."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_local, heads, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if q.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"dtype {q.dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, seq, heads, dim = q.shape
    kb, kseq, kv_heads, kdim = k.shape
    if (kb, kseq, kdim) != (batch, seq, dim):
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: batch, seq_local and "
            f"head_dim must be equal (only the head count may differ, for GQA/MQA)"
        )
    if min(batch, seq, heads, dim) < 1:
        raise ValueError(f"empty input: q shape {tuple(q.shape)}; every dimension must be at least 1")
    if kv_heads < 1:
        raise ValueError(f"k/v have {kv_heads} heads (shape {tuple(k.shape)}); kv_heads must be at least 1")
    if heads % kv_heads:
        raise ValueError(
            f"q heads {heads} must be a multiple of k/v heads {kv_heads} for GQA/MQA; "
            f"choose kv_heads among the divisors of {heads}"
        )
    return AttentionShape(
        batch=batch, seq_local=seq, heads=heads, kv_heads=kv_heads, head_dim=dim, itemsize=q.element_size()
    )
