"""TRL's ``GRPOTrainer`` cases of rl_script.py: single-process (``parallel`` None) or mesh_cp's
(``hf.mesh_cp_trainer_class(GRPOTrainer)`` on ``parallel``), the same tiny model, prompts, reward and seed; each
returns every step's logged loss and metrics.

Both sides sample the same completions: greedy search over the logits plus Gumbel noise drawn from a generator
seeded by each row's tokens so far and its place in its prompt's group (:class:`KeyedSampling`), a sample of the
model's distribution that does not depend on how the prompts are cut into batches or replicas."""

from __future__ import annotations

import tempfile
import zlib

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from mesh_cp.testing.errors import expect_error
from tests.integrations.clients import SGD_RUN
from tests.integrations.trl.rl_common import logged, run_doc_block
from tests.integrations.trl.sft_script import MODEL, texts, tokenizer

GLOBAL_BATCH, STEPS, GENERATIONS = 4, 3, 2

METRICS = (
    "loss",
    "reward",
    "reward_std",
    "rewards/distinct/mean",
    "rewards/distinct/std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "grad_norm",
)
"""What GRPOTrainer logs every step, compared (``None`` where a case does not log it)."""


class KeyedSampling(LogitsProcessor):
    """Gumbel noise on the log-softmax of each row's logits, from a generator seeded by the row's non-pad tokens and
    its index in its group of ``generations`` rows; with greedy search, a sample of the model's distribution."""

    def __init__(self, generations: int) -> None:
        self.generations = generations

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = torch.empty_like(scores)
        for row, ids in enumerate(input_ids.tolist()):
            key = [t for t in ids if t != 0] + [row % self.generations]
            gen = torch.Generator().manual_seed(zlib.crc32(str(key).encode()))
            uniform = torch.rand(scores.shape[1], generator=gen).clamp(1e-12, 1 - 1e-7)
            noise[row] = -torch.log(-torch.log(uniform))
        return torch.log_softmax(scores.float(), -1) + noise


def keyed_sampling(model: torch.nn.Module) -> None:
    """Make ``model.generate`` sample with :class:`KeyedSampling` (greedy search over the noised logits)."""
    generate = model.generate

    def sampled(*args, **kwargs):
        return generate(*args, logits_processor=LogitsProcessorList([KeyedSampling(GENERATIONS)]), **kwargs)

    model.generate = sampled


def distinct(completions: list[str], **_) -> list[float]:
    """The reward: the share of distinct words in a completion (ties are rare, no group has zero spread)."""
    return [len(set(c.split())) / (1.0 + len(c.split())) for c in completions]


def model_path() -> str:
    """A folder holding the tiny model (seeded), written by the first process and read by every one (transformers
    writes a checkpoint on rank 0 only)."""
    import torch.distributed as dist

    folder = [tempfile.mkdtemp()]
    distributed = dist.is_initialized()
    if distributed:
        dist.broadcast_object_list(folder, src=0)
    if not distributed or dist.get_rank() == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(MODEL()).save_pretrained(folder[0])
    if distributed:
        dist.barrier()
    return folder[0]


