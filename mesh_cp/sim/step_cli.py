"""``mesh-cp plan --model CONFIG``: the per-GPU memory of a whole training step, by part, and the longest sequence
that fits a budget (:mod:`mesh_cp.sim.step`).

::

    mesh-cp plan --model qwen3-8b --seq 1048576 --gpus 8 --lm-head chunked
    mesh-cp plan --model llama-3-8b --gpus 32 --budget 80GB          # the longest sequence on 32 GPUs
    mesh-cp plan --model path/to/config.json --seq 131072 --gpus 8 --sharding zero3 --no-checkpointing

:func:`add_step_arguments` adds the options to the ``plan`` parser of :mod:`mesh_cp.cli` and takes over its
command when ``--model`` is given; without it ``plan`` runs as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

from mesh_cp.core import AttentionShape
from mesh_cp.sim.step import (
    PARTS,
    ModelConfig,
    StepMemory,
    StepOptions,
    attention_buffers,
    attention_layout,
    layout_budget,
    longest_seq,
    seq_unit,
    step_memory,
)
from mesh_cp.sim.step_config import LM_HEADS, MODEL_PRESETS, SHARDINGS
from mesh_cp.sim.topology import PRESETS, Topology

ATTENTION_OPTIONS = ("world", "heads", "kv_heads", "head_dim")
"""The ``plan`` options of the attention alone: ``--model`` takes them from its config (``--gpus`` for ``--world``)."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"80GB"`` -> bytes; units B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number with an optional unit; write e.g. '80GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_step_arguments(plan: argparse.ArgumentParser) -> None:
    """Add ``--model`` and the step's options to ``plan`` (after its own options and defaults): the attention-only
    options become optional, and the command runs :func:`step_command` when ``--model`` is given."""
    group = plan.add_argument_group(
        "whole training step (with --model)",
        "the per-GPU memory of forward, backward and AdamW by part; --heads, --kv-heads, --head-dim come from the "
        "model's config, --dtype bf16/fp16 means mixed precision, fp32 everything in fp32",
    )
    group.add_argument("--model", default=None, help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json")
    group.add_argument("--gpus", type=int, default=None, help="GPUs of the job, dp_shard x cp (default --world or 1)")
    group.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: every GPU)")
    group.add_argument("--sharding", choices=SHARDINGS, default="fsdp2", help="over every GPU (default fsdp2)")
    group.add_argument(
        "--checkpointing", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing"
    )
    group.add_argument("--offload", action="store_true", help="offload saved activations to host memory")
    group.add_argument("--lm-head", choices=LM_HEADS, default="full", help="full [T, V] logits or chunked")
    group.add_argument("--lm-head-chunk", type=int, default=4096, help="tokens per chunk of the chunked LM head")
    group.add_argument("--mlp-tiles", type=int, default=1, help="the MLP over this many sequence slices (tiled MLP)")
    group.add_argument("--fused-norm", action="store_true", help="a fused RMSNorm (saves no fp32 copies)")
    group.add_argument("--optimizer-offload", action="store_true", help="AdamW's states and step on the CPU")
    group.add_argument("--budget", type=parse_size, default=None, help="GPU memory, e.g. 80GB: the longest seq")
    for action in plan._actions:
        if action.dest in (*ATTENTION_OPTIONS, "seq"):
            action.required = False
    plan.set_defaults(run=_dispatch(plan.get_default("run")))


