"""TRL's ``RewardTrainer`` cases of rl_script.py: single-process (``parallel`` None) or mesh_cp's
(``hf.mesh_cp_trainer_class(RewardTrainer)`` on ``parallel``), the same tiny reward model, pairs and seed; each returns
every step's logged loss and metrics. ``doc_example`` runs the RewardTrainer block of docs/hf.md under mesh_cp (its
own DP 2 x CP 2 layout, once), ``refusals`` what the mixin refuses (under mesh_cp only)."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from mesh_cp.testing import expect_error
from mesh_cp.testing.models import tiny_config
from tests.integrations.clients import SGD_RUN
from tests.integrations.trl.rl_common import logged, run_doc_block
from tests.integrations.trl.sft_script import texts, tokenizer

GLOBAL_BATCH, STEPS = 4, 3

METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens", "grad_norm")
"""What RewardTrainer logs every step, compared."""


def model_config():
    """A tiny GQA Llama reward model (one label), weights large enough that the rewards of different rows differ."""
    return tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.2, num_labels=1)


def pairs(count: int = 16, *, margin: bool = False, prompt: bool = False) -> Dataset:
    """A chosen and a rejected text of different lengths per example (odd and even, 2 to 20 words; TRL appends
    ``<eos>``), with a ``margin`` column or a ``prompt`` before both when asked."""
    data = {"chosen": texts(count, 2, 20, 21), "rejected": texts(count, 2, 15, 22)}
    if prompt:
        data["prompt"] = [t + " " for t in texts(count, 1, 6, 23)]
    if margin:
        data["margin"] = torch.linspace(-0.5, 1.5, count).tolist()
    return Dataset.from_dict(data)


def train(parallel, folder: str, *, data: Dataset | None = None, pad_is_eos: bool = False, **fields) -> dict:
    """Three steps of RewardTrainer on :func:`pairs` (or ``data``) with ``fields`` set in ``RewardConfig``; every
    step's :data:`METRICS`."""
    dp = 1 if parallel is None else parallel.dp_size
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(model_config(), attn_implementation="sdpa")
    args = RewardConfig(
        output_dir=folder,
        per_device_train_batch_size=GLOBAL_BATCH // dp,
        **({"learning_rate": 0.1, "max_steps": STEPS} | SGD_RUN | {"max_grad_norm": 1.0, "bf16": False} | fields),
    )
    tok = tokenizer()
    if pad_is_eos:  # the pooled token is then the last word, before TRL's <eos> (one process's choice)
        tok.pad_token = tok.eos_token
    trainer_class, extra = RewardTrainer, {}
    if parallel is not None:
        from mesh_cp.integrations import hf

        trainer_class, extra = hf.mesh_cp_trainer_class(RewardTrainer), {"parallel": parallel}
    trainer = trainer_class(
        model=model, args=args, train_dataset=pairs() if data is None else data, processing_class=tok, **extra
    )
    trainer.train()
    return logged(trainer, METRICS)


def doc_example(parallel, folder: str) -> dict:
    """The docs block as written, given a tiny reward model, tokenizer, pairs and output folder, under
    mesh_cp (the block makes its own layout): the steps it trained and its layout. Run once (at DP 2 x
    CP 2); nothing in the single process."""
    if parallel is None or parallel.dp_size != 2:
        return {}
    torch.manual_seed(0)
    scope = {
        "model": AutoModelForSequenceClassification.from_config(model_config()),
        "tokenizer": tokenizer(),
        "pairs": pairs(),
        "output_dir": folder,
    }
    return run_doc_block("reward-example", scope)


def refusals(parallel, folder: str) -> dict:
    """What ``hf.mesh_cp_trainer_class(RewardTrainer)`` refuses by name (under mesh_cp; nothing in the single
    process)."""
    if parallel is None:
        return {}
    from peft import LoraConfig

    from mesh_cp.integrations import hf

    out: dict = {}
    args = RewardConfig(output_dir=folder, per_device_train_batch_size=2, max_steps=1, **SGD_RUN)
    model = AutoModelForSequenceClassification.from_config(model_config())
    trainer_class = hf.mesh_cp_trainer_class(RewardTrainer)
    given = {"model": model, "args": args, "train_dataset": pairs(4), "processing_class": tokenizer()}
    expect_error(
        out, "peft", NotImplementedError, r"PEFT adapter calls the classifier's forward directly",
        lambda: trainer_class(**given, peft_config=LoraConfig(task_type="SEQ_CLS"), parallel=parallel),
    )  # fmt: skip
    expect_error(
        out, "evaluate", NotImplementedError, r"evaluate\(\)",
        lambda: trainer_class(**given, parallel=parallel).evaluate(),
    )  # fmt: skip
    return out


CASES = {
    "plain": lambda parallel, folder: train(parallel, folder),
    "margin": lambda parallel, folder: train(parallel, folder, data=pairs(margin=True)),
    "center_rewards": lambda parallel, folder: train(parallel, folder, center_rewards_coefficient=0.3),
    "pad_is_eos_prompt": lambda parallel, folder: train(
        parallel, folder, data=pairs(prompt=True), pad_is_eos=True, gradient_checkpointing=False
    ),
    "short_last_batch": lambda parallel, folder: train(
        parallel, folder, data=pairs(7), max_steps=-1, num_train_epochs=1
    ),
    "doc_example": doc_example,
    "refusals": refusals,
}
