"""What the tests that compare mesh_cp with a real single-process client share: the DP x CP layout of a launched
script, its results file, and the two runs of such a script (single-process reference, and mesh_cp under
``accelerate launch``); and several runs of example scripts in the processes of one launch (launched_runs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHED_RUNS = Path(__file__).with_name("launched_runs.py")

SGD_RUN = {
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "max_grad_norm": 0.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": [],
    "use_cpu": True,
    "seed": 0,
}
"""TrainingArguments of a compared run: plain SGD at a constant rate, every step's loss logged, nothing saved."""


def samples(metrics: dict, split: str) -> list[float]:
    """``[samples, bound]``: the examples a ``Trainer`` run of ``split`` ("train", "eval") reports, as its samples per
    second times its runtime, and how far that product can be off the count by Trainer's rounding alone
    (``speed_metrics`` rounds the runtime to 4 decimals and the rate to 3: a millisecond's evaluation is off by 7%)."""
    rate, runtime = metrics[f"{split}_samples_per_second"], metrics[f"{split}_runtime"]
    return [rate * runtime, rate * 0.00005 + runtime * 0.0005]


def check_samples(mesh: dict, reference: dict, tolerance: float = 0.05) -> None:
    """Each replica's examples counted once: the samples of ``mesh`` and ``reference`` (:func:`samples`) agree within
    ``tolerance`` of the reference's, beyond what Trainer's rounding of either allows."""
    for key in ("train_samples", "eval_samples"):
        (got, got_bound), (want, want_bound) = mesh[key], reference[key]
        assert abs(got - want) <= tolerance * want + got_bound + want_bound, (key, mesh[key], reference[key])


def padded(examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)`` of ``examples`` (pad token 0)."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[row, : len(e["input_ids"])] = 1
    return ids, mask


def launched_layout(cp: int, dp: int, tile: tuple[int, int] | None = None):
    """The DP x CP layout (``tile``, default 1 x ``cp``) of a script under ``accelerate launch``, whose process group
    accelerate makes."""
    import torch.distributed as dist
    from accelerate import PartialState

    from mesh_cp.integrations import hf
    from mesh_cp.testing import gloo_exit_workaround

    gloo_exit_workaround()
    PartialState()
    parallel = hf.DataContextParallel.create(dist.group.WORLD, cp_size=cp, tile=tile or (1, cp))
    assert parallel.dp_size == dp, parallel
    return parallel


def write_results(out: str, results: list[dict], distributed: bool) -> None:
    """``results`` as JSON into ``out`` (rank 0 of a distributed run), then the end of a gloo run."""
    if not distributed or torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def reference_and_mesh(script: Path, out: Path, port: int, then: tuple[Path, ...] = (), ports=()) -> tuple[dict, dict]:
    """Run ``script OUT`` in one plain process (the reference) and ``script OUT --mesh`` under ``accelerate launch``
    side by side (the reference runs on one thread); ``(reference, mesh)``: case name -> result. The scripts
    ``then`` run after ``script`` in the processes of the same launch (launched_runs.py, the runs' stores on
    ``ports``)."""
    from tests.integrations.accelerate.test_accelerate import _accelerate, accelerate_launch

    reference, mesh = out / "reference.json", out / "mesh.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(out)}
    log = out / "reference.log"
    with log.open("w") as output:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(reference)], stdout=output, stderr=output, env=env, cwd=out
        )
        try:
            if then:
                cmd, launch_env = _accelerate(port, pythonpath=True)
                runs = [(script, [str(mesh), "--mesh"]), *((path, []) for path in then)]
                launched_runs(cmd, runs, out / "runs", ports, timeout=900, env=launch_env, cwd=out)
            else:
                accelerate_launch(script, str(mesh), "--mesh", port=port, cwd=out)
        except BaseException:
            proc.kill()
            raise
        finally:
            proc.wait(timeout=600)
    assert proc.returncode == 0, log.read_text()[-6000:]
    return tuple({r["case"]: r for r in json.loads(path.read_text())} for path in (reference, mesh))


def launched_runs(
    launcher: list[str], runs: list[tuple[Path, list[str]]], out: Path, ports, every_rank=(), **kwargs
) -> list[str]:
    """Each of ``runs`` (script, flags) in turn in the processes of one ``launcher`` command (launched_runs.py), run
    ``i``'s store on port ``ports[i]``; the output of each run on rank 0, and for the runs whose index is in
    ``every_rank`` the outputs of the other ranks after it, in rank order. ``kwargs`` go to ``subprocess.run``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = [
        {"script": str(script), "argv": list(argv), "port": port, "stdout": str(out / f"run_{i}.out")}
        | ({"every_rank": True} if i in every_rank else {})
        for i, ((script, argv), port) in enumerate(zip(runs, ports, strict=True))
    ]
    (out / "runs.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [*launcher, str(LAUNCHED_RUNS), str(out / "runs.json")], capture_output=True, text=True, **kwargs
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [_run_output(Path(run["stdout"]), run.get("every_rank", False)) for run in spec]


def _run_output(path: Path, every_rank: bool) -> str:
    """What a run printed on rank 0 (the file ``path``), then with ``every_rank`` on the other ranks (``path.rankR``,
    in rank order)."""
    others = sorted(path.parent.glob(f"{path.name}.rank*"), key=lambda p: int(p.name.rpartition(".rank")[2]))
    return "".join(p.read_text() for p in [path, *(others if every_rank else [])])
