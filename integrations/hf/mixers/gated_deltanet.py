"""Gated DeltaNet layers (Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's ``Qwen3_5GatedDeltaNet`` and
``Qwen3_5MoeGatedDeltaNet``, OLMo Hybrid's ``OlmoHybridGatedDeltaNet``): the delta rule per value head, key heads
shared by groups of value heads (value head ``h`` reads key head ``h // (value heads / key heads)``), so a rank's
value heads read one key head or a contiguous share of them (Note [Mixer cores] in
:mod:`mesh_cp.integrations.hf.hybrid`). The layers differ in how their input projections are split."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mesh_cp.integrations.hf.mixer_spec import MixerSpec, grouped_reason, groups_of, index, share, span

# Gated DeltaNet (Qwen3-Next): in_proj_qkvz grouped per key head [q k v z], in_proj_ba per key head [b a];
# conv over cat(q, k, v) channels; the delta rule per value head; exit: norm(core, z); then out_proj.


def _gdn_heads(layer, world: int) -> str | None:
    return grouped_reason("key heads", layer.num_k_heads, "value heads", layer.num_v_heads, world)


def _gdn_key_heads(layer, world: int, rank: int) -> range:
    return groups_of(layer.num_k_heads, layer.num_v_heads, world, rank)


def _gdn_value_heads(layer, world: int, rank: int) -> range:
    return share(layer.num_v_heads, world, rank)


def _gdn_per_group(layer, world: int, rank: int) -> tuple[int, int]:
    """(value heads per key head in the layer, in the rank's core)."""
    ratio = layer.num_v_heads // layer.num_k_heads
    return ratio, (layer.num_v_heads // world) // len(_gdn_key_heads(layer, world, rank))


def _gdn_qkvz(layer, world: int, rank: int) -> list[int]:
    dk, dv = layer.head_k_dim, layer.head_v_dim
    ratio, mine = _gdn_per_group(layer, world, rank)
    group_width = 2 * dk + 2 * ratio * dv
    values = set(_gdn_value_heads(layer, world, rank))
    out = []
    for g in _gdn_key_heads(layer, world, rank):
        base = g * group_width
        out += span(base, 2 * dk)  # q, k
        for j in range(ratio):
            if g * ratio + j in values:
                out += span(base + 2 * dk + j * dv, dv)
        out += [-1] * (mine * dv)  # z: a gate of the norm, the exit's second argument
    return out


def _gdn_ba(layer, world: int, rank: int) -> list[int]:
    ratio, _ = _gdn_per_group(layer, world, rank)
    values = set(_gdn_value_heads(layer, world, rank))
    out = []
    for g in _gdn_key_heads(layer, world, rank):
        for part in range(2):  # b, a
            out += [g * 2 * ratio + part * ratio + j for j in range(ratio) if g * ratio + j in values]
    return out


def _gdn_conv_channels(layer, world: int, rank: int) -> list[int]:
    dk, dv = layer.head_k_dim, layer.head_v_dim
    keys = _gdn_key_heads(layer, world, rank)
    q = [c for g in keys for c in span(g * dk, dk)]
    k = [layer.key_dim + c for c in q]
    v = [2 * layer.key_dim + c for h in _gdn_value_heads(layer, world, rank) for c in span(h * dv, dv)]
    return q + k + v


def _gdn_attributes(layer, world: int) -> dict[str, Any]:
    keys = len(_gdn_key_heads(layer, world, 0))
    values = layer.num_v_heads // world
    key_dim, value_dim = keys * layer.head_k_dim, values * layer.head_v_dim
    return {
        "num_k_heads": keys,
        "num_v_heads": values,
        "key_dim": key_dim,
        "value_dim": value_dim,
        "conv_dim": 2 * key_dim + value_dim,
    }


def _gdn_parameters(layer, world: int, rank: int) -> dict[str, Tensor]:
    heads = index(_gdn_value_heads(layer, world, rank), layer.A_log)
    conv = index(_gdn_conv_channels(layer, world, rank), layer.A_log)
    params = {
        "conv1d.weight": layer.conv1d.weight.index_select(0, conv),
        "A_log": layer.A_log.index_select(0, heads),
        "dt_bias": layer.dt_bias.index_select(0, heads),
    }
    if layer.conv1d.bias is not None:
        params["conv1d.bias"] = layer.conv1d.bias.index_select(0, conv)
    return params


def _gdn_outputs(layer, world: int, rank: int) -> list[int]:
    dv = layer.head_v_dim
    return [c for h in _gdn_value_heads(layer, world, rank) for c in span(h * dv, dv)]


def _gdn_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    *_, z, _, _ = layer.fix_query_key_value_ordering(projections["in_proj_qkvz"], projections["in_proj_ba"])
    dv = layer.head_v_dim
    normed = layer.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return layer.out_proj(normed.reshape(core.shape))


QWEN3_NEXT_GDN = MixerSpec(
    family="Gated DeltaNet (Qwen3-Next)",
    heads=_gdn_heads,
    entries={"in_proj_qkvz": _gdn_qkvz, "in_proj_ba": _gdn_ba},
    attributes=_gdn_attributes,
    parameters=_gdn_parameters,
    exit="norm",
    outputs=_gdn_outputs,
    tail=_gdn_tail,
    width=lambda layer: layer.value_dim,
)


# Qwen3.5 (dense and MoE): in_proj_qkv -> [q (key_dim) | k (key_dim) | v (value_dim)], the conv's channels as they
# are; in_proj_z -> z per value head; in_proj_b, in_proj_a -> one channel per value head; exit: norm(core, z).


def _gdn_heads_channels(layer, world: int, rank: int) -> list[int]:
    """One channel per value head (b, a): this rank's value heads."""
    return list(_gdn_value_heads(layer, world, rank))


def _gdn_gate_placeholder(layer, world: int, rank: int) -> list[int]:
    """The norm's gate, per value head: the core passes it to the exit only, so nothing of it is sent."""
    return [-1] * (layer.num_v_heads // world * layer.head_v_dim)


def _qwen3_5_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    """The layer's output on this rank's tokens: out_proj(norm(core, z)) per value head."""
    dv = layer.head_v_dim
    normed = layer.norm(core.reshape(-1, dv), projections["in_proj_z"].reshape(-1, dv))
    return layer.out_proj(normed.reshape(core.shape))


QWEN3_5_GDN = MixerSpec(
    family="Gated DeltaNet (Qwen3.5)",
    heads=_gdn_heads,
    entries={
        "in_proj_qkv": _gdn_conv_channels,
        "in_proj_z": _gdn_gate_placeholder,
        "in_proj_b": _gdn_heads_channels,
        "in_proj_a": _gdn_heads_channels,
    },
    attributes=_gdn_attributes,
    parameters=_gdn_parameters,
    exit="norm",
    outputs=_gdn_outputs,
    tail=_qwen3_5_tail,
    width=lambda layer: layer.value_dim,
)


# OLMo Hybrid: q_proj, k_proj (key_dim), v_proj (value_dim) concatenated into the conv's channels; b_proj, a_proj
# one channel per value head; g_proj the norm's gate per value head; exit: o_norm(core, gate); then o_proj.


def _olmo_keys(layer, world: int, rank: int) -> list[int]:
    """The channels of this rank's key heads in q_proj or k_proj (``key_dim`` wide)."""
    dk = layer.head_k_dim
    return [c for g in _gdn_key_heads(layer, world, rank) for c in span(g * dk, dk)]


def _olmo_tail(layer, core: Tensor, projections: dict[str, Tensor]) -> Tensor:
    """The layer's output on this rank's tokens: o_proj(o_norm(core, g_proj(x))) per value head."""
    dv = layer.head_v_dim
    normed = layer.o_norm(core.reshape(-1, dv), projections["g_proj"].reshape(-1, dv))
    return layer.o_proj(normed.reshape(core.shape))


OLMO_HYBRID_GDN = MixerSpec(
    family="Gated DeltaNet (OLMo Hybrid)",
    heads=_gdn_heads,
    entries={
        "q_proj": _olmo_keys,
        "k_proj": _olmo_keys,
        "v_proj": _gdn_outputs,
        "b_proj": _gdn_heads_channels,
        "a_proj": _gdn_heads_channels,
        "g_proj": _gdn_gate_placeholder,
    },
    attributes=_gdn_attributes,
    parameters=_gdn_parameters,
    exit="o_norm",
    outputs=_gdn_outputs,
    tail=_olmo_tail,
    width=lambda layer: layer.value_dim,
)


SPECS: dict[str, MixerSpec] = {
    "Qwen3NextGatedDeltaNet": QWEN3_NEXT_GDN,
    "Qwen3_5GatedDeltaNet": QWEN3_5_GDN,
    "Qwen3_5MoeGatedDeltaNet": QWEN3_5_GDN,
    "OlmoHybridGatedDeltaNet": OLMO_HYBRID_GDN,
}
