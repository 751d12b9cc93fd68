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
from typing import Literal

from mesh_cp.sim.step_attention import attention_buffers, attention_layout
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


def layer_saved_bytes(model: ModelConfig, tokens: int, options: StepOptions) -> int:
    """Bytes one decoder layer saves for backward over ``tokens`` tokens (Note [Whole-step memory model]), its MLP
    run in ``options.mlp_tiles`` slices of the sequence."""
    act = options.act_bytes
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    attention = act * (2 * q + 2 * kv) + 4 * model.heads
    per_qk = act if options.fused_norm else 4 + act  # their outputs go to RoPE, which saves neither
    qk_norms = per_qk * (q + kv) + 4 * (model.heads + model.kv_heads) if model.qk_norm else 0
    first_half = tokens * (_norm_saved(model.hidden, options) + attention + qk_norms)
    return first_half + mlp_saved_bytes(model, tokens, options)


def mlp_saved_bytes(model: ModelConfig, tokens: int, options: StepOptions) -> int:
    """Bytes the second half of a decoder layer saves (its RMSNorm and the gated MLP, one of ``options.mlp_tiles``
    slices of the sequence): what its backward frees before the attention's backward runs."""
    mlp = -(-tokens // options.mlp_tiles) * 4 * options.act_bytes * model.intermediate
    return tokens * _norm_saved(model.hidden, options) + mlp


def _norm_saved(width: int, options: StepOptions) -> int:
    """Bytes per token an RMSNorm over ``width`` saves: transformers' its fp32 input, the normalized value cast
    back, its output (read by the next projections) and the fp32 ``rsqrt`` per token; a fused one
    (``options.fused_norm``) its input, its output and the ``rsqrt``."""
    act = options.act_bytes
    return (2 * act if options.fused_norm else 4 + 2 * act) * width + 4


BACKWARD_HIDDEN = 1.0
"""Hidden-sized temporaries of a layer's backward (the gradient of the residual stream), fitted."""
BACKWARD_MLP = 2.0
"""Intermediate-sized temporaries at the peak of the MLP's backward (the gradients of silu(gate) and up beside the
gradient of their product, which replaced the product), fitted."""


def backward_temporaries(model: ModelConfig, tokens: int, options: StepOptions, *, mlp: bool = True) -> int:
    """Bytes a decoder layer's backward allocates beyond its saved tensors at the peak of its MLP's backward, the
    MLP run in ``options.mlp_tiles`` slices (``mlp=False``: at the peak of its attention's, the attention kernel
    aside)."""
    mlp_part = BACKWARD_MLP * model.intermediate * -(-tokens // options.mlp_tiles) if mlp else 0
    return int(options.act_bytes * (BACKWARD_HIDDEN * model.hidden * tokens + mlp_part))


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
    if options.optimizer_offload:  # the step runs on the CPU
        return 0
    if options.foreach:
        return 4 * model.params // shard
    largest = max(model.vocab * model.hidden, model.intermediate * model.hidden)
    return 2 * 4 * largest // shard


@dataclasses.dataclass(frozen=True)
class _Step:
    """The per-layer quantities the moments add up, for ``tokens`` tokens per rank."""

    model: ModelConfig
    options: StepOptions
    tokens: int

    def grads(self, done_layers: int, params: int = 0) -> int:
        """Gradients of the LM head, ``done_layers`` layers and ``params`` more parameters."""
        head = self.model.vocab * self.model.hidden + self.model.hidden
        count = done_layers * self.model.layer_params + head + params
        return int(count * self.options.bytes_per_param()["gradients"])

    @property
    def saved(self) -> int:
        """What one layer saves (:func:`layer_saved_bytes`)."""
        return layer_saved_bytes(self.model, self.tokens, self.options)

    @property
    def kept(self) -> int:
        """What one layer keeps until its backward: its input under checkpointing, else what it saves."""
        return self.tokens * self.model.hidden * self.options.act_bytes if self.options.checkpointing else self.saved

    def kept_layers(self, count: int) -> int:
        """What ``count`` layers keep on the GPU (one of them when offloaded: the one brought back next)."""
        return self.kept * (min(count, 1) if self.options.offload else count)

    @property
    def recomputed(self) -> int:
        """The layer being recomputed under checkpointing (or run in forward), else nothing."""
        return self.saved if self.options.checkpointing else 0


def _head_moments(step: _Step, attention: tuple[int, int]) -> dict[str, dict[str, int]]:
    """The moments of forward, the loss and the LM head, and the optimizer step (Note [Whole-step memory model])."""
    model, options, tokens, act, layers = (
        step.model,
        step.options,
        step.tokens,
        step.options.act_bytes,
        step.model.layers,
    )
    saved = step.kept_layers(layers) + _norm_saved(model.hidden, options) * tokens  # and the final norm's
    loss_fwd, loss_bwd = loss_bytes(model, tokens, options)
    loss_comm = _comm_bytes(model, options, "loss")
    return {
        "forward of the last layer": {
            "saved activations": step.kept_layers(layers - 1) + step.kept,
            "recomputed layer": step.recomputed,
            "attention buffers": attention[0],
            "communication buffers": _comm_bytes(model, options, "forward"),
        },
        "loss forward": {"saved activations": saved, "logits and loss": loss_fwd, "communication buffers": loss_comm},
        "loss backward": {  # the chunked head's first chunk made the LM head's gradient
            "gradients": step.grads(0) if options.lm_head == "chunked" else 0,
            "saved activations": saved,
            "logits and loss": loss_bwd,
            "communication buffers": loss_comm,
        },
        "LM head backward": {  # the logits' gradient, the LM head's gradient and the hidden states'
            "gradients": step.grads(0),
            "saved activations": saved,
            "logits and loss": (tokens * model.vocab if options.lm_head == "full" else 0) * act,
            "temporaries": tokens * model.hidden * act,
            "communication buffers": loss_comm,
        },
        "optimizer step": {
            "gradients": step.grads(layers),
            "temporaries": _optimizer_temporaries(model, options),
            "communication buffers": _comm_bytes(model, options, "optimizer"),
        },
    }


def _layer_moments(step: _Step, attention: tuple[int, int]) -> dict[str, dict[str, int]]:
    """The peaks of the MLP's and the attention's backward in the top and the bottom layer (the moments between
    are a straight line from one to the other: gradients grow as saved activations shrink)."""
    model, options, layers = step.model, step.options, step.model.layers
    down = model.intermediate * model.hidden  # the MLP's backward peaks after down_proj's
    before_qkv = model.layer_params - model.hidden * (model.heads + 2 * model.kv_heads) * model.head_dim
    second_half = mlp_saved_bytes(model, step.tokens, options)  # freed when the attention's backward runs
    comm = _comm_bytes(model, options, "backward")
    moments = {}
    for i in sorted({layers - 1, 0}, reverse=True):
        common = {"saved activations": step.kept_layers(i) + step.kept, "recomputed layer": step.recomputed}
        moments[f"backward of layer {i}, MLP"] = {
            **common,
            "gradients": step.grads(layers - 1 - i, down),
            "temporaries": backward_temporaries(model, step.tokens, options),
            "communication buffers": comm,
        }
        freed = "recomputed layer" if options.checkpointing else "saved activations"
        moments[f"backward of layer {i}, attention"] = {
            **common,
            freed: common[freed] - second_half,
            "gradients": step.grads(layers - 1 - i, before_qkv),
            "temporaries": backward_temporaries(model, step.tokens, options, mlp=False),
            "attention buffers": attention[1],
            "communication buffers": comm,
        }
    return moments


def _moments(model: ModelConfig, seq: int, options: StepOptions, attention: tuple[int, int]) -> dict[str, dict]:
    """Every moment's parts, the persistent ones (weights, optimizer states) included."""
    step = _Step(model, options, options.batch * seq // options.cp_degree)
    per_param = options.bytes_per_param()
    base = {
        "weights": int(model.params * per_param["weights"]),
        "optimizer states": int(model.params * (per_param["states"] + per_param["master"])),
    }
    moments = _head_moments(step, attention) | _layer_moments(step, attention)
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


def layout_budget(
    model: ModelConfig, seq: int, options: StepOptions, budget: int | None, *, topology: Topology | None = None
) -> Literal["least"] | None:
    """The attention's ``memory_budget`` for :func:`attention_buffers` under a step budget of ``budget`` bytes per
    GPU: ``None`` (the fastest layout) when its step fits or with no budget, else ``"least"`` (the layout of least
    attention memory)."""
    if budget is None or options.cp_degree == 1:
        return None
    attention = attention_buffers(model, seq, options, topology=topology)
    return None if step_memory(model, seq, options, attention=attention).peak <= budget else "least"


def seq_unit(options: StepOptions) -> int:
    """The step of :func:`longest_seq`'s search: the least multiple of ``2 * cp`` (the zig-zag layout) that is at
    least 1024 tokens."""
    unit = 2 * options.cp_degree
    return unit * -(-1024 // unit)


def longest_seq(
    model: ModelConfig,
    options: StepOptions,
    budget: int,
    *,
    memory: Callable[[int], StepMemory] | None = None,
    limit: int = 2**34,
) -> int:
    """The longest sequence (a multiple of :func:`seq_unit`) whose peak fits ``budget`` bytes per GPU; 0 when not
    even one unit does. ``memory(seq)`` defaults to :func:`step_memory`; the peak grows with
    ``seq``, so a bisection finds it."""
    unit = seq_unit(options)
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
    "attention_layout",
    "backward_temporaries",
    "layer_saved_bytes",
    "layout_budget",
    "mlp_saved_bytes",
    "longest_seq",
    "seq_unit",
    "loss_bytes",
    "step_memory",
]
