"""What a training step runs: the model's sizes (:class:`ModelConfig`, with named presets) and how the step runs
(:class:`StepOptions`: GPUs and layout, sharding, precision, checkpointing, offload, LM head). Pure Python; the memory
model over them is :mod:`mesh_cp.sim.step`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

Sharding = Literal["replicated", "fsdp2", "zero1", "zero2", "zero3"]
SHARDINGS: tuple[str, ...] = ("replicated", "fsdp2", "zero1", "zero2", "zero3")
LmHead = Literal["full", "chunked"]
LM_HEADS: tuple[str, ...] = ("full", "chunked")
Precision = Literal["mixed", "fp32"]
PRECISIONS: tuple[str, ...] = ("mixed", "fp32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The sizes of a decoder-only transformer that set its memory (a Llama/Qwen-style layer: RMSNorm, GQA
    attention with RoPE, gated MLP)."""

    name: str
    """A label for tables."""
    hidden: int
    """``hidden_size``."""
    intermediate: int
    """``intermediate_size`` of the gated MLP."""
    layers: int
    """``num_hidden_layers``."""
    heads: int
    """``num_attention_heads``."""
    kv_heads: int
    """``num_key_value_heads``."""
    head_dim: int
    """``head_dim`` (``hidden / heads`` when the config has none)."""
    vocab: int
    """``vocab_size``."""
    tied: bool = False
    """``tie_word_embeddings``: the LM head shares the embedding's weight."""
    qk_norm: bool = False
    """RMSNorm on q and k per head (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def head_params(self) -> int:
        """Parameters outside the layers: the embedding, the LM head unless tied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        """Every parameter of the model."""
        return self.layers * self.layer_params + self.head_params

    @classmethod
    def from_hf(cls, config: Mapping, *, name: str = "config.json") -> ModelConfig:
        """The sizes of a transformers ``config.json`` (a dict); ``ValueError`` naming a missing key."""
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in config]  # fmt: skip
        if missing:
            raise ValueError(f"{name} has no {', '.join(missing)}; pass a decoder-only causal LM's config.json")
        heads = config["num_attention_heads"]
        model_type = str(config.get("model_type", ""))
        return cls(
            name=name,
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type.startswith("qwen3"),
            qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        )

    @classmethod
    def load(cls, spec: str) -> ModelConfig:
        """A preset name (:data:`MODEL_PRESETS`) or the path of a transformers ``config.json``."""
        if spec in MODEL_PRESETS:
            return MODEL_PRESETS[spec]
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(sorted(MODEL_PRESETS))}) nor a file")
        return cls.from_hf(json.loads(path.read_text()), name=path.name)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": ModelConfig(name="qwen3-8b", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                            head_dim=128, vocab=151936, qk_norm=True),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama-3-8b": ModelConfig(name="llama-3-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                              head_dim=128, vocab=128256),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": ModelConfig(name="llama-3.1-70b", hidden=8192, intermediate=28672, layers=80, heads=64,
                                 kv_heads=8, head_dim=128, vocab=128256),
}  # fmt: skip
"""Named models: their ``config.json`` sizes (the source of each is the URL above it)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How a training step runs: the GPUs and their layout, sharding, precision, checkpointing, the LM head.

    Precision ``"mixed"``: bf16 activations; replicated and ZeRO keep bf16 weights and gradients, fp32 master
    weights and AdamW's two fp32 states (2 + 2 + 4 + 8 = 16 bytes per parameter); FSDP2 keeps fp32 sharded weights
    and gradients and the two states (4 + 4 + 8 = 16) and all-gathers bf16 copies layer by layer. ``"fp32"``: every
    tensor fp32 (4 + 4 + 8 = 16 bytes per parameter; the CPU calibration runs this)."""

    gpus: int = 1
    """GPUs in the job (``dp_shard x cp``); the sharding runs over all of them."""
    cp: int | None = None
    """Context-parallel degree: ranks that share one sequence (``None``: all ``gpus``)."""
    sharding: Sharding = "fsdp2"
    """``replicated`` (DDP), ``fsdp2`` (weights, grads and states sharded), ``zero1``/``zero2``/``zero3``."""
    precision: Precision = "mixed"
    """``mixed`` (bf16 compute, fp32 states) or ``fp32``."""
    checkpointing: bool = True
    """Activation checkpointing of every decoder layer (its input kept, the layer recomputed in backward)."""
    offload: bool = False
    """Saved activations offloaded to host memory: two layers' worth stay on the GPU (one copied out, one in)."""
    lm_head: LmHead = "full"
    """``full``: transformers' loss, [T, V] logits upcast to fp32; ``chunked``: the LM head and the loss over
    ``lm_head_chunk`` tokens at a time, recomputed in backward (never holds [T, V]; TRL's and Liger's fused LM
    heads are of this kind)."""
    lm_head_chunk: int = 4096
    """Tokens per chunk of the chunked LM head."""
    batch: int = 1
    """Sequences per micro-batch (per CP group)."""
    foreach: bool = True
    """AdamW's foreach implementation (torch's default on GPUs): one fp32 copy of the states' size as temporary;
    ``False`` (the default on CPU): one parameter at a time."""
    mlp_tiles: int = 1
    """The MLP run over this many slices of the sequence, each recomputed in backward (ALST's tiled MLP): its saved
    tensors and backward temporaries are one slice's."""
    fused_norm: bool = False
    """A fused RMSNorm kernel (Liger's): saves its input and the per-token ``rsqrt``, not transformers' fp32 copies."""
    optimizer_offload: bool = False
    """AdamW's states and master weights in host memory, its step on the CPU (ZeRO-Offload)."""

    def __post_init__(self) -> None:
        for name, allowed in (("sharding", SHARDINGS), ("lm_head", LM_HEADS), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"StepOptions.{name} {getattr(self, name)!r} is not one of {list(allowed)}")
        for name in ("gpus", "lm_head_chunk", "batch", "mlp_tiles"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.cp is not None and self.cp < 1:
            raise ValueError(f"StepOptions.cp must be >= 1 (or None: every GPU), got {self.cp}")
        if self.gpus % self.cp_degree:
            raise ValueError(f"cp {self.cp} must divide gpus {self.gpus}; the layout is dp_shard x cp")

    @property
    def cp_degree(self) -> int:
        """The context-parallel degree (``cp``, or every GPU)."""
        return self.gpus if self.cp is None else self.cp

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation element."""
        return 4 if self.precision == "fp32" else 2

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes per parameter per GPU of weights, gradients, master weights, optimizer states (after sharding)."""
        n, fsdp = self.gpus, self.sharding in ("fsdp2", "zero3")
        w, g, m = (4, 4, 0) if self.precision == "fp32" or self.sharding == "fsdp2" else (2, 2, 4)
        on_gpu = 0 if self.optimizer_offload else 1
        return {
            "weights": w / n if fsdp else w,
            "gradients": g / n if fsdp or self.sharding == "zero2" else g,
            "master": on_gpu * (m if self.sharding == "replicated" else m / n),
            "states": on_gpu * (8 if self.sharding == "replicated" else 8 / n),
        }
