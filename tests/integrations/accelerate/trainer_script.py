"""transformers' Trainer with the mesh, on 4 processes: under ``accelerate launch`` (test_accelerate.py),
or with ``--deepspeed CONFIG`` under the deepspeed launcher (test_deepspeed.py), where the Trainer builds
the layout from the config's ``"mesh_attention"`` block; in both, after the examples in the processes of their launch
(launched_runs.py).

DP 2 x CP 2 (tile 1x2; with ``--head-parallel 2`` the head-parallel x mesh hybrid, head_parallel 2 x tile 1x1) trains a tiny Llama for 2 epochs of 3 SGD steps on ragged examples; the result must
equal single-process training on the same global batches (both replicas' examples, right-padded, mean token
loss). The script also asserts, from the examples the collator saw, that every rank of a CP group saw the same
examples, that every step's replicas saw different examples, that each epoch saw every example once and that the
two epochs' orders differ (test_trainer.py compares the order with the real single-process Trainer's). Prints
``rank R params err E``.

Resume: the run saves a checkpoint one step into the second epoch; a new trainer (other initial weights) resumes
from it with ``train(resume_from_checkpoint=...)`` and must see exactly the batches after it and end with the
uninterrupted run's parameters. Prints ``rank R resume err E`` (under accelerate; accelerate allows one Accelerator
with a DeepSpeed plugin per process, and the DeepSpeed example's resume is tested in test_deepspeed.py).

Evaluation under CP: ``eval_strategy="steps"`` evaluates after each epoch (steps 3 and 6), then ``evaluate()`` and
``predict()`` (loss only) run on the trained model; the eval set (5 ragged examples, batches of 2: the replicas get
2 and 1 batches) must give the loss of single-process evaluation, the mean over its batches of their token-mean
losses, at each point. Prints ``rank R eval err E`` (the largest difference), after the refusals were checked.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))  # tests.integrations, when started without it on PYTHONPATH

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import AutoModelForCausalLM, TrainingArguments  # noqa: E402

from mesh_cp.integrations import hf  # noqa: E402
from mesh_cp.testing import gloo_exit_workaround  # noqa: E402
from mesh_cp.testing.models import VOCAB, tiny_causal_lms  # noqa: E402
from tests.integrations.clients import padded  # noqa: E402

STEPS, EPOCHS, BATCH, LR = 3, 2, 2, 0.1
EVAL_EXAMPLES, EVAL_BATCH, EVAL_INDEX = 5, 2, 1000  # eval examples are numbered from EVAL_INDEX
RESUME_STEP = STEPS + 1  # the checkpoint resumed from: one step into the second epoch


class RecordingCollator:
    """The trainer's collator, recording the indices of the examples of every batch it collates."""

    def __init__(self, collate):
        self.collate, self.seen = collate, []

    def __call__(self, examples):
        self.seen.append([e["index"] for e in examples])
        return self.collate(examples)


