"""Tokens/s and attention bytes per rank per step of the accelerate fine-tuning example: mesh 2x2 vs ring 1x4.

Launches ``examples/accelerate/finetune.py`` under ``accelerate launch`` (4 gloo processes on this
machine, ``ACCELERATE_USE_CPU=true``) once per tile with the same model, data and steps, and prints
the median tokens/s and the bytes rank 0 sends per step in the attention's Q- and KV-groups (read from
the example's final JSON line).

Example::

    .venv/bin/python scripts/bench_finetune.py --steps 8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # for examples.common

from examples.common import read_result  # noqa: E402


def run(tile: str, steps: int, extra: list[str]) -> tuple[float, int]:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "configs" / "accelerate_mesh_cp.yaml")]
    cmd += [str(ROOT / "examples" / "accelerate" / "finetune.py"), "--tile", tile, "--steps", str(steps), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    try:
        result = read_result(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        result = None
    if result is None or result["tokens_per_s"] is None:
        raise RuntimeError(f"tile {tile} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    sent = result["attention_bytes_per_step"]
    return result["tokens_per_s"], sent["q"] + sent["kv"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per tile")
    p.add_argument("--tiles", nargs="+", default=["2x2", "1x4"], help="tiles of the 4 ranks to compare")
    args, extra = p.parse_known_args(argv)
    rows = {tile: run(tile, args.steps, extra) for tile in args.tiles}
    ring = rows.get("1x4")
    print(f"{'tile':>5} {'tokens/s':>10} {'attention bytes/rank/step':>26} {'vs ring':>8}")
    for tile, (rate, nbytes) in rows.items():
        versus = f"{nbytes / ring[1]:.1%}" if ring else ""
        print(f"{tile:>5} {rate:>10,.0f} {nbytes:>26,d} {versus:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
