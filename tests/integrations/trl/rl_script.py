"""TRL's whole-sequence trainers (DPO, GRPO, Reward), single-process or with mesh_cp on 4 processes, on the same data
and seed: every case of the case modules (:data:`MODULES`, each with ``CASES: name -> case(parallel, output_dir)``
returning what the trainer logged), run by the single process as the reference and under one ``accelerate launch``
of 4 processes at DP 1 x CP 4 and at DP 2 x CP 2 (:data:`LAYOUTS`), where each replica's batch is the global batch
over the DP degree.

    python rl_script.py OUT.json [--only dpo,grpo]                    # the single-process reference
    accelerate launch ... rl_script.py OUT.json --mesh [--only ...]   # mesh_cp, both layouts

The results file holds one entry per case (``case``: ``module:name``, and ``@dp<D>xcp<C>`` under mesh_cp).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for tests.integrations
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from tests.integrations.clients import launched_layout, write_results  # noqa: E402

MODULES = ("dpo", "reward", "grpo")
"""The case modules: ``tests/integrations/trl/<name>_cases.py``."""

LAYOUTS = ((1, 4, (2, 2)), (2, 2, (1, 2)))
"""``(dp, cp, tile)`` of the mesh_cp runs."""

GLOBAL_BATCH = 4
"""Examples per step of the single process; each DP replica takes ``GLOBAL_BATCH // dp``."""


def cases(only: list[str]) -> dict[str, object]:
    """``module:name -> case`` of the case modules named in ``only`` that exist."""
    found = {}
    for module in only:
        try:
            cases_module = importlib.import_module(f"tests.integrations.trl.{module}_cases")
        except ModuleNotFoundError as err:
            if err.name != f"tests.integrations.trl.{module}_cases":
                raise
            continue
        found |= {f"{module}:{name}": case for name, case in cases_module.CASES.items()}
    return found


def run(name: str, case, parallel, folder: str) -> dict:
    """One case's result, or its traceback (the test that reads it fails with it)."""
    try:
        return {"case": name, **case(parallel, folder)}
    except Exception as err:  # noqa: BLE001 - reported by the case's test
        raised = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}"
        print(f"case {name} raised {raised}", file=sys.stderr, flush=True)
        return {"case": name, "raised": raised}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--only", default=",".join(MODULES))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    selected = cases(args.only.split(","))
    results = []
    with tempfile.TemporaryDirectory() as folder:
        if not args.mesh:
            results = [run(name, case, None, folder) for name, case in selected.items()]
        else:
            for dp, cp, tile in LAYOUTS:
                parallel = launched_layout(cp=cp, dp=dp, tile=tile)
                for name, case in selected.items():
                    results.append(run(f"{name}@dp{dp}xcp{cp}", case, parallel, folder))
    write_results(args.out, results, distributed=args.mesh)


if __name__ == "__main__":
    main()
