"""A PEFT LoRA adapter on a tiny Llama trained by transformers' ``Trainer``: in one process (the reference, global
batches of DP x B), or by ``hf.mesh_cp_trainer_class()`` under DeepSpeed ZeRO 3 on 4 processes, the DP 2 x CP 2
layout (tile 1x2) built from the config's ``"mesh_attention"`` block. Same data, seed and optimizer (Trainer's
``optim="sgd"``: DeepSpeed wraps the torch optimizer Trainer builds, so both sides step with ``torch.optim.SGD``).

    python lora_script.py OUT.json                                          # the single-process reference
    deepspeed --num_gpus 4 lora_script.py OUT.json --deepspeed CONFIG       # mesh_cp + ZeRO 3

Writes one JSON object: every step's loss, the names of the trainable parameters and their final full values; under
DeepSpeed also how ZeRO 3 partitioned them on every rank (:func:`partitions`). test_lora.py runs both and compares.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from mesh_cp.testing.models import tiny_config
from tests.integrations.clients import SGD_RUN
from tests.integrations.hf.trainer_cases import examples

DP, BATCH, STEPS = 2, 2, 3
LR = 0.02
"""SGD's rate. At 0.1 the steps are large enough that fp32 roundoff in the first layer's ``q_proj`` adapter grows to
2e-5 of the weights in 3 steps in the single process itself (against the same run in fp64); at 0.02 it stays near
2e-7, so the comparison of the weights is one of exactness."""
TARGETS = ("q_proj", "v_proj")


def lora_model() -> torch.nn.Module:
    """The tiny GQA Llama (weights at 0.5: predictions far from uniform) with a rank-4 LoRA adapter on ``q_proj`` and
    ``v_proj`` whose B is not zero (``init_lora_weights=False``: the adapter changes the output from the first step)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.5, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return get_peft_model(model, LoraConfig(r=4, target_modules=list(TARGETS), init_lora_weights=False))


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def partitions(trainer) -> dict:
    """How ZeRO 3 holds the model on this rank: for the trainable parameters and for the frozen ones, the elements
    of the full parameters (``ds_numel``), of this rank's partitions (``ds_tensor``) and of the parameters as the
    module sees them outside a forward (0 once released); the elements of the optimizer's fp32 partition; the
    engine's ZeRO stage and data-parallel world."""
    engine = trainer.model_wrapped
    out = {"stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size}
    # ds_persist: a parameter under stage3_param_persistence_threshold, kept whole on every rank after a forward
    for kind, wanted in (("trainable", True), ("frozen", False)):
        params = [p for p in engine.module.parameters() if p.requires_grad is wanted]
        out[kind] = {
            "count": len(params),
            "full": sum(p.ds_numel for p in params),
            "held": sum(p.ds_tensor.numel() for p in params),
            "visible": sum(p.numel() for p in params),
            "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in params),
        }
    flat = engine.optimizer.fp32_partitioned_groups_flat
    out["optimizer_fp32"] = sum(t.numel() for t in flat)
    return out


def final_trainable(trainer, deepspeed: bool) -> dict[str, list]:
    """The trained adapter's full fp32 weights by name (gathered from the ZeRO 3 partitions under DeepSpeed)."""
    model = trainer.model_wrapped.module if deepspeed else trainer.model
    if not deepspeed:
        return {name: p.detach().tolist() for name, p in trainable(model)}
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().tolist() for name, p in trainable(model)}


def main(out: str, deepspeed: str | None) -> None:
    import torch.distributed as dist

    if deepspeed:  # the deepspeed launcher; the trainer makes the process group and the layout
        from mesh_cp.integrations import hf
        from mesh_cp.testing import gloo_exit_workaround

        gloo_exit_workaround()
        trainer_class = hf.mesh_cp_trainer_class(Trainer)
        extra = {"pad_token_id": 0}
    else:
        from mesh_cp.integrations.hf.collate import PadExamples

        trainer_class, extra = Trainer, {"data_collator": PadExamples(0)}
    model = lora_model()
    names = [name for name, _ in trainable(model)]
    initial = {name: p.detach().clone() for name, p in trainable(model)}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=BATCH if deepspeed else BATCH * DP,
            max_steps=STEPS,
            deepspeed=deepspeed,
            **(SGD_RUN | {"learning_rate": LR}),
        )
        trainer = trainer_class(model=model, args=args, train_dataset=examples(16, 6, 30, 1), **extra)
        trainer.train()
    result = {
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "trainable_before": names,
        "params": final_trainable(trainer, bool(deepspeed)),
    }
    result["moved"] = max((torch.tensor(result["params"][n]) - w).abs().max().item() for n, w in initial.items())
    if deepspeed:
        result["layout"] = str(trainer.parallel)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, partitions(trainer))
        result["partitions"] = every
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    else:
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed config with a mesh_attention block")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    cli = parser.parse_args()
    main(cli.out, cli.deepspeed)
