"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` with FSDP2 beside mesh_cp (4 processes: DP 2 x CP 2, and CP 4)
against the single-process trainer on the same data and seed: one JSON line per case with every step's loss, and
on the mesh the shares of the parameters and optimizer states each rank holds.

    python fsdp_cases.py OUT.json                         # the single-process references
    accelerate launch ... fsdp_cases.py OUT.json --mesh   # mesh_cp + FSDP2 (configs/accelerate_mesh_cp.yaml)

test_fsdp.py runs both and compares them case by case. Every case runs in the one launch: the ``accelerate_config``
case in the environment a launch with configs/accelerate_fsdp_mesh_cp.yaml gives (:func:`launched_with`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from mesh_cp.testing.models import tiny_config
from tests.integrations.clients import SGD_RUN, write_results
from tests.integrations.hf.trainer_cases import examples
from tests.integrations.trl.sft_script import texts, tokenizer

BATCH, STEPS = 2, 4
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LAUNCHED, FSDP_CONFIG = CONFIGS / "accelerate_mesh_cp.yaml", CONFIGS / "accelerate_fsdp_mesh_cp.yaml"
FSDP = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}

CASES: dict[str, dict] = {
    "dp2_cp2": {"cp": 2},
    "cp4": {"cp": 4},
    "accumulation": {"cp": 2, "gradient_accumulation_steps": 2},
    "checkpointing": {"cp": 2, "gradient_checkpointing": True},
    "clip": {"cp": 2, "max_grad_norm": 2.0},
    "no_reshard": {"cp": 2, "fsdp_config": {"version": 2, "reshard_after_forward": False}},
    "sft": {"cp": 2, "trainer": "sft"},
    "sft_cp4": {"cp": 4, "trainer": "sft"},
    "adamw": {"cp": 2, "optim": "adamw_torch", "learning_rate": 0.01},
    "resume": {"cp": 2, "optim": "adamw_torch", "learning_rate": 0.01, "resume": True},
    "resume_sharded": {
        "cp": 2,
        "optim": "adamw_torch",
        "learning_rate": 0.01,
        "resume": True,
        "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
    },
    "lora": {"cp": 2, "lora": True, "optim": "adamw_torch", "learning_rate": 0.01},
    "user_sharded": {"cp": 2, "user_sharded": True},
    "torch_loop": {"cp": 2},
    "bf16_policy": {"cp": 2, "user_sharded": "bf16"},
    "refusals": {"cp": 2},
    "accelerate_config": {"cp": 2, "accelerate_config": True},
}
"""Case name -> the CP size (``cp``; DP is 4 / cp), the trainer (``"sft"`` for TRL's SFTTrainer), ``resume`` (stop
after 2 steps with a checkpoint, resume from it in a new trainer), ``lora`` (a PEFT LoRA adapter), ``user_sharded``
(the model sharded before the trainer gets it, over ``hf.fsdp_mesh``, with no FSDP settings; ``"bf16"``: with a
bf16 mixed-precision policy, against the single process sharding it the same way over its one rank), ``accelerate_config``
(FSDP and the layout from configs/accelerate_fsdp_mesh_cp.yaml, launched with it), and TrainingArguments
fields; ``torch_loop`` is the documented plain loop (docs/hf.md) against a single-process loop."""


def run_case(name: str, mesh: bool, output_dir: str) -> dict:
    if name == "torch_loop":
        return {"case": name, "loss": torch_loop(_layout(2) if mesh else None)}
    if name == "refusals":
        return {"case": name, "loss": [], "errors": refusals(_layout(2), output_dir) if mesh else {}}
    fields = {"max_steps": STEPS} | CASES[name]
    cp, sft, resume = fields.pop("cp"), fields.pop("trainer", None) == "sft", fields.pop("resume", False)
    lora, user_sharded = fields.pop("lora", False), fields.pop("user_sharded", False)
    from_config = fields.pop("accelerate_config", False)
    dp = 4 // cp
    parallel = _layout(cp) if mesh and not from_config else None
    if mesh and from_config:  # the launcher's parallelism_config block; accelerate gets every size 1
        from mesh_cp.integrations import hf

        fields["parallelism_config"] = hf.accelerator_parallelism_config()
        parallel = hf.parallel_from_accelerate(tile="1x2")
    train = examples(16, 6, 30, 1)
    batch = {"per_device_train_batch_size": BATCH if mesh else BATCH * dp}
    fsdp = (FSDP | {"fsdp_config": fields.pop("fsdp_config", FSDP["fsdp_config"])}) if mesh else {}
    fsdp = {} if user_sharded or from_config else fsdp
    fields.pop("fsdp_config", None)
    run = SGD_RUN | {"learning_rate": 0.05} | batch | fsdp | fields
    if resume:
        _train(
            name,
            parallel,
            train,
            run | {"save_strategy": "steps", "save_steps": 2, "max_steps": 2},
            output_dir,
            sft,
            lora,
        )
        last = str(Path(output_dir) / "checkpoint-2")
        trainer, steps = _train(name, parallel, train, run, output_dir, sft, lora, resume=last)
    else:
        trainer, steps = _train(name, parallel, train, run, output_dir, sft, lora, user_sharded=user_sharded)
    result = {"case": name, "loss": [h["loss"] for h in steps], "grad_norm": [h.get("grad_norm") for h in steps]}
    if mesh:  # after the optimizer step (an evaluation's forward leaves the root's parameters gathered)
        result["shares"] = _shares(trainer)
    if not sft:  # after training, with a partial last batch (5 examples in batches of 2)
        args = trainer.args
        args.per_device_eval_batch_size, args.prediction_loss_only = 2, True
        result["eval_loss"] = trainer.evaluate(examples(5, 6, 20, 2))["eval_loss"]
    return result


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.5, pad_token_id=0),
        attn_implementation="sdpa",
    )


