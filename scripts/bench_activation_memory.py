"""Per-rank peak memory of a training step of a small Llama under mesh_cp (CP over gloo ranks on this machine) with
nothing, gradient checkpointing, TRL's activation offloading, and both.

Each of ``--cp`` ranks (tile 1 x CP) holds its zig-zag shard of one sequence of each ``--lengths`` (global tokens),
runs forward and backward of the causal-LM loss (``hf.attach``, ``hf.shard_batch``, ``hf.causal_lm_loss``: no
optimizer, no gradient reduction) and measures, with :class:`mesh_cp.testing.MemoryPeak`, the peak bytes allocated
above what was allocated before the step (weights and data), the least of ``--repeats`` steps. The table prints the
largest peak over the ranks.

What the columns mean on a CPU. ``host peak`` is every byte allocated, whatever it stands for. TRL's offloading
manager (``trl.models.get_act_offloading_ctx_manager``, the one ``SFTConfig(activation_offloading=True)`` makes) is
made for the CPU here (a CPU-only torch has no accelerator to make it for): its pack hook copies every saved tensor of
at least 1 KiB to fresh host memory and its unpack hook hands the copy back, so on a CPU the copies are allocations like
any other and offloading saves no host memory. ``device peak`` is the same step's peak with the bytes held by the
offload store taken out at every moment: what a device would hold if the store lived in host memory, as it does on a
GPU (a tensor counts again from the moment backward takes it back). It leaves out what the GPU path adds: the forward
stash of its copy stream keeps up to 5 offloaded activations on the device until their copy is done.

Example::

    .venv/bin/python scripts/bench_activation_memory.py --cp 2 --lengths 1024 2048 4096
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh_cp.testing import MemoryPeak, spawn_gloo  # noqa: E402

MODES = {"nothing": (False, False), "checkpointing": (True, False), "offloading": (False, True), "both": (True, True)}
"""Mode -> (gradient checkpointing, activation offloading)."""

LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 16384,
    "use_cache": False,
}
"""A small GQA Llama: 4 layers of width 256 (head dim 32), a vocabulary of 4096."""

PACK, OFFLOADED, RESTORED = "offload:pack", "offload:stored:", "offload:restored:"
"""Profiler markers of the offload store: a pack begins; it stored N bytes; backward took N bytes back."""


def offloading_manager(model: torch.nn.Module):
    """TRL's activation offloading manager for ``model``, made for the CPU (single stream, unpinned: the path that
    runs without a device), its store's changes marked in the profiler's timeline (:data:`PACK`...)."""
    from torch.profiler import record_function
    from trl.models import get_act_offloading_ctx_manager

    with mock.patch.object(torch.accelerator, "current_accelerator", return_value=torch.device("cpu")):
        manager = get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)
    pack, unpack = manager.pack_hook, manager.unpack_hook

    def marked_pack(tensor: torch.Tensor) -> int:
        with record_function(PACK):
            pass
        tensor_id = pack(tensor)
        stored, offloaded = manager.tracker[tensor_id][:2]
        if offloaded:
            with record_function(f"{OFFLOADED}{stored.untyped_storage().nbytes()}"):
                pass
        return tensor_id

    def marked_unpack(tensor_id: int) -> torch.Tensor:
        stored, offloaded = manager.tracker[tensor_id][:2]
        if offloaded:
            with record_function(f"{RESTORED}{stored.untyped_storage().nbytes()}"):
                pass
        return unpack(tensor_id)

    manager.pack_hook, manager.unpack_hook = marked_pack, marked_unpack  # read when the manager is entered
    return manager


class StepPeak(MemoryPeak):
    """:class:`MemoryPeak` (``peak``: host bytes) that also gives ``device_peak``: the peak of the bytes allocated
    less those the offload store holds (:func:`offloading_manager`'s markers), equal to ``peak`` without offloading.

    Notes:
        A store's host copy is allocated inside the pack hook, before the hook's "stored" marker: the allocations
        of each pack are held back until its marker, which takes out the last one of the stored size (the copy);
        the others (a contiguous clone of a strided view) are device allocations and count.
    """

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        events = [e for e in self._profile.profiler.kineto_results.events() if _timeline(e.name())]
        current = peak = 0
        held: list[int] | None = None  # the allocations of a pack, until its marker
        for event in sorted(events, key=lambda e: e.start_ns()):
            name = event.name()
            if name == "[memory]" and held is not None:
                held.append(event.nbytes())
                continue
            if name == "[memory]":
                current += event.nbytes()
            elif name.startswith(OFFLOADED) and held is not None:
                held.pop(_host_copy(held, int(name.removeprefix(OFFLOADED))))
            elif name.startswith(RESTORED):
                current += int(name.removeprefix(RESTORED))
            for nbytes in held or ():  # the allocations of the pack before, now known to be device ones
                current += nbytes
                peak = max(peak, current)
            held = [] if name == PACK else None
            peak = max(peak, current)
        for nbytes in held or ():
            current += nbytes
            peak = max(peak, current)
        self.device_peak = peak


def _host_copy(held: list[int], stored: int) -> int:
    """The index in ``held`` (a pack's allocations) of the offload store's copy: the last of ``stored`` bytes."""
    copies = [i for i, nbytes in enumerate(held) if nbytes == stored]
    if not copies:
        raise RuntimeError(f"no allocation of the {stored} bytes the offload store holds among the pack's {held}")
    return copies[-1]


def _timeline(name: str) -> bool:
    return name == "[memory]" or name.startswith("offload:")


def worker(
    rank: int, world: int, lengths: list[int], repeats: int, vocab: int
) -> dict[tuple[int, str], tuple[int, int]]:
    """This rank's ``(host peak, device peak)`` bytes of one step, per ``(global length, mode)``, with a vocabulary
    of ``vocab``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import mesh_cp
    from mesh_cp.integrations import hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**(LLAMA | {"vocab_size": vocab})), attn_implementation="sdpa")
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    hf.attach(model, mesh)
    model.train()
    manager = offloading_manager(model)  # once: each one hooks the model's lm_head
    results = {}
    for length in lengths:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        batch = hf.shard_batch(ids, mesh=mesh)
        for mode, (checkpointing, offloading) in MODES.items():
            if checkpointing:
                model.activation_checkpointing_enable()
            else:
                model.activation_checkpointing_disable()
            peaks = []
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                dist.barrier()
                with StepPeak() as mem, manager if offloading else contextlib.nullcontext():
                    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
                    hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch).backward()
                    del logits
                peaks.append((mem.peak, mem.device_peak))
            results[(length, mode)] = min(peaks)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks (gloo processes on this machine)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="global sequence lengths")
    p.add_argument("--repeats", type=int, default=2, help="steps per measure; the least peak is kept")
    p.add_argument("--vocab", type=int, default=LLAMA["vocab_size"], help="vocabulary size")
    args = p.parse_args(argv)
    per_rank = spawn_gloo(worker, args.cp, args.lengths, args.repeats, args.vocab)
    layers, width = LLAMA["num_hidden_layers"], LLAMA["hidden_size"]
    print(f"Llama {layers} layers x {width}, vocab {args.vocab}, fp32, CP {args.cp} (zig-zag), batch 1")
    print(
        f"{'tokens':>7} {'per rank':>8} {'mode':>13} {'host peak MiB':>14} {'device peak MiB':>16} {'vs nothing':>11}"
    )
    for length in args.lengths:
        base = max(r[(length, "nothing")][1] for r in per_rank)
        for mode in MODES:
            host, device = (max(r[(length, mode)][i] for r in per_rank) for i in (0, 1))
            row = f"{length:>7} {length // args.cp:>8} {mode:>13} {host / 2**20:>14.1f} {device / 2**20:>16.1f}"
            print(f"{row} {device / base:>11.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
