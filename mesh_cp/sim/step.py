"""The memory of a whole training step per GPU: weights, gradients, optimizer states, saved activations, the
recomputed layer, logits and loss, attention and communication buffers (pure Python, no torch).

::

    model = ModelConfig.preset("qwen3-8b")
    options = StepOptions(gpus=8, cp=8, sharding="fsdp2", lm_head="chunked")
    memory = step_memory(model, 1_048_576, options)        # memory.peak, memory.parts, memory.moment
    seq = longest_seq(model, options, budget=80 * 10**9)    # the longest sequence whose peak fits

Note [Whole-step memory model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step's peak is the largest of a few moments, each a sum of parts (T = tokens per rank, ``batch * seq / cp``;
``a`` = bytes of an activation element; ``[x]`` elements of a tensor):

    persistent   weights + optimizer states (+ fp32 master weights): held across steps; grads are set to None
    loss fwd     + saved activations of every layer + the loss stage's forward ([T, V] logits, their fp32 copy,
                   log_softmax's output; a chunk's with the chunked LM head)
    loss bwd     + saved activations + three fp32 [T, V] (log_softmax's output, nll's gradient, its own gradient)
                   + the LM head's and the final norm's gradients
    layer i MLP  + gradients of the layers above i and of layer i + saved activations of the layers below i
                   (checkpointing: their inputs only) + layer i's saved activations (recomputed under
                   checkpointing) + the MLP backward's temporaries + communication buffers
    layer i attn the same less what the layer's second half (norm, MLP) saved, with the attention's backward
                   buffers in place of the MLP's temporaries
    optimizer    + every gradient + the optimizer's temporaries

A layer saves, per token (HF Llama/Qwen decoder layer; autograd keeps only what a backward formula reads): each
RMSNorm ``4 + 2a`` bytes per hidden element (its fp32 input, the normalized value cast back, its output read by
the next projections); attention ``2a`` per query element (rotated q, the kernel's output, laid out as
[T, heads, head_dim] so the transpose before ``o_proj`` copies nothing) + ``2a`` per K/V element (rotated k, v) + the fp32 lse per head; q/k norms (Qwen3) ``4 + a`` per q/k element; the
MLP ``4a`` per intermediate element (gate, silu(gate), up, their product). RoPE saves no q or k (its cos/sin need no
gradient). Checkpointing keeps each layer's input (``a`` per hidden element) and recomputes one layer at a time in
backward. The constants of the backward temporaries were fitted to CPU peaks of transformers models (fp32,
tests/sim/test_step_memory.py); the GPU-side parts (communication buffers, offload, bf16 upcasts) follow the same
accounting but are not measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mesh_cp.core import AttentionPlan, AttentionShape
from mesh_cp.sim.choice import choose, plan_for_topology
from mesh_cp.sim.memory import Backend, peak_bytes
from mesh_cp.sim.step_config import MODEL_PRESETS, ModelConfig, StepOptions
from mesh_cp.sim.topology import Topology

PARTS: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer states",
    "saved activations",
    "recomputed layer",
    "temporaries",
    "logits and loss",
    "attention buffers",
    "communication buffers",
)
"""The parts of :attr:`StepMemory.parts`, in table order."""

DEEPSPEED_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements), the ZeRO-1/2 buffers."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The per-GPU memory of a training step at its peak."""

    tokens: int
    """Tokens per rank (``batch * seq / cp``)."""
    parts: dict[str, int]
    """Bytes of each part of :data:`PARTS` at the peak moment."""
    moment: str
    """When the peak happens (``"loss backward"``, ``"backward of layer 35"``, ...)."""
    moments: dict[str, int]
    """The total bytes of every moment the model considers (Note [Whole-step memory model])."""

    @property
    def peak(self) -> int:
        """Bytes per GPU at the peak."""
        return sum(self.parts.values())


