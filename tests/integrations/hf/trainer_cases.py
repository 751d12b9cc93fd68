"""transformers' ``Trainer``, single-process or with mesh_cp on 4 processes (DP 2 x CP 2, tile 1x2), on the same data
and seed, one case per option that changes what is trained or reported: one JSON line per case with every step's
loss, the token counter, the throughput and ``evaluate()`` / ``predict()`` with a partial last batch.

    python trainer_cases.py OUT.json                         # the single-process reference (batches of DP x B)
    accelerate launch ... trainer_cases.py OUT.json --mesh   # mesh_cp

test_trainer.py runs both and compares them case by case.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

from mesh_cp.testing.models import VOCAB, tiny_config
from tests.integrations.clients import SGD_RUN, launched_layout, padded, samples, write_results

DP, CP, BATCH, STEPS = 2, 2, 2, 4
EVAL_BATCH, EVAL_EXAMPLES = 2, 5  # the replicas get 2 and 1 batches, the last one short

CASES: dict[str, dict] = {
    "random": {},
    "sequential": {"train_sampling_strategy": "sequential"},
    "group_by_length": {"train_sampling_strategy": "group_by_length"},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "gradient_accumulation": {"gradient_accumulation_steps": 2},
    "drop_last": {"dataloader_drop_last": True, "max_steps": -1, "num_train_epochs": 1},
    "tokens_non_padding": {"include_num_input_tokens_seen": "non_padding"},
    "data_seed": {"data_seed": 7},
    "flattening": {"collator": "flattening"},
    "hybrid_mamba2": {"model": "bamba"},
}
"""Case name -> TrainingArguments fields (``collator``: ``"flattening"`` for transformers' padding-free
``DataCollatorWithFlattening`` with its flash-attention keywords and ``seq_idx``; default a padding collator;
``model``: ``"bamba"`` for a hybrid of Mamba 2 and attention layers, default a Llama)."""


def model_config(kind: str | None = None):
    """A tiny GQA Llama with weights large enough that its predictions are far from uniform (``kind="bamba"``: a
    Bamba, Mamba 2 then attention, with weights half as large: at 0.5 its scan's fp32 roundoff, which sums in
    another order over a rank's heads, grows to 1e-5 of the gradients)."""
    if kind == "bamba":
        return tiny_config(
            "BambaConfig",
            num_key_value_heads=2,
            initializer_range=0.25,
            pad_token_id=0,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=8,
        )
    return tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.5, pad_token_id=0)


class Tokenizer:
    """What DataCollatorForLanguageModeling reads of a tokenizer (pad token 0, right padding)."""

    pad_token_id, pad_token, padding_side, model_input_names = 0, "<pad>", "right", ["input_ids"]

    def pad(self, examples, return_tensors="pt", pad_to_multiple_of=None, **_):
        ids, mask = padded(examples)
        return {"input_ids": ids, "attention_mask": mask}


def examples(count: int, low: int, high: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in lengths]


def run_case(name: str, mesh, output_dir: str) -> dict:
    train, held_out = examples(18, 6, 30, 1), examples(EVAL_EXAMPLES, 6, 20, 2)
    fields = {"max_steps": STEPS} | CASES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(fields.pop("model", None)), attn_implementation="sdpa")
    packed = fields.pop("collator", None) == "flattening"
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH if mesh is not None else BATCH * DP,
        per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=0.05,
        **(SGD_RUN | fields),
    )
    if packed:  # one row of documents; single-process SDPA keeps them apart by their restarting position_ids
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    else:
        collator = DataCollatorForLanguageModeling(Tokenizer(), mlm=False)
    if mesh is None:
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    else:
        from mesh_cp.integrations import hf

        trainer = hf.mesh_cp_trainer_class()(
            model=model, args=args, train_dataset=train, data_collator=collator, parallel=mesh
        )
    before = trainer.evaluate(held_out)
    metrics = trainer.train().metrics
    steps = [h for h in trainer.state.log_history if "loss" in h]
    args.prediction_loss_only = True
    predicted = trainer.predict(held_out).metrics
    return {
        "case": name,
        "loss": [h["loss"] for h in steps],
        "tokens_seen": [h.get("num_input_tokens_seen") for h in steps],
        "eval_loss_before": before["eval_loss"],
        "eval_samples": samples(before, "eval"),
        "test_loss": predicted["test_loss"],
        "train_samples": samples(metrics, "train"),
    }


def main(out: str, mesh: bool, cases: list[str]) -> None:
    parallel = launched_layout(CP, DP) if mesh else None
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(name, parallel, tmp) for name in cases]
    write_results(out, results, mesh)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES))
    cli = parser.parse_args()
    main(cli.out, cli.mesh, cli.cases.split(","))