def _dispatch(attention_only: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if args.model is not None:
            return step_command(args)
        missing = [
            f"--{name.replace('_', '-')}"
            for name in ("world", "heads", "head_dim", "seq")
            if getattr(args, name) is None
        ]
        if missing:
            raise ValueError(f"plan needs {', '.join(missing)} (or --model CONFIG for the whole training step)")
        return attention_only(args)

    return run


def step_options(args: argparse.Namespace) -> StepOptions:
    """The :class:`StepOptions` of the parsed arguments."""
    given = [f"--{name.replace('_', '-')}" for name in ATTENTION_OPTIONS[1:] if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} come from --model {args.model}'s config; drop them")
    return StepOptions(
        gpus=args.gpus or args.world or 1,
        cp=args.cp,
        sharding=args.sharding,
        precision="fp32" if args.dtype == "fp32" else "mixed",
        checkpointing=args.checkpointing,
        offload=args.offload,
        lm_head=args.lm_head,
        lm_head_chunk=args.lm_head_chunk,
        batch=args.batch,
        mlp_tiles=args.mlp_tiles,
        fused_norm=args.fused_norm,
        optimizer_offload=args.optimizer_offload,
    )


def step_command(args: argparse.Namespace) -> int:
    """Print the step's memory by part at ``--seq`` and, with ``--budget``, the longest sequence that fits."""
    model = ModelConfig.load(args.model)
    args.kv_heads = None if args.kv_heads == args.heads else args.kv_heads  # main() copied --heads into it
    options = step_options(args)
    topology = _topology(args, model)

    def layout_for(seq: int) -> int | str | None:
        """``--memory-budget``, else the fastest layout or the one of least memory where that does not fit."""
        if args.memory_budget is not None:
            return args.memory_budget
        return layout_budget(model, seq, options, args.budget, topology=topology)

    def memory(seq: int) -> StepMemory:
        budget = layout_for(seq)
        attention = attention_buffers(model, seq, options, topology=topology, memory_budget=budget)
        return step_memory(model, seq, options, attention=attention)

    lines = describe(model, options)
    if args.seq is not None:
        where = layout(model, args.seq, options, topology, layout_for(args.seq))
        lines += ["", *format_memory(memory(args.seq), args.seq, where)]
    if args.budget is not None:
        seq = longest_seq(model, options, args.budget, memory=memory)
        if seq == 0:
            lines += ["", f"--budget {args.budget / 1e9:g} GB: not even {seq_unit(options)} tokens fit"]
        else:
            best = memory(seq)
            lines += [
                "",
                f"--budget {args.budget / 1e9:g} GB: the longest sequence that fits is {seq} tokens "
                f"({best.tokens} per rank), peak {best.peak / 1e9:.2f} GB at {best.moment}; "
                f"{layout(model, seq, options, topology, layout_for(seq))}",
            ]
    print("\n".join(lines))
    return 0


def describe(model: ModelConfig, options: StepOptions) -> list[str]:
    """The model and the layout in words."""
    cp, precision = options.cp_degree, options.precision
    bytes_ = "bf16 compute, 16 bytes per parameter (weights, gradients, fp32 AdamW states" + (
        ", fp32 weights and gradients sharded, bf16 copies gathered per layer)"
        if options.sharding == "fsdp2"
        else ", fp32 master weights)"
    )
    return [
        f"{model.name}: {model.params / 1e9:.2f}B parameters, {model.layers} layers, hidden {model.hidden}, MLP "
        f"{model.intermediate}, heads {model.heads}:{model.kv_heads} x {model.head_dim}, vocab {model.vocab}"
        + (", tied embeddings" if model.tied else ""),
        f"{options.gpus} GPU(s): dp_shard {options.gpus // cp} x cp {cp}, {options.sharding} over all "
        f"{options.gpus}, batch {options.batch}; {bytes_ if precision == 'mixed' else 'everything fp32'}; "
        f"checkpointing {'on' if options.checkpointing else 'off'}, offload {'on' if options.offload else 'off'}, "
        f"LM head {options.lm_head}"
        + (f" ({options.lm_head_chunk} tokens per chunk)" if options.lm_head == "chunked" else "")
        + (f", MLP in {options.mlp_tiles} tiles" if options.mlp_tiles > 1 else "")
        + (", fused RMSNorm" if options.fused_norm else "")
        + (", optimizer offloaded" if options.optimizer_offload else ""),
    ]


def format_memory(memory: StepMemory, seq: int, layout_line: str) -> list[str]:
    """The table of :attr:`StepMemory.parts` with the peak and the moment it happens at."""
    lines = [f"seq {seq}: {memory.tokens} tokens per rank; {layout_line}", f"{'part':<24} {'GB per GPU':>10}"]
    lines += [f"{part:<24} {memory.parts[part] / 1e9:>10.2f}" for part in PARTS]
    lines.append(f"{'peak':<24} {memory.peak / 1e9:>10.2f}   at {memory.moment}")
    others = sorted(memory.moments.items(), key=lambda item: -item[1])[1:4]
    lines.append("next moments: " + ", ".join(f"{name} {total / 1e9:.2f} GB" for name, total in others))
    return lines


def layout(
    model: ModelConfig, seq: int, options: StepOptions, topology: Topology, memory_budget: int | str | None = None
) -> str:
    """The attention layout of the CP group in words (:func:`mesh_cp.sim.step.attention_layout` with
    ``memory_budget``)."""
    cp = options.cp_degree
    if cp == 1:
        return "attention on one rank per sequence (no CP)"
    act = options.act_bytes
    shape = AttentionShape(options.batch, seq // cp, model.heads, model.kv_heads, model.head_dim, act)
    u, tiling = attention_layout(cp, shape, topology, memory_budget)  # type: ignore[arg-type]
    which = "the least attention memory" if memory_budget == "least" else "the fastest"
    return f"attention: tile {tiling}" + (f" with head_parallel={u}" if u > 1 else "") + f" over cp {cp} ({which})"


def _topology(args: argparse.Namespace, model: ModelConfig) -> Topology:
    if args.topology in PRESETS:
        return Topology.preset(args.topology, head_dim=model.head_dim, ranks_per_node=args.ranks_per_node or 8)
    path = Path(args.topology)
    if not path.is_file():
        raise ValueError(f"--topology {args.topology!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a file")
    topology = Topology.from_dict(json.loads(path.read_text()))
    return (
        topology if args.ranks_per_node is None else dataclasses.replace(topology, ranks_per_node=args.ranks_per_node)
    )
