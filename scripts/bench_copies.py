"""Bytes one rank writes outside its kernels and its communication, and its kernel calls per Q chunk.

Each configuration runs the real ``mesh_attn_func`` forward and backward as rank ``--rank`` of a ``P``-rank world on
torch's ``fake`` process group (collectives return at once and move no data, as in scripts/trace_scale.py), under
:class:`mesh_cp.testing.copies.WrittenBytes` (Note [Bytes outside the kernels] in ``mesh_cp/testing/copies.py``).
Bytes are per phase, in units of the rank's own K, V chunk (``2 B L Hkv D`` elements of the input dtype), and the
kernel calls per Q chunk of the rank (forward calls over the Q chunks it computes). ``--baseline FILE`` prints each
row's bytes over the same row of an earlier run.

    .venv/bin/python scripts/bench_copies.py --json docs/results/bench_copies.json
    .venv/bin/python scripts/bench_copies.py --baseline docs/results/bench_copies_before.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (before the process group)
import torch.distributed as dist

import mesh_cp
from mesh_cp.core import AttentionMask, Tiling, make_plan
from mesh_cp.testing.copies import WrittenBytes

TILES = {4: (2, 2), 16: (4, 4)}
KERNELS = ("cpu_flash", "segments")


class FlashStyleKernel:
    """The flash kernels' call structure on CPU: masked tiles and chunk calls as varlen ``segments`` (the rows between
    sequences read in place where the runtime knows of that, ``Capabilities.gaps``), computed by the reference kernel
    on their dense mask, with outputs as the flash kernels return them: contiguous, and gradients in the input dtype
    (``Capabilities.dq_in_input_dtype``). Its own work is the kernel's, so it does not count."""

    name = "segments"

    def __init__(self) -> None:
        from mesh_cp.kernels import Capabilities
        from mesh_cp.kernels.reference import ReferenceKernel

        fields = Capabilities.__dataclass_fields__  # an earlier runtime has fewer of them
        flags = {name: True for name in ("gaps", "dq_in_input_dtype") if name in fields}
        self.capabilities = Capabilities(keywords={"segments", "softcap"}, **flags)
        self.reference = ReferenceKernel()

    def _mask(self, q, k, segments):
        from mesh_cp.kernels.varlen import segments_mask

        return None if segments is None else segments_mask(segments, q.shape[1], k.shape[1])

    def forward(self, q, k, v, *, causal, scale, segments=None, softcap=None):
        mask = self._mask(q, k, segments)
        out, lse = self.reference.forward(q, k, v, causal=causal, scale=scale, mask=mask, softcap=softcap)
        return out.contiguous(), lse.contiguous()

    def backward(self, do, q, k, v, lse, delta, *, causal, scale, lse_grad=False, segments=None, softcap=None):
        mask = self._mask(q, k, segments)
        options = {"causal": causal, "scale": scale, "lse_grad": lse_grad, "mask": mask, "softcap": softcap}
        return tuple(g.to(q.dtype).contiguous() for g in self.reference.backward(do, q, k, v, lse, delta, **options))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 16])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seq-local", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS))
    p.add_argument("--schedules", nargs="+", default=["collective", "overlap"])
    p.add_argument("--masks", nargs="+", default=["causal", "packed"])
    p.add_argument("--json", default=None)
    p.add_argument("--baseline", default=None, help="an earlier --json output to compare with")
    return p.parse_args(argv)


def fake_mesh(world: int, rank: int, tiling: Tiling) -> mesh_cp.CPMesh:
    q_groups = {m: dist.new_group(list(m)) for m in tiling.q_groups()}
    kv_groups = {m: dist.new_group(list(m)) for m in tiling.kv_groups()}
    return mesh_cp.CPMesh(
        group=dist.group.WORLD,
        tiling=tiling,
        rank=rank,
        global_ranks=tuple(range(world)),
        check_group=dist.new_group(list(range(world))),
        q_group=q_groups[tiling.q_group(rank)],
        kv_group=kv_groups[tiling.kv_group(rank)],
    )


