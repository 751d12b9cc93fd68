"""Lightning attention (MiniMax's ``MiniMaxLightningAttention``): linear attention with a per-head decay, scanned in
blocks (Note [Mixer cores] in :mod:`mesh_cp.integrations.hf.hybrid`). ``qkv_proj`` holds ``[q k v]`` per head; the
decays are buffers per head (they depend on the layer's index, sliced, not recomputed); the core ends at the norm
over all heads, and the output gate reads the hidden states, so both stay per token."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, index, share, span, split_reason


def _heads(layer, world: int) -> str | None:
    return split_reason("heads", layer.num_attention_heads, world)


def _mine(layer, world: int, rank: int) -> range:
    return share(layer.num_attention_heads, world, rank)


def _qkv(layer, world: int, rank: int) -> list[int]:
    width = 3 * layer.head_dim
    return [c for h in _mine(layer, world, rank) for c in span(h * width, width)]


def _gate(layer, world: int, rank: int) -> list[int]:
    return []  # computed per token for the tail, never sent


def _attributes(layer, world: int) -> dict[str, Any]:
    return {"num_attention_heads": layer.num_attention_heads // world}


def _parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    heads = index(_mine(layer, world, rank), layer.slope_rate)
    return {
        "slope_rate": layer.slope_rate.index_select(0, heads),
        "query_decay": layer.query_decay.index_select(0, heads),
        "key_decay": layer.key_decay.index_select(0, heads),
        "diagonal_decay": layer.diagonal_decay.index_select(1, heads),
    }


def _outputs(layer, world: int, rank: int) -> list[int]:
    return [c for h in _mine(layer, world, rank) for c in span(h * layer.head_dim, layer.head_dim)]


def _tail(layer, core: Tensor, projections: dict[str, Tensor]) -> tuple[Tensor, None]:
    gated = projections["output_gate"].sigmoid() * layer.norm(core)
    return layer.out_proj(gated), None  # the layer returns (output, its linear state): no state is kept


LIGHTNING = MixerSpec(
    family="lightning attention (MiniMax)",
    heads=_heads,
    entries={"qkv_proj": _qkv, "output_gate": _gate},
    attributes=_attributes,
    parameters=_parameters,
    exit="norm",
    outputs=_outputs,
    tail=_tail,
    width=lambda layer: layer.num_attention_heads * layer.head_dim,
    call=lambda core, x: core.forward(x, None, None),
)

SPECS: dict[str, MixerSpec] = {"MiniMaxLightningAttention": LIGHTNING}