def layer_saved_bytes(model: ModelConfig, tokens: int, act: int) -> int:
    """Bytes one decoder layer saves for backward over ``tokens`` tokens, ``act`` bytes per activation
    (Note [Whole-step memory model])."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    attention = act * (2 * q + 2 * kv) + 4 * model.heads
    qk_norms = (4 + act) * (q + kv) + 4 * (model.heads + model.kv_heads) if model.qk_norm else 0
    return tokens * (_norm_saved(model, act) + attention + qk_norms) + mlp_saved_bytes(model, tokens, act)


def mlp_saved_bytes(model: ModelConfig, tokens: int, act: int) -> int:
    """Bytes the second half of a decoder layer saves (its RMSNorm and the gated MLP): what its backward frees
    before the attention's backward runs."""
    return tokens * (_norm_saved(model, act) + 4 * act * model.intermediate)


def _norm_saved(model: ModelConfig, act: int) -> int:
    """Bytes per token an RMSNorm over the hidden size saves: its fp32 input, the normalized value cast back, its
    output (read by the next projections), the fp32 ``rsqrt`` per token."""
    return (4 + 2 * act) * model.hidden + 4


BACKWARD_HIDDEN = 1.0
"""Hidden-sized temporaries of a layer's backward (the gradient of the residual stream), fitted."""
BACKWARD_MLP = 2.0
"""Intermediate-sized temporaries at the peak of the MLP's backward (the gradients of silu(gate) and up beside the
gradient of their product, which replaced the product), fitted."""
ATTENTION_KERNEL = 1.15
"""One-device attention backward: multiples of dq + dk + dv (the kernel's gradients and temporaries), fitted."""


def backward_temporaries(model: ModelConfig, tokens: int, act: int, *, mlp: bool = True) -> int:
    """Bytes a decoder layer's backward allocates beyond its saved tensors at the peak of its MLP's backward
    (``mlp=False``: of its attention's, the attention kernel aside)."""
    return int(tokens * act * (BACKWARD_HIDDEN * model.hidden + (BACKWARD_MLP * model.intermediate if mlp else 0)))


def loss_bytes(model: ModelConfig, tokens: int, options: StepOptions) -> tuple[int, int]:
    """Bytes of the loss stage ``(forward, backward)``: with the full LM head the [T, V] logits, their fp32 copy
    and log_softmax's output in forward, three fp32 [T, V] in backward; a chunk's with the chunked head, whose
    backward adds the fp32 gradient of the hidden states (one per chunk slice and their sum)."""
    act, upcast = options.act_bytes, 0 if options.act_bytes == 4 else 4
    rows = tokens if options.lm_head == "full" else min(tokens, options.lm_head_chunk)
    forward = rows * model.vocab * (act + upcast + 4)
    backward = rows * model.vocab * 12
    if options.lm_head == "chunked":
        backward += 2 * tokens * model.hidden * act
    return forward, backward


