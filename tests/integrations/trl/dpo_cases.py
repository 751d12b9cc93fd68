"""TRL's ``DPOTrainer`` cases of rl_script.py: single-process (``parallel`` None) or mesh_cp's
(``hf.mesh_cp_trainer_class(DPOTrainer)`` on ``parallel``), the same tiny model, pairs and seed; each returns every
step's logged loss and metrics."""

from __future__ import annotations

import copy

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer

from mesh_cp.testing.errors import expect_error
from mesh_cp.testing.models import tiny_config
from tests.integrations.clients import SGD_RUN
from tests.integrations.trl.rl_common import logged, run_doc_block
from tests.integrations.trl.sft_script import texts, tokenizer

GLOBAL_BATCH, STEPS = 4, 3


def MODEL():  # noqa: N802
    """A tiny GQA Llama whose per-token log-probs (about -4.7) keep a sequence's sum, and its fp32 rounding, small."""
    return tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.2)


METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
    "grad_norm",
)
"""What DPOTrainer logs every step, compared."""


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def pairs(count: int = 16) -> Dataset:
    """Prompts with a chosen and a rejected completion of different lengths (rows of 7 to 40 tokens)."""
    prompts, chosen, rejected = texts(count, 3, 16, 11), texts(count, 2, 14, 12), texts(count, 2, 20, 13)
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def train(parallel, folder: str, *, ref_model: bool = True, data: Dataset | None = None, peft=None, **fields) -> dict:
    """Three steps of DPO on :func:`pairs` with ``fields`` set in ``DPOConfig``; every step's :data:`METRICS`."""
    dp = 1 if parallel is None else parallel.dp_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODEL(), attn_implementation="sdpa")
    args = DPOConfig(
        output_dir=folder,
        per_device_train_batch_size=GLOBAL_BATCH // dp,
        **(
            {"max_steps": STEPS, "learning_rate": 0.2, "beta": 0.1}
            | SGD_RUN
            | {"max_grad_norm": 1.0, "bf16": False}
            | fields
        ),
    )
    trainer_class = DPOTrainer
    extra = {}
    if parallel is not None:
        from mesh_cp.integrations import hf

        trainer_class, extra = hf.mesh_cp_trainer_class(DPOTrainer), {"parallel": parallel}
    trainer = trainer_class(
        model=model,
        ref_model=copy.deepcopy(model) if ref_model and peft is None else None,
        args=args,
        train_dataset=pairs() if data is None else data,
        peft_config=peft,
        processing_class=tokenizer(),
        **extra,
    )
    trainer.train()
    return logged(trainer, METRICS)


def doc_example(parallel, folder: str) -> dict:
    """The block of :func:`doc_block` as written, given a tiny model, its reference copy, a tokenizer, pairs and an
    output folder, under mesh_cp (the block makes its own layout): the steps it trained and its layout. Run once (at
    DP 2 x CP 2); nothing in the single process."""
    if parallel is None or parallel.dp_size != 2:
        return {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODEL())
    scope = {"model": model, "ref_model": copy.deepcopy(model), "tokenizer": tokenizer(), "pairs": pairs()}
    scope["output_dir"] = folder
    return run_doc_block("dpo-example", scope)


def refusals(parallel, folder: str) -> dict:
    """What ``hf.mesh_cp_trainer_class(DPOTrainer)`` refuses by name (under mesh_cp; nothing in the single process)."""
    if parallel is None:
        return {}
    from mesh_cp.integrations import hf

    out: dict = {}
    trainer_class = hf.mesh_cp_trainer_class(DPOTrainer)

    def build(peft=None, **fields):
        args = DPOConfig(output_dir=folder, per_device_train_batch_size=2, max_steps=1, **(SGD_RUN | fields))
        model = AutoModelForCausalLM.from_config(MODEL())
        given = {"model": model, "ref_model": None if peft else copy.deepcopy(model), "args": args}
        return trainer_class(
            **given, processing_class=tokenizer(), train_dataset=pairs(4), peft_config=peft, parallel=parallel
        )

    from peft import PromptTuningConfig

    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    expect_error(
        out, "prompt_tuning", NotImplementedError, r"PromptTuningConfig\) prepends virtual tokens",
        lambda: build(peft=prompt_tuning),
    )  # fmt: skip
    expect_error(out, "evaluate", NotImplementedError, r"evaluate\(\)", lambda: build().evaluate())
    expect_error(
        out, "eval_strategy", NotImplementedError, r"eval_strategy=.*steps", lambda: build(eval_strategy="steps")
    )
    expect_error(
        out, "neftune", NotImplementedError, r"neftune_noise_alpha=5\.0", lambda: build(neftune_noise_alpha=5.0)
    )
    expect_error(out, "no_parallel", ValueError, r"needs parallel=", lambda: trainer_class(model=None, args=None))
    expect_error(
        out, "router_logits", NotImplementedError, r"\['output_router_logits'\].*MoE router logits",
        lambda: build().model(input_ids=torch.ones(2, 8, dtype=torch.long), output_router_logits=True, fused_lm_head=True),
    )  # fmt: skip
    return out


CASES = {
    "sigmoid": lambda parallel, folder: train(parallel, folder),
    "sigmoid_weighting": lambda parallel, folder: train(parallel, folder, use_weighting=True),
    "ipo_sigmoid_precomputed": lambda parallel, folder: train(
        parallel, folder, ref_model=False, precompute_ref_log_probs=True, loss_type=["ipo", "sigmoid"],
        loss_weights=[1.0, 0.3], beta=0.5,
    ),
    "sft_one_replica": lambda parallel, folder: train(parallel, folder, loss_type=["sigmoid", "sft"]),
    "hinge_ld_alpha_accumulation_sync_ref": lambda parallel, folder: train(
        parallel, folder, loss_type=["hinge"], ld_alpha=0.5, gradient_accumulation_steps=2,
        sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
    ),
    "lora_reference_without_adapter": lambda parallel, folder: train(parallel, folder, peft=_lora()),
    "short_last_batch": lambda parallel, folder: train(
        parallel, folder, data=pairs(7), max_steps=-1, num_train_epochs=1
    ),
    "doc_example": doc_example,
    "refusals": refusals,
}  # fmt: skip
