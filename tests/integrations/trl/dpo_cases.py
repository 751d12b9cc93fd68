"""TRL's ``DPOTrainer`` cases of rl_script.py: single-process (``parallel`` None) or mesh_cp's
(``hf.mesh_cp_trainer_class(DPOTrainer)`` on ``parallel``), the same tiny model, pairs and seed; each returns every
step's logged loss and metrics."""

from __future__ import annotations

import copy

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer

from tests.integrations.clients import SGD_RUN
from tests.integrations.trl.sft_script import MODEL, texts, tokenizer

GLOBAL_BATCH, STEPS = 4, 3

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


def pairs(count: int = 16) -> Dataset:
    """Prompts with a chosen and a rejected completion of different lengths (rows of 7 to 40 tokens)."""
    prompts, chosen, rejected = texts(count, 3, 16, 11), texts(count, 2, 14, 12), texts(count, 2, 20, 13)
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def train(parallel, folder: str, *, ref_model: bool = True, **fields) -> dict:
    """Three steps of DPO on :func:`pairs` with ``fields`` set in ``DPOConfig``; every step's :data:`METRICS`."""
    dp = 1 if parallel is None else parallel.dp_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODEL(), attn_implementation="sdpa")
    args = DPOConfig(
        output_dir=folder,
        per_device_train_batch_size=GLOBAL_BATCH // dp,
        max_steps=STEPS,
        **({"learning_rate": 0.1, "beta": 0.5} | SGD_RUN | {"max_grad_norm": 1.0, "bf16": False} | fields),
    )
    trainer_class = DPOTrainer
    extra = {}
    if parallel is not None:
        from mesh_cp.integrations import hf

        trainer_class, extra = hf.mesh_cp_trainer_class(DPOTrainer), {"parallel": parallel}
    trainer = trainer_class(
        model=model,
        ref_model=copy.deepcopy(model) if ref_model else None,
        args=args,
        train_dataset=pairs(),
        processing_class=tokenizer(),
        **extra,
    )
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h.get(key) for h in steps] for key in METRICS}


CASES = {
    "sigmoid": lambda parallel, folder: train(parallel, folder),
    "sigmoid_weighting": lambda parallel, folder: train(parallel, folder, use_weighting=True),
    "ipo_sigmoid_precomputed": lambda parallel, folder: train(
        parallel, folder, ref_model=False, precompute_ref_log_probs=True, loss_type=["ipo", "sigmoid"],
        loss_weights=[1.0, 0.3],
    ),
    "sft_one_replica": lambda parallel, folder: train(parallel, folder, loss_type=["sigmoid", "sft"]),
    "hinge_ld_alpha_accumulation": lambda parallel, folder: train(
        parallel, folder, loss_type=["hinge"], ld_alpha=0.5, gradient_accumulation_steps=2,
    ),
}  # fmt: skip
