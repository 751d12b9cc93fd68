"""Bytes per rank of each layer kind of hybrid models under mesh_cp: the head-parallel exchange of every mixer layer
(Note [Head-parallel mixers]) against the attention layer's traffic (the ring's, and the layout the cost model
chooses), forward + backward, at one P and sequence length. The models are transformers' default configs of each
family (the flagship checkpoint's shape), built on the meta device (nothing is allocated); ``--config`` reads a
``config.json`` instead. Prints a Markdown table, and for each model the ``mesh-cp plan`` command whose ``--mixer``
rows show the same.

    .venv/bin/python scripts/mixer_traffic.py --world 8 --seq 131072
    .venv/bin/python scripts/mixer_traffic.py --world 8 --seq 131072 --config path/to/config.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh_cp.core import AttentionShape, Tiling  # noqa: E402
from mesh_cp.core.mixers import mixer_exchange_bytes  # noqa: E402
from mesh_cp.integrations.hf.hybrid import mixer_layers  # noqa: E402
from mesh_cp.integrations.hf.mixer_spec import core_channels  # noqa: E402
from mesh_cp.sim import PRESETS, choose, simulate_candidates  # noqa: E402

FAMILIES = {
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "kimi_linear": "KimiLinearConfig",
    "minimax": "MiniMaxConfig",
    "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "bamba": "BambaConfig",
    "falcon_h1": "FalconH1Config",
    "zamba2": "Zamba2Config",
    "jamba": "JambaConfig",
    "lfm2": "Lfm2Config",
}
"""Family -> its transformers config class (default arguments: the family's flagship shape)."""

OVERRIDES = {
    "lfm2": {  # transformers' default makes every layer attention; LFM2-1.2B's layout
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 16,
        "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    },
}
"""Family -> config arguments beside the defaults, where the defaults are not the flagship's layout."""


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def attention_shape(config, world: int, seq: int) -> AttentionShape:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionShape(
        batch=1,
        seq_local=seq // world,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        itemsize=2,
    )


def rows(family: str, config, world: int, seq: int, topology: str) -> list[dict]:
    """One row per mixer layer kind of ``config``'s model, with the attention layer's bytes beside it."""
    model = meta_model(config)
    shape = attention_shape(config, world, seq)
    preset = PRESETS[topology](head_dim=shape.head_dim)
    runs = simulate_candidates(world, shape, preset, schedule="overlap")
    u, tiling, _ = choose(world, shape, preset)
    ring = runs[(1, Tiling(world=world, a=1, b=world))].traffic.total
    chosen = runs[(u, tiling)].traffic.total
    out, seen = [], set()
    for _, layer, spec in mixer_layers(model):
        if type(layer).__name__ in seen:
            continue
        seen.add(type(layer).__name__)
        why = spec.heads(layer, world)
        if why:
            out.append({"family": family, "layer": type(layer).__name__, "refused": why})
            continue
        channels_in, channels_out = core_channels(layer, spec, world)
        sent = 2 * mixer_exchange_bytes(
            seq_local=seq // world, channels_in=channels_in, channels_out=channels_out, world=world, itemsize=2
        )
        out.append(
            {
                "family": family,
                "layer": type(layer).__name__,
                "channels": (channels_in, channels_out),
                "mixer": sent,
                "ring": ring,
                "chosen": chosen,
                "chosen_layout": f"{u}x({tiling})" if u > 1 else str(tiling),
                "attention": (shape.heads, shape.kv_heads, shape.head_dim),
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--topology", default="h100", choices=sorted(PRESETS))
    parser.add_argument("--config", type=Path, default=None, help="a config.json (default: every family's default)")
    parser.add_argument("--families", nargs="*", default=None, help="families to print (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    if args.config is not None:
        data = json.loads(args.config.read_text())
        configs = {data["model_type"]: transformers.AutoConfig.for_model(**data)}
    else:
        names = args.families or list(FAMILIES)
        configs = {f: getattr(transformers, FAMILIES[f])(**OVERRIDES.get(f, {})) for f in names}
    table = []
    for family, config in configs.items():
        table += rows(family, config, args.world, args.seq, args.topology)
    gib = 2**30
    print(f"P = {args.world}, sequence {args.seq}, bf16, batch 1, forward + backward bytes sent per rank per layer")
    print()
    print(
        "| family | mixer layer | channels in + out / rank | mixer GiB | attention (heads, kv, dim) | ring GiB "
        "| chosen attention layout GiB | mixer / chosen |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        if "refused" in r:
            print(f"| {r['family']} | {r['layer']} | refused: {r['refused']} | | | | | |")
            continue
        print(
            f"| {r['family']} | {r['layer']} | {r['channels'][0]} + {r['channels'][1]} | {r['mixer'] / gib:.2f} | "
            f"{r['attention']} | {r['ring'] / gib:.2f} | {r['chosen'] / gib:.2f} ({r['chosen_layout']}) | "
            f"{r['mixer'] / r['chosen']:.2f} |"
        )
    print()
    for r in table:
        if "refused" not in r:
            h, kv, d = r["attention"]
            print(
                f"{r['family']}: mesh-cp plan --world {args.world} --seq {args.seq} --heads {h} --kv-heads {kv} "
                f"--head-dim {d} --mixer {r['layer']}={r['channels'][0]},{r['channels'][1]}"
            )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
