"""``torch.compile`` of a model attached to a mesh, and ``Trainer(torch_compile=True)``: exact, compiled once.

Mesh attention is opaque to the compiler (Note [Opaque to torch.compile] in :mod:`mesh_cp.runtime.attention`): the
graph breaks at every attention call, which runs eagerly, and the rest of the model is compiled. On 4 gloo ranks
(tile 2x2), with the ``aot_eager`` backend (the rest of the model traced and its backward built ahead of time, as
inductor does, without inductor's C++ build):

- a tiny Llama (GQA) compiled after :func:`~mesh_cp.integrations.hf.attach`: logits, the loss summed over the CP
  group and every parameter gradient (summed over the CP group) equal the single-process SDPA model's to 1e-5 over
  4 SGD steps; nothing is compiled after the first step (the attached model's checks run eagerly, like the
  attention, so no guard reads their per-forward bookkeeping); a compiled function that
  calls :func:`mesh_cp.mesh_attn_func` itself gives the eager function's value and gradients;
- ``mesh_cp_trainer_class()`` with ``TrainingArguments(torch_compile=True)`` (CP 4, DP 1, one example a step) logs
  the losses of single-process ``transformers.Trainer`` with ``torch_compile=True`` and SDPA, and ends with its
  parameters.

The cases share one spawned group; each test reads its own section of it.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mesh_cp  # noqa: E402
from mesh_cp.testing import run_sections, section_results, spawn_gloo  # noqa: E402
from mesh_cp.testing.models import VOCAB, tiny_causal_lms  # noqa: E402

TOL = 1e-5
SEQ = 48
BATCH = 2
STEPS = 4
BACKEND = "aot_eager"
TRAINER_STEPS = 3
TRAINER_SEQ = 32  # every example this long: one shape, no padding (a multiple of 2P = 8)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _compiled_frames() -> list[str]:
    """``file:function`` of every frame Dynamo has compiled in this process, in order (recompiles included)."""
    from torch._dynamo.utils import get_compilation_metrics

    return [f"{os.path.basename(m.co_filename or '?')}:{m.co_name}" for m in get_compilation_metrics()]


def compiled_model_section(rank: int, world: int) -> dict:
    """The compiled attached model against the eager SDPA model over STEPS SGD steps (momentum), and the frames
    compiled in each step."""
    import torch._dynamo
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mesh_cp.integrations import hf

    torch._dynamo.reset()
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(2, 2))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    model = hf.attach(copy.deepcopy(ref), mesh)
    compiled = torch.compile(hf.data_parallel(model, mesh=mesh), backend=BACKEND)  # gradients summed over CP
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    errors: dict[str, float] = {}
    frames: list[list[str]] = []
    for step in range(STEPS):
        before = len(_compiled_frames())
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out = ref(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        batch = hf.shard_batch(input_ids, mesh=mesh)
        logits = compiled(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        loss = hf.causal_lm_loss(logits, batch.shift_labels, batch.num_items_in_batch)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group)
        shard_ref = mesh_cp.shard_sequence(out.logits.detach(), mesh=mesh, dim=1, layout="zigzag")
        errors[f"step {step} logits"] = _max_err(logits.detach(), shard_ref)
        errors[f"step {step} loss"] = abs(total.item() - out.loss.item())
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
        if any(a is None or b is None for a, b in pairs):
            raise AssertionError(f"step {step}: a parameter got no gradient through the compiled model")
        errors[f"step {step} grads"] = max(_max_err(a, b) for a, b in pairs)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        frames.append(_compiled_frames()[before:])
    errors["params after the steps"] = max(
        _max_err(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    errors |= _compiled_function_errors(mesh)
    return {"errors": errors, "frames": frames}


def _compiled_function_errors(mesh) -> dict[str, float]:
    """A compiled function calling :func:`mesh_cp.mesh_attn_func` itself (no transformers): output and the
    gradients of q, k, v and of the projection before it equal the eager function's."""
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(16, 16, generator=gen)
    x = torch.randn(2, SEQ // mesh.size, 4, 16, generator=gen)

    def attend(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        q = (x @ proj).sin()
        out = mesh_cp.mesh_attn_func(q, x, x * 2, mesh=mesh, causal=True)
        return (out * q).sum()

    results = []
    for fn in (attend, torch.compile(attend, backend=BACKEND)):
        inputs = [x.clone().requires_grad_(), proj.clone().requires_grad_()]
        value = fn(*inputs)
        value.backward()
        results.append([value.detach(), *(t.grad for t in inputs)])
    (eager, *eager_grads), (compiled, *compiled_grads) = results
    return {
        "mesh_attn_func compiled value": _max_err(compiled, eager),
        "mesh_attn_func compiled grads": max(_max_err(a, b) for a, b in zip(compiled_grads, eager_grads, strict=True)),
    }


def _trainer_args(output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        max_steps=TRAINER_STEPS,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        torch_compile=True,
        torch_compile_backend=BACKEND,
    )


def _full_batch(examples: list[dict]) -> dict[str, torch.Tensor]:
    """The reference Trainer's batch: the examples' tokens, their own labels (the model shifts them)."""
    ids = torch.tensor([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


def _trained(trainer) -> tuple[list[float], list[torch.Tensor]]:
    """The loss logged at every step (logging_steps=1) and the trained parameters."""
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()]
    return losses, params


def trainer_section(rank: int, world: int) -> dict:
    """MeshCPTrainer with torch_compile=True (CP 4, tile 2x2) against single-process Trainer with torch_compile=True
    (SDPA), run on rank 0 alone first: the same examples in order, the same initial weights."""
    import tempfile

    import torch._dynamo
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Trainer

    from mesh_cp.integrations import hf

    gen = torch.Generator().manual_seed(2)
    data = [
        {"input_ids": torch.randint(1, VOCAB, (TRAINER_SEQ,), generator=gen).tolist()} for _ in range(TRAINER_STEPS)
    ]
    torch.manual_seed(0)
    initial = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    reference: list = [None]
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0:  # a single process: accelerate sees no distributed environment
            torch._dynamo.reset()
            single = Trainer(
                model=copy.deepcopy(initial), args=_trainer_args(tmp), train_dataset=data, data_collator=_full_batch
            )
            single.train()
            reference = [(*_trained(single), _is_compiled(single))]
            AcceleratorState._reset_state(reset_partial_state=True)
        dist.broadcast_object_list(reference, src=0)
        ref_losses, ref_params, ref_compiled = reference[0]

        # The ranks' environment, as a launcher sets it: accelerate then takes the process group already made.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        torch._dynamo.reset()
        parallel = hf.DataContextParallel.create(dist.group.WORLD, cp_size=world, tile=(2, 2))
        trainer = hf.mesh_cp_trainer_class()(
            model=copy.deepcopy(initial), args=_trainer_args(tmp), train_dataset=data, parallel=parallel, pad_token_id=0
        )
        trainer.train()
        losses, params = _trained(trainer)
        AcceleratorState._reset_state(reset_partial_state=True)
    return {
        "compiled": (_is_compiled(trainer), ref_compiled),
        "losses": losses,
        "reference losses": ref_losses,
        "params": max(_max_err(p, q) for p, q in zip(params, ref_params, strict=True)),
    }


def _is_compiled(trainer) -> bool:
    """Whether the model the trainer trained is a ``torch.compile`` module (possibly inside DDP)."""
    from torch._dynamo.eval_frame import OptimizedModule

    model = trainer.model_wrapped
    return isinstance(model, OptimizedModule) or isinstance(getattr(model, "module", None), OptimizedModule)


SECTIONS = {"compiled model": compiled_model_section, "trainer": trainer_section}


def world4_worker(rank: int, world: int) -> dict[str, dict]:
    """Every section in one spawned group."""
    import transformers

    transformers.logging.set_verbosity_error()
    return run_sections(SECTIONS, rank, world)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, dict]]:
    return spawn_gloo(world4_worker, 4)


section = section_results


def test_compiled_model_matches_single_process_sdpa(world4) -> None:
    for rank, res in enumerate(section(world4, "compiled model")):
        errors = res["errors"]
        assert len(errors) == 3 * STEPS + 3, errors
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: errors above {TOL}: {bad}"


def test_compiled_model_does_not_recompile_every_step(world4) -> None:
    for rank, res in enumerate(section(world4, "compiled model")):
        frames = res["frames"]
        assert frames[0], f"rank {rank}: the first step compiled nothing"
        assert len(frames) == STEPS and not any(frames[1:]), f"rank {rank}: compiled after the first step: {frames}"


def test_trainer_with_torch_compile_matches_single_process_trainer(world4) -> None:
    for rank, res in enumerate(section(world4, "trainer")):
        assert res["compiled"] == (True, True), res  # the mesh model and the reference
        assert len(res["losses"]) == len(res["reference losses"]) == TRAINER_STEPS, res
        errors = [abs(a - b) for a, b in zip(res["losses"], res["reference losses"], strict=True)]
        assert max(errors) <= TOL, (rank, res)
        assert res["params"] <= TOL, (rank, res)