@torch.no_grad()
def reference_eval_loss(model: torch.nn.Module, examples: list[dict]) -> float:
    """Single-process Trainer.evaluate(): the mean over examples of their batch's token-mean loss (batches of
    EVAL_BATCH examples; test_trainer.py compares with the real Trainer)."""
    losses, sizes = [], []
    for start in range(0, len(examples), EVAL_BATCH):
        ids, mask = padded(examples[start : start + EVAL_BATCH])
        losses.append(model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
        sizes.append(len(ids))
    return (torch.stack(losses) * torch.tensor(sizes)).sum().item() / sum(sizes)


def check_refusals(trainer, eval_data: list[dict]) -> None:
    """predict() without prediction_loss_only, and compute_metrics, are refused by name."""
    for name, call in (("prediction_loss_only", lambda: trainer.predict(eval_data)), ("compute_metrics", None)):
        if call is None:
            trainer.compute_metrics = lambda prediction: {}
            call = lambda: trainer.evaluate(eval_data)  # noqa: E731
        try:
            call()
        except NotImplementedError as err:
            assert name in str(err), err
        else:
            raise AssertionError(f"{name}: must be refused")
    trainer.compute_metrics = None


def build_trainer(model, args, data, eval_data, layout):
    """MeshCPTrainer on ``layout`` (``None``: built from the DeepSpeed config), its collator recording batches."""
    trainer_class = hf.mesh_cp_trainer_class()
    extra = {} if layout is None else {"parallel": layout}  # None: built from the DeepSpeed config
    trainer = trainer_class(model=model, args=args, train_dataset=data, eval_dataset=eval_data, pad_token_id=0, **extra)
    trainer.data_collator.collator = RecordingCollator(trainer.data_collator.collator)  # the default PadExamples
    trainer.seen = trainer.data_collator.collator.seen
    return trainer


def trained_parameters(trainer, deepspeed: str | None) -> list[torch.Tensor]:
    """The full fp32 parameters of the trained model (gathered under ZeRO 3)."""
    if deepspeed is None:
        return [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()]
    from deepspeed.utils import safe_get_full_fp32_param

    return [
        (p if (full := safe_get_full_fp32_param(p)) is None else full).detach().clone()
        for p in trainer.model.parameters()
    ]


def check_resume(output_dir: str, args, data, trained, batches, head_parallel: int) -> float:
    """A new trainer resumes from the checkpoint of step RESUME_STEP (Trainer restores model, optimizer, scheduler,
    RNG states and the data position: the second epoch's reshuffled order, its first batch skipped) and trains to
    the end; returns the largest difference of its parameters from the uninterrupted run's ``trained``. Asserts it
    saw exactly the batches after the checkpoint, the same on every rank of a CP group."""
    args = copy.deepcopy(args)
    args.eval_strategy, args.save_strategy = "no", "no"
    tile = (1, 2 // head_parallel)
    layout = hf.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile=tile, head_parallel=head_parallel)
    torch.manual_seed(1)  # other initial weights: the checkpoint's must replace them
    model = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    trainer = build_trainer(model, args, data, None, layout)
    trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-{RESUME_STEP}")
    assert trainer.state.global_step == STEPS * EPOCHS, trainer.state
    expected = batches[RESUME_STEP:]  # this replica's batches after the checkpoint in the uninterrupted run
    assert trainer.seen == expected, (trainer.seen, expected)
    resumed = trained_parameters(trainer, None)
    return max((p - q).abs().max().item() for p, q in zip(resumed, trained, strict=True))


def main(output_dir: str, deepspeed: str | None, head_parallel: int) -> None:
    gloo_exit_workaround()  # before accelerate or the Trainer makes the process group
    tile = (1, 2 // head_parallel)
    if deepspeed is None:
        PartialState()  # the process group, from accelerate launch
        layout = hf.DataContextParallel.create(dist.group.WORLD, cp_size=2, tile=tile, head_parallel=head_parallel)
    else:
        layout = None  # the Trainer builds it from the config's "mesh_attention" block
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama-gqa"], attn_implementation="sdpa")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    dp_size = 2
    lengths = torch.randint(20, 33, (STEPS * BATCH * dp_size,), generator=gen)
    data = [
        {"input_ids": torch.randint(1, VOCAB, (int(n),), generator=gen).tolist(), "index": i}
        for i, n in enumerate(lengths)
    ]
    eval_data = [
        {"input_ids": torch.randint(1, VOCAB, (int(n),), generator=gen).tolist(), "index": EVAL_INDEX + i}
        for i, n in enumerate(torch.randint(20, 33, (EVAL_EXAMPLES,), generator=gen))
    ]
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS * EPOCHS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        use_cpu=True,
        deepspeed=deepspeed,
        report_to=[],
        save_strategy="steps",
        save_steps=RESUME_STEP,
        seed=0,
        eval_strategy="steps",
        eval_steps=STEPS,
        per_device_eval_batch_size=EVAL_BATCH,
        remove_unused_columns=False,  # the examples' "index" reaches the recording collator
    )
    trainer = build_trainer(model, args, data, eval_data, layout)
    layout = trainer.parallel
    assert layout.dp_size == dp_size and (layout.mesh.tile, layout.mesh.head_parallel) == (tile, head_parallel), layout
    trainer.train()
    evaluated = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    assert [step for step, _ in evaluated] == [STEPS * (e + 1) for e in range(EPOCHS)], trainer.state.log_history
    eval_losses = [loss for _, loss in evaluated]
    eval_losses.append(trainer.evaluate()["eval_loss"])
    check_refusals(trainer, eval_data)
    trainer.args.prediction_loss_only = True
    prediction = trainer.predict(eval_data)
    assert prediction.predictions is None and prediction.label_ids is None, prediction
    eval_losses.append(prediction.metrics["test_loss"])

    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, [b for b in trainer.seen if b[0] < EVAL_INDEX])  # the training batches
    cp = layout.mesh.size
    for rank, batches in enumerate(seen):
        assert batches == seen[rank // cp * cp], f"CP ranks of replica {rank // cp} saw different examples"
    replicas = [seen[r * cp] for r in range(layout.dp_size)]
    steps = [[i for part in parts for i in part] for parts in zip(*replicas, strict=True)]  # the global batches
    assert len(steps) == STEPS * EPOCHS and all(len(b) == BATCH * dp_size == len(set(b)) for b in steps), steps
    epochs = [sorted(i for b in steps[e * STEPS : (e + 1) * STEPS] for i in b) for e in range(EPOCHS)]
    assert all(order == list(range(len(data))) for order in epochs), epochs  # every example once an epoch
    assert steps[:STEPS] != steps[STEPS:], steps  # reshuffled for the second epoch
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    reference_eval = []
    for epoch in range(EPOCHS):
        for step in range(STEPS):
            ids, mask = padded([data[i] for i in steps[epoch * STEPS + step]])
            reference(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        reference_eval.append(reference_eval_loss(reference, eval_data))
    reference_eval += reference_eval[-1:] * 2  # evaluate() and predict() after training
    eval_err = max(abs(a - b) for a, b in zip(eval_losses, reference_eval, strict=True))
    trained = trained_parameters(trainer, deepspeed)
    err = max((p - q).abs().max().item() for p, q in zip(trained, reference.parameters(), strict=True))
    if deepspeed is None:  # accelerate allows one Accelerator with a DeepSpeed plugin per process
        mine = [b for b in trainer.seen if b[0] < EVAL_INDEX]
        resume_err = check_resume(output_dir, args, data, trained, mine, head_parallel)
        print(f"rank {dist.get_rank()} resume err {resume_err:.3e}", flush=True)
    print(f"rank {dist.get_rank()} params err {err:.3e}", flush=True)
    print(f"rank {dist.get_rank()} eval err {eval_err:.3e} losses {eval_losses}", flush=True)
    assert eval_err <= 1e-5, (eval_losses, reference_eval)  # also under the deepspeed launcher (test_deepspeed.py)
    dist.barrier()  # end the gloo run as gloo_exit_workaround asks: a process may abort at exit otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed config with a mesh_attention block")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument(
        "--head-parallel", type=int, default=1, help="head-parallel ranks of the CP group (tile 1 x 2/u)"
    )
    cli = parser.parse_args()
    main(cli.output_dir, cli.deepspeed, cli.head_parallel)