def _shard_by_hand(model, parallel, bf16: bool) -> None:
    """fully_shard each layer, then the model, over ``hf.fsdp_mesh(parallel)`` (without ``parallel``, over the one
    rank of a process group of one), with a bf16 mixed-precision policy if ``bf16``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mesh_cp.integrations import hf

    if parallel is None and not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29649", world_size=1, rank=0)
    mesh = hf.fsdp_mesh(parallel) if parallel is not None else init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())


def _train(name, parallel, train, run, output_dir, sft, lora, resume=None, user_sharded=False):
    model = _model()
    if user_sharded and (parallel is not None or user_sharded == "bf16"):
        _shard_by_hand(model, parallel, bf16=user_sharded == "bf16")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)  # a tokenizer that checkpoints save
    if sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        base = SFTTrainer
        args = SFTConfig(output_dir=output_dir, bf16=False, gradient_checkpointing=False, **run)
        kwargs = {"processing_class": tokenizer(), "train_dataset": Dataset.from_dict({"text": texts(16, 10, 30, 1)})}
    else:
        base, args = Trainer, TrainingArguments(output_dir=output_dir, **run)
        kwargs = {"train_dataset": train, "data_collator": collator}
    if parallel is not None:
        from mesh_cp.integrations import hf

        base = hf.mesh_cp_trainer_class(base)
        kwargs["parallel"] = parallel
    trainer = base(model=model, args=args, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def torch_loop(parallel) -> list[float]:
    """The plain loop of docs/hf.md ("FSDP2 beside CP") on 4 steps of 4 rows of 24 tokens, SGD, the first two rows
    of each batch with two thirds of their labels left out (so the DP replicas count different labels); without
    ``parallel`` one process on the whole batches. Returns every step's loss (the global token mean)."""
    from mesh_cp.testing.models import VOCAB

    gen = torch.Generator().manual_seed(3)
    model, rows = _model(), torch.randint(1, VOCAB, (STEPS, 4, 24), generator=gen)
    labels = rows.masked_fill((torch.rand(rows.shape, generator=gen) < 0.67) & (torch.arange(4) < 2)[:, None], -100)
    if parallel is None:
        optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.05), []
        for ids, targets in zip(rows, labels, strict=True):
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses
    # docs/hf.md, "FSDP2 beside CP": a plain torch loop
    from torch.distributed.fsdp import fully_shard

    import mesh_cp
    from mesh_cp.integrations import hf

    hf.attach(model, parallel.mesh)
    mesh = hf.fsdp_mesh(parallel)  # one 1-D mesh of every DP x CP rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hf.check_sharded(model, parallel)
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.05), []  # after fully_shard: the sharded parameters
    world = dist.get_world_size(parallel.group)
    for ids, targets in zip(rows, labels, strict=True):
        mine = slice(parallel.dp_rank * 2, parallel.dp_rank * 2 + 2)  # this replica's rows of the global batch
        batch = mesh_cp.shard_batch(ids[mine], labels=targets[mine], mesh=parallel.mesh)
        count = torch.tensor(batch.num_items_in_batch)
        dist.all_reduce(count, group=parallel.dp_group)  # the labels of the global batch
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        share = mesh_cp.causal_lm_loss(logits, batch.shift_labels, int(count))
        (share * world).backward()  # FSDP2 averages over the DP x CP ranks; the shares are to be summed
        optimizer.step()
        optimizer.zero_grad()
        total = share.detach().clone()
        dist.all_reduce(total, group=parallel.group)
        losses.append(total.item())
    return losses