def packed(world: int, seq_local: int) -> AttentionMask:
    """Documents of 3/8, 1/4 and 3/8 of the sequence, the last one split from padding."""
    n = world * seq_local
    return AttentionMask(documents=(((0, 3 * n // 8), (3 * n // 8, 5 * n // 8), (5 * n // 8, n - 4)),))


def measure(world, rank, kv_heads, kernel, schedule, mask_name, args) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    a, b = TILES[world]
    tiling = Tiling(world=world, a=a, b=b)
    mesh = fake_mesh(world, rank, tiling)
    shape = (1, args.seq_local)
    q = torch.randn(*shape, args.heads, args.head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(*shape, kv_heads, args.head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = packed(world, args.seq_local) if mask_name == "packed" else None
    block_kernel = FlashStyleKernel() if kernel == "segments" else kernel
    options = {"mesh": mesh, "causal": True, "kernel": block_kernel, "schedule": schedule, "mask": mask}
    forward, backward = WrittenBytes((FlashStyleKernel,)), WrittenBytes((FlashStyleKernel,))
    with forward:
        out = mesh_cp.mesh_attn_func(q, k, v, **options)
    grad = torch.ones_like(out)
    with backward:
        out.backward(grad)
    chunk = 2 * k.numel() * k.element_size()
    plan_shape = mesh_cp.core.AttentionShape(
        batch=1,
        seq_local=args.seq_local,
        heads=args.heads,
        kv_heads=kv_heads,
        head_dim=args.head_dim,
        itemsize=k.element_size(),
    )
    plan = make_plan(tiling, plan_shape, causal=True, layout="zigzag", schedule=schedule, mask=mask)
    q_chunks = len({w.x for w in plan.blocks(rank)})
    return {
        "world": world,
        "tile": str(tiling),
        "heads": f"{args.heads}:{kv_heads}",
        "kernel": kernel,
        "schedule": schedule,
        "mask": mask_name,
        "forward": forward.total / chunk,
        "backward": backward.total / chunk,
        "forward_copied": forward.copied / chunk,
        "backward_copied": backward.copied / chunk,
        "forward_by_op": {op: n / chunk for op, n in forward.by_op.most_common()},
        "backward_by_op": {op: n / chunk for op, n in backward.by_op.most_common()},
        "calls_forward": forward.calls["forward"],
        "q_chunks": q_chunks,
        "calls_per_q_chunk": forward.calls["forward"] / max(q_chunks, 1),
    }


def line(row: dict, old: dict | None) -> str:
    copied, written = (row[f"forward{s}"] + row[f"backward{s}"] for s in ("_copied", ""))
    text = (
        f"{row['world']:<4} {row['tile']:<4} {row['heads']:<5} {row['kernel']:<10} {row['schedule']:<10} "
        f"{row['mask']:<7} {row['forward_copied']:6.2f}+{row['backward_copied']:6.2f}   "
        f"{row['forward']:6.2f}+{row['backward']:6.2f}   {row['calls_per_q_chunk']:8.2f}"
    )
    if old is None:
        return text
    old_copied, old_written = (old[f"forward{s}"] + old[f"backward{s}"] for s in ("_copied", ""))
    return text + f"       {copied / old_copied:.3f}, {written / old_written:.3f} ({old['calls_per_q_chunk']:.2f})"


def key(row: dict) -> tuple:
    return tuple(row[k] for k in ("world", "heads", "kernel", "schedule", "mask"))


def main(argv=None) -> list[dict]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = parse_args(argv)
    rows = []
    base = {}
    if args.baseline:
        base = {key(r): r for r in json.loads(Path(args.baseline).read_text())["rows"]}
    print(
        "P    tile heads kernel     schedule   mask    copied fwd+bwd C  written fwd+bwd C  calls/Q chunk  "
        "vs baseline: copied, written (calls/Q chunk)"
    )
    for world in args.worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=world)
        try:
            for kv_heads in args.kv_heads:
                for kernel in args.kernels:
                    for schedule in args.schedules:
                        for mask_name in args.masks:
                            row = measure(world, args.rank, kv_heads, kernel, schedule, mask_name, args)
                            rows.append(row)
                            print(line(row, base.get(key(row))))
        finally:
            dist.barrier()
            dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