def train(parallel, folder: str, rloo: bool = False, **fields) -> dict:
    """Three steps of GRPO (RLOO with ``rloo``) on 12 prompts with ``fields`` set in ``GRPOConfig``; every step's :data:`METRICS`."""
    dp = 1 if parallel is None else parallel.dp_size
    config_class, base = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    args = config_class(
        output_dir=folder,
        per_device_train_batch_size=GLOBAL_BATCH // dp,
        num_generations=GENERATIONS,
        max_completion_length=6,
        max_steps=STEPS,
        generation_kwargs={"do_sample": False},
        **({"learning_rate": 0.05} | SGD_RUN | {"max_grad_norm": 1.0, "bf16": False} | fields),
    )
    trainer_class, extra = base, {}
    if parallel is not None:
        from mesh_cp.integrations import hf

        trainer_class, extra = hf.mesh_cp_trainer_class(base), {"parallel": parallel}
    trainer = trainer_class(
        model=model_path(),
        reward_funcs=distinct,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts(12, 3, 9, 21)}),
        processing_class=tokenizer(),
        **extra,
    )
    keyed_sampling(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train()
    return logged(trainer, METRICS)


def doc_example(parallel, folder: str) -> dict:
    """The block of :func:`doc_block` as written (it samples), given a tiny model's folder, a reward, a tokenizer,
    prompts and an output folder, under mesh_cp (the block makes its own layout): the steps it trained and its layout.
    Run once (at DP 2 x CP 2); nothing in the single process."""
    if parallel is None or parallel.dp_size != 2:
        return {}
    scope = {"model_path": model_path(), "reward": distinct, "tokenizer": tokenizer(), "output_dir": folder}
    scope["prompts"] = Dataset.from_dict({"prompt": texts(8, 3, 9, 22)})
    return run_doc_block("grpo-example", scope)


def refusals(parallel, folder: str) -> dict:
    """What ``hf.mesh_cp_trainer_class(GRPOTrainer)`` refuses by name (under mesh_cp; nothing in the single
    process)."""
    if parallel is None:
        return {}
    from datasets import IterableDataset

    from mesh_cp.integrations import hf

    out: dict = {}
    trainer_class, path = hf.mesh_cp_trainer_class(GRPOTrainer), model_path()
    prompts = Dataset.from_dict({"prompt": texts(4, 3, 9, 23)})

    def build(data=prompts, **given):
        fields = {"per_device_train_batch_size": 2, "num_generations": 2, "max_steps": 1}
        fields |= {
            k: given.pop(k) for k in list(given) if k in ("use_vllm", "per_device_train_batch_size", "num_generations")
        }
        args = GRPOConfig(output_dir=folder, **(SGD_RUN | fields))
        return trainer_class(
            model=path,
            reward_funcs=distinct,
            args=args,
            train_dataset=data,
            processing_class=tokenizer(),
            parallel=parallel,
            **given,
        )

    expect_error(
        out, "generation_batch", ValueError, r"generation batch.* = 1 x \d x 1 = \d completions, is not a multiple of "
        r"num_generations=4", lambda: build(per_device_train_batch_size=1, num_generations=4),
    )  # fmt: skip
    expect_error(out, "use_vllm", NotImplementedError, r"use_vllm=True: vLLM", lambda: build(use_vllm=True))
    expect_error(
        out, "rollout_func", NotImplementedError, r"rollout_func given", lambda: build(rollout_func=lambda p, t: {})
    )
    expect_error(out, "tools", NotImplementedError, r"tools given: the tool-call loop", lambda: build(tools=[len]))
    iterable = IterableDataset.from_generator(lambda: iter([{"prompt": "w1 w2"}] * 4))
    expect_error(out, "iterable", NotImplementedError, r"IterableDataset", lambda: build(data=iterable))
    expect_error(out, "evaluate", NotImplementedError, r"evaluate\(\)", lambda: build().evaluate())
    return out


CASES = {
    "grpo_kl": lambda parallel, folder: train(parallel, folder, loss_type="grpo", beta=0.1),
    "dapo_two_iterations_entropy_mask": lambda parallel, folder: train(
        parallel, folder, loss_type="dapo", num_iterations=2, top_entropy_quantile=0.5
    ),
    "dr_grpo_batch_scale": lambda parallel, folder: train(
        parallel, folder, loss_type="dr_grpo", scale_rewards="batch", beta=0.05
    ),
    "bnpo_sequence_level_two_iterations": lambda parallel, folder: train(
        parallel, folder, loss_type="bnpo", importance_sampling_level="sequence", num_iterations=2
    ),
    "cispo_two_iterations": lambda parallel, folder: train(parallel, folder, loss_type="cispo", num_iterations=2),
    "sapo_kl": lambda parallel, folder: train(parallel, folder, loss_type="sapo", beta=0.05),
    "rloo_kl": lambda parallel, folder: train(parallel, folder, rloo=True, beta=0.1),
    "doc_example": doc_example,
    "refusals": refusals,
}