def refusals(parallel, output_dir: str) -> dict[str, str]:
    """What each mistake is refused with: a model sharded over the 2-D (dp, cp) mesh (HSDP) or over the CP group
    alone, given to check_sharded and to the trainer; FSDP settings mesh_cp does not apply."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers.training_args import ParallelMode

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.fsdp import check_launch

    meshes = {
        "hsdp": DeviceMesh.from_group(
            [parallel.dp_group, parallel.mesh.group],
            "cpu",
            mesh=torch.arange(4).view(2, 2),
            mesh_dim_names=("dp", "cp"),
        ),
        "cp_only": DeviceMesh.from_group(parallel.mesh.group, "cpu"),
    }
    errors = {}
    for name, device_mesh in meshes.items():
        model = _model()
        fully_shard(model, mesh=device_mesh)
        errors[name] = _error(lambda m=model: hf.check_sharded(m, parallel))
        args = TrainingArguments(output_dir=output_dir, **SGD_RUN)
        collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
        trainer = hf.mesh_cp_trainer_class()
        errors[f"{name}_trainer"] = _error(
            lambda m=model: trainer(model=m, args=args, train_dataset=[], data_collator=collator, parallel=parallel)
        )
    for name, config in {"fsdp1": {"version": 1}, "unknown_key": {"version": 2, "transformer_layer_cls_to_wrapp": []},
                         "fsdp_ac": {"version": 2, "activation_checkpointing": True},
                         "offload": {"version": 2, "cpu_offload": True}}.items():  # fmt: skip
        args = TrainingArguments(output_dir=output_dir, fsdp=True, fsdp_config=config, **SGD_RUN)
        errors[name] = _error(lambda a=args: hf.mesh_cp_trainer_class()(model=_model(), args=a, train_dataset=[],
                                                                        parallel=parallel, pad_token_id=0))  # fmt: skip
    not_distributed = types.SimpleNamespace(
        fsdp=True, fsdp_config={"version": 2}, parallel_mode=ParallelMode.NOT_PARALLEL
    )
    errors["no_use_cpu"] = _error(lambda: check_launch(not_distributed))
    return errors


def _error(call) -> str:
    try:
        call()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _shares(trainer) -> dict:
    """The elements of parameters and of optimizer states this rank holds, and their totals over the ranks."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local().numel() if isinstance(t, DTensor) else t.numel()

    params = [p for p in trainer.model.parameters()]
    held = sum(local(p) for p in params)
    total = sum(p.numel() for p in params)
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    state_held = sum(local(t) for t in states)
    state_total = sum(t.numel() for t in states)
    every = [torch.zeros(4, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([held, total, state_held, state_total]))
    return {"held": [int(e[0]) for e in every], "total": int(every[0][1]), "state_held": [int(e[2]) for e in every],
            "state_total": int(every[0][3])}  # fmt: skip


def _layout(cp: int):
    from accelerate import PartialState

    from mesh_cp.integrations import hf
    from mesh_cp.testing import gloo_exit_workaround

    gloo_exit_workaround()
    PartialState()
    return hf.DataContextParallel.create(dist.group.WORLD, cp_size=cp, tile=(1, cp))


def launch_environment(config: Path, launched: Path = LAUNCHED) -> dict[str, str | None]:
    """What ``accelerate launch --config_file config`` puts in its processes' environment that the launch with
    ``launched`` (the project's CPU config, test_accelerate._accelerate) does not, worked out by accelerate's own
    launch code from this process's environment: name -> value, ``None`` for a name that launch leaves unset."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    def environment(path: Path) -> dict[str, str]:
        args = launch_command_parser().parse_args(["--config_file", str(path), __file__])
        return dict(prepare_multi_gpu_env(_validate_launch_command(args)[0]))

    given, wanted = environment(launched), environment(config)
    changed = {name: value for name, value in wanted.items() if given.get(name) != value}
    return changed | {name: None for name in given.keys() - wanted.keys()}


def _clear_accelerate_state() -> None:
    """Forget accelerate's process state (shared by every ``Accelerator`` of a process), as a new launch starts
    without it; the process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def launched_with(config: Path) -> Iterator[None]:
    """Inside: this process as a launch with ``config`` starts it (:func:`launch_environment`, accelerate's process
    state cleared); after: the environment as it was, accelerate's state cleared again."""
    saved = dict(os.environ)
    _clear_accelerate_state()
    for name, value in launch_environment(config).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assert os.environ.get("ACCELERATE_USE_FSDP") == "true", f"{config} does not launch with FSDP"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _clear_accelerate_state()


def main(out: str, mesh: bool, cases: list[str]) -> None:
    if mesh:
        _layout(1)  # the process group
    results = []
    for name in cases:
        from_config = mesh and CASES[name].get("accelerate_config", False)
        with (
            tempfile.TemporaryDirectory() as tmp,
            launched_with(FSDP_CONFIG) if from_config else contextlib.nullcontext(),
        ):
            if mesh:  # every rank writes to rank 0's checkpoint directory
                holder = [tmp]
                dist.broadcast_object_list(holder, src=0)
                results.append(run_case(name, mesh, holder[0]))
                dist.barrier()
            else:
                results.append(run_case(name, mesh, tmp))
        os.environ.pop("ACCELERATE_USE_FSDP", None)  # an Accelerator given FSDP settings sets it for the process
    write_results(out, results, mesh)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES))
    cli = parser.parse_args()
    main(cli.out, cli.mesh, cli.cases.split(","))
