"""Several runs of scripts one after another in the processes of one launch (torchrun, ``accelerate launch``, the
deepspeed launcher with ``--no_local_rank``), each run as the launcher runs a script: by path, as ``__main__``, its
flags in ``sys.argv``, its folder first on ``sys.path``, the launcher's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ...
in the environment. The frameworks are imported once per process, not once per run.

    LAUNCHER ... launched_runs.py RUNS.json

``RUNS.json`` is a list of ``{"script": PATH, "argv": [...], "port": P, "stdout": PATH}``, each with
``"every_rank": true`` optionally. Every run makes and destroys its own process group; rank 0 hosts that run's store
on port ``P`` and writes what the script prints on rank 0 to the file ``stdout``; with ``every_rank`` every other
rank ``R`` writes what it prints to ``stdout.rankR``. Before each run accelerate's process state (shared by every
``Accelerator`` of a process, and left behind by the previous run's) and DeepSpeed's groups (the previous engine's
groups and mpu, in ``deepspeed.utils.groups``) are cleared, as a new process starts without them. This file imports
nothing of the repository: started without it on ``PYTHONPATH``, the scripts find it themselves.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys
from pathlib import Path


def _clear_accelerate_state() -> None:
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _clear_deepspeed_groups() -> None:
    if "deepspeed.utils.groups" in sys.modules:  # the groups (and the mpu) of the previous run's engine
        importlib.reload(sys.modules["deepspeed.utils.groups"])


def main(spec: str) -> None:
    runs = json.loads(Path(spec).read_text())
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts each run's store, on that run's port
    main_rank = os.environ["RANK"] == "0"
    for run in runs:
        _clear_accelerate_state()
        _clear_deepspeed_groups()
        os.environ["MASTER_PORT"] = str(run["port"])
        sys.argv = [run["script"], *run["argv"]]
        sys.path[0] = str(Path(run["script"]).parent)  # what `python SCRIPT` puts first, in place of this folder's
        with contextlib.ExitStack() as stack:
            if main_rank or run.get("every_rank"):
                path = run["stdout"] if main_rank else f"{run['stdout']}.rank{os.environ['RANK']}"
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(path, "w"))))
            runpy.run_path(run["script"], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1])