def attention_buffers(
    model: ModelConfig,
    seq: int,
    options: StepOptions,
    *,
    topology: Topology | None = None,
    backend: Backend = "nccl",
    memory_budget: int | None = None,
) -> tuple[int, int]:
    """Bytes the attention allocates ``(forward, backward)`` beyond its inputs and saved tensors on one rank.

    One rank (``cp == 1``): the kernel's backward gradients and temporaries (:data:`ATTENTION_KERNEL` times dq, dk,
    dv). CP: :func:`mesh_cp.sim.memory.peak_bytes` on rank 0 of the layout :func:`mesh_cp.sim.choose` picks on
    ``topology`` (default the ``h100`` preset) for ``seq / cp`` tokens per rank within ``memory_budget`` bytes of
    attention memory (``None``: the fastest)."""
    act, cp = options.act_bytes, options.cp_degree
    if cp == 1:
        dqkv = seq * options.batch * (model.heads + 2 * model.kv_heads) * model.head_dim * act
        return 0, int(ATTENTION_KERNEL * dqkv)
    shape = AttentionShape(options.batch, seq // cp, model.heads, model.kv_heads, model.head_dim, act)
    plan = attention_plan(cp, shape, topology or Topology.preset("h100", head_dim=model.head_dim), memory_budget)
    return peak_bytes(plan, "forward", backend=backend), peak_bytes(plan, "backward", backend=backend)


def attention_plan(
    cp: int, shape: AttentionShape, topology: Topology, memory_budget: int | None = None
) -> AttentionPlan:
    """The plan of the layout :func:`mesh_cp.sim.choose` picks for ``shape`` (per-rank sizes) on ``cp`` ranks."""
    u, tiling, _ = choose(cp, shape, topology, memory_budget=memory_budget)
    return plan_for_topology(u, tiling, shape, topology)


def _comm_bytes(model: ModelConfig, options: StepOptions, phase: str) -> int:
    """Communication buffers per GPU in ``phase`` (``"forward"``, ``"loss"``, ``"backward"``, ``"optimizer"``).

    FSDP2 / ZeRO-3: the root's gathered embedding and LM head (FSDP2 keeps the root unsharded from forward to
    backward), two gathered layers (the one computing, the one prefetched) and in backward the layer's unsharded
    gradients and their fp32 reduce-scatter input. ZeRO-1/2: DeepSpeed's two default buckets
    (:data:`DEEPSPEED_BUCKET` elements each). Replicated: DDP's buckets, one copy of the gradients (unless
    ``gradient_as_bucket_view=True``). One GPU: none."""
    if options.gpus == 1:
        return 0
    act, layer = options.act_bytes, model.layer_params
    if options.sharding in ("fsdp2", "zero3"):
        root = model.head_params * act if phase != "optimizer" else 0
        layers = {"forward": 2 * layer * act, "backward": 2 * layer * act + layer * (act + 4)}.get(phase, 0)
        return root + layers
    if options.sharding in ("zero1", "zero2"):
        return 2 * min(DEEPSPEED_BUCKET, model.params) * act if phase in ("backward", "optimizer") else 0
    return int(model.params * options.bytes_per_param()["gradients"]) if phase in ("backward", "optimizer") else 0


def _optimizer_temporaries(model: ModelConfig, options: StepOptions) -> int:
    """AdamW's temporaries: foreach, one fp32 copy of the (sharded) states' size (``_foreach_sqrt`` of the second
    moments); one tensor at a time, two fp32 copies of the largest parameter (its sqrt and the division)."""
    shard = 1 if options.sharding == "replicated" else options.gpus
    if options.foreach:
        return 4 * model.params // shard
    largest = max(model.vocab * model.hidden, model.intermediate * model.hidden)
    return 2 * 4 * largest // shard


def _moments(model: ModelConfig, seq: int, options: StepOptions, attention: tuple[int, int]) -> dict[str, dict]:
    """Every moment's parts (Note [Whole-step memory model])."""
    act, layers, tokens = options.act_bytes, model.layers, options.batch * seq // options.cp_degree
    per_param = options.bytes_per_param()
    base = {
        "weights": int(model.params * per_param["weights"]),
        "optimizer states": int(model.params * (per_param["states"] + per_param["master"])),
    }

    def grads(done_layers: int, params: int = 0) -> int:
        """Gradients of the LM head, ``done_layers`` layers and ``params`` more parameters."""
        head = model.vocab * model.hidden + model.hidden
        return int((done_layers * model.layer_params + head + params) * per_param["gradients"])

    down = model.intermediate * model.hidden  # the MLP's backward peaks after down_proj's
    before_qkv = model.layer_params - model.hidden * (model.heads + 2 * model.kv_heads) * model.head_dim

    saved = layer_saved_bytes(model, tokens, act)
    kept = tokens * model.hidden * act if options.checkpointing else saved  # per layer, until its backward

    def kept_layers(count: int) -> int:
        return kept * (min(count, 1) if options.offload else count)

    final_norm = (4 + 2 * act) * tokens * model.hidden
    loss_fwd, loss_bwd = loss_bytes(model, tokens, options)
    recomputed = saved if options.checkpointing else 0  # the layer in forward or backward, under checkpointing
    moments = {
        "forward of the last layer": {
            "saved activations": kept_layers(layers - 1) + kept,
            "recomputed layer": recomputed,
            "attention buffers": attention[0],
            "communication buffers": _comm_bytes(model, options, "forward"),
        },
        "loss forward": {
            "saved activations": kept_layers(layers) + final_norm,
            "logits and loss": loss_fwd,
            "communication buffers": _comm_bytes(model, options, "loss"),
        },
        "loss backward": {  # the chunked head's first chunk made the LM head's gradient
            "gradients": grads(0) if options.lm_head == "chunked" else 0,
            "saved activations": kept_layers(layers) + final_norm,
            "logits and loss": loss_bwd,
            "communication buffers": _comm_bytes(model, options, "loss"),
        },
        "LM head backward": {  # the logits' gradient, the LM head's gradient and the hidden states'
            "gradients": grads(0),
            "saved activations": kept_layers(layers) + final_norm,
            "logits and loss": (tokens * model.vocab if options.lm_head == "full" else 0) * act,
            "temporaries": tokens * model.hidden * act,
            "communication buffers": _comm_bytes(model, options, "loss"),
        },
        "optimizer step": {
            "gradients": grads(layers),
            "temporaries": _optimizer_temporaries(model, options),
            "communication buffers": _comm_bytes(model, options, "optimizer"),
        },
    }
    second_half = mlp_saved_bytes(model, tokens, act)  # freed when the attention's backward runs
    for i in {layers - 1, 0}:
        common = {"saved activations": kept_layers(i) + kept, "recomputed layer": recomputed}
        moments[f"backward of layer {i}, MLP"] = {
            **common,
            "gradients": grads(layers - 1 - i, down),
            "temporaries": backward_temporaries(model, tokens, act),
            "communication buffers": _comm_bytes(model, options, "backward"),
        }
        freed = "recomputed layer" if options.checkpointing else "saved activations"
        moments[f"backward of layer {i}, attention"] = {
            **common,
            freed: common[freed] - second_half,
            "gradients": grads(layers - 1 - i, before_qkv),
            "temporaries": backward_temporaries(model, tokens, act, mlp=False),
            "attention buffers": attention[1],
            "communication buffers": _comm_bytes(model, options, "backward"),
        }
    return {name: {part: base.get(part, 0) + parts.get(part, 0) for part in PARTS} for name, parts in moments.items()}


def step_memory(
    model: ModelConfig, seq: int, options: StepOptions, *, attention: tuple[int, int] | None = None
) -> StepMemory:
    """The per-GPU memory of one training step on sequences of ``seq`` tokens (Note [Whole-step memory model]).

    ``attention``: the attention's ``(forward, backward)`` buffers in bytes (default :func:`attention_buffers`).
    Returns the parts at the peak moment, that moment, and every moment's total."""
    cp = options.cp_degree
    if seq < 1 or (cp > 1 and seq % (2 * cp)):
        raise ValueError(f"seq {seq} must be a positive multiple of 2 * cp = {2 * cp} (zig-zag); pad it")
    if attention is None:
        attention = attention_buffers(model, seq, options)
    moments = _moments(model, seq, options, attention)
    peak = max(moments, key=lambda name: sum(moments[name].values()))
    totals = {name: sum(parts.values()) for name, parts in moments.items()}
    return StepMemory(options.batch * seq // cp, moments[peak], peak, totals)


def longest_seq(
    model: ModelConfig,
    options: StepOptions,
    budget: int,
    *,
    memory: Callable[[int], StepMemory] | None = None,
    limit: int = 2**34,
) -> int:
    """The longest sequence (a multiple of ``2 * cp``, or of 1024 on one rank) whose peak fits ``budget`` bytes per
    GPU; 0 when not even the shortest does. ``memory(seq)`` defaults to :func:`step_memory`; the peak grows with
    ``seq``, so a bisection finds it."""
    unit = 2 * options.cp_degree if options.cp_degree > 1 else 1024
    unit = unit * max(1, 1024 // unit)  # whole multiples of 1024 tokens where the layout allows
    measure = memory or (lambda seq: step_memory(model, seq, options))
    if measure(unit).peak > budget:
        return 0
    low, high = 1, 2
    while high * unit <= limit and measure(high * unit).peak <= budget:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if measure(mid * unit).peak <= budget else (low, mid)
    return low * unit


__all__ = [
    "MODEL_PRESETS",
    "PARTS",
    "ModelConfig",
    "StepMemory",
    "StepOptions",
    "attention_buffers",
    "attention_plan",
    "backward_temporaries",
    "layer_saved_bytes",
    "mlp_saved_bytes",
    "longest_seq",
    "loss_bytes",
    "step_memory",
]
