"""TRL's ``SFTTrainer``, single-process or with mesh_cp on 4 processes (DP 2 x CP 2, tile 1x2), on the same data and
seed: one JSON line per case with what the trainer reported (every step's loss, TRL's ``num_tokens``, token accuracy
and entropy, the eval loss, throughput).

    python sft_script.py OUT.json                      # the single-process reference (global batches of DP x B)
    accelerate launch ... sft_script.py OUT.json --mesh   # mesh_cp: every replica B examples of each batch

test_trl.py runs both and compares them case by case.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from unittest import mock

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from mesh_cp.testing.models import VOCAB, tiny_config
from tests.integrations.clients import SGD_RUN, launched_layout, samples, write_results

DP, CP, BATCH, STEPS = 2, 2, 2, 3


def MODEL():  # noqa: N802
    """A tiny GQA Llama with weights large enough that its predictions are far from uniform (a wrong position or
    a document boundary crossed moves the loss by far more than rounding does)."""
    return tiny_config("LlamaConfig", num_key_value_heads=2, initializer_range=0.5)


EVAL_BATCH, EVAL_EXAMPLES = 2, 5  # the replicas get 2 and 1 batches, the last one short


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary: ``<pad>`` 0, ``<eos>`` 1, words ``w0``, ``w1``..."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos> "
    "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)
"""Turns laid back to back, each assistant turn ending in ``<eos>`` and marked for ``assistant_only_loss``."""


def texts(count: int, low: int, high: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [" ".join(f"w{int(w)}" for w in torch.randint(0, VOCAB - 2, (n,), generator=gen)) for n in lengths]


def datasets() -> dict[str, Dataset]:
    prompts, completions = texts(16, 4, 10, 3), texts(16, 3, 12, 4)
    return {
        "ragged": Dataset.from_dict({"text": texts(16, 10, 30, 1)}),
        "ragged_10": Dataset.from_dict({"text": texts(16, 10, 30, 1)[:10]}),  # batches of 4, 4 and a short 2
        "short": Dataset.from_dict({"text": texts(48, 3, 14, 2)}),  # several documents per packed row
        "completion": Dataset.from_dict({"prompt": prompts, "completion": completions}),
        "chat": Dataset.from_dict(
            {
                "messages": [
                    [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                    for p, c in zip(prompts, completions, strict=True)
                ]
            }
        ),
        "eval": Dataset.from_dict({"text": texts(EVAL_EXAMPLES, 8, 20, 5)}),
    }


CASES: dict[str, tuple[str, dict]] = {
    "padded": ("ragged", {}),
    "packing_bfd": ("short", {"packing": True, "max_length": 40}),
    "packing_wrapped": ("short", {"packing": True, "packing_strategy": "wrapped", "max_length": 40}),
    "padding_free": ("ragged", {"padding_free": True, "max_length": None}),
    "completion_only": ("completion", {"completion_only_loss": True}),
    # At learning rate 0.1 this case's loss rises (7.78, 8.30, 7.16) and the single process's own rounding grows about
    # fivefold a step (the mesh run 5e-7, 4e-6, 2e-5 from it): a smaller step keeps the comparison one of exactness.
    "assistant_only": ("chat", {"assistant_only_loss": True, "learning_rate": 0.02}),
    "no_gradient_checkpointing": ("short", {"packing": True, "max_length": 40, "gradient_checkpointing": False}),
    "bf16": ("ragged", {"bf16": True}),
    "sequential": ("ragged_10", {"train_sampling_strategy": "sequential"}),  # step 3: the epoch's short batch
    # TRL's saved-tensor hooks (cpu_offloading): with gradient checkpointing they see the checkpointed layers' inputs,
    # without it every tensor autograd saves, mesh_cp attention's among them.
    "activation_offloading": ("short", {"packing": True, "max_length": 40, "activation_offloading": True}),
    "activation_offloading_no_gc": (
        "short",
        {"packing": True, "max_length": 40, "activation_offloading": True, "gradient_checkpointing": False},
    ),
}
"""Case name -> (train set, SFTConfig fields beside :data:`BASE`). Every case also evaluates on the eval set."""

BASE = {"bf16": False, "gradient_checkpointing": True}
"""SFTConfig's defaults are bf16 autocast and gradient checkpointing: the cases run in fp32 (exact to rounding) with
gradient checkpointing unless they say otherwise."""


EVAL_KEYS = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")


def cpu_offloading(model: torch.nn.Module, **_):
    """TRL's activation offloading manager (``get_act_offloading_ctx_manager``) made for the CPU, its hooks counted:
    ``manager.counts`` holds the tensors it offloaded, how many of them mesh_cp's attention saved, and how many it
    brought back in backward.

    Notes:
        TRL makes it for ``torch.accelerator.current_accelerator()``, which is None on a CPU-only torch:
        ``SFTConfig(activation_offloading=True)`` then raises AttributeError in ``SFTTrainer.__init__``. Made with the
        CPU as its accelerator, its pack hook offloads every saved tensor of at least 1 KiB that is not a parameter
        (copies it to fresh host memory; the original is freed once the forward drops it) and its unpack hook hands
        the copy back with the original's strides. Pinned memory and the side stream need a device: this is its
        single-stream path, unpinned; the stream path (events, the forward stash, storage deduplication) does not run.
    """
    from trl.models import activation_offloading

    with mock.patch.object(torch.accelerator, "current_accelerator", return_value=torch.device("cpu")):
        manager = activation_offloading.get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)
    counts = manager.counts = {"offloaded": 0, "in_mesh_attention": 0, "restored": 0}
    pack, unpack = manager.pack_hook, manager.unpack_hook

    def counted_pack(tensor: torch.Tensor) -> int:
        tensor_id = pack(tensor)
        if manager.tracker[tensor_id][1]:  # offloaded, not kept
            counts["offloaded"] += 1
            counts["in_mesh_attention"] += _in_mesh_attention()
        return tensor_id

    def counted_unpack(tensor_id: int) -> torch.Tensor:
        counts["restored"] += bool(manager.tracker.get(tensor_id, (None, False))[1])
        return unpack(tensor_id)

    manager.pack_hook, manager.unpack_hook = counted_pack, counted_unpack  # read when the manager is entered
    return manager


def _in_mesh_attention() -> bool:
    """Whether the tensor being packed is one mesh_cp's attention Function saves (its ``mesh_attn_func`` call is on
    the stack: autograd packs a Function's saved tensors as its ``apply`` returns)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "mesh_attn_func" and code.co_filename.endswith(os.path.join("runtime", "attention.py")):
            return True
        frame = frame.f_back
    return False


def run_case(name: str, mesh, output_dir: str, deepspeed: str | None = None) -> dict:
    """One case: single-process ``SFTTrainer`` when ``mesh`` is None, else mesh_cp's on the layout ``mesh`` (or, with
    ``deepspeed``, the layout the trainer builds from that config's ``"mesh_attention"`` block)."""
    data, fields = CASES[name]
    sets = datasets()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODEL(), attn_implementation="sdpa")
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH if mesh is not None or deepspeed else BATCH * DP,
        per_device_eval_batch_size=EVAL_BATCH,
        max_steps=STEPS,
        deepspeed=deepspeed,
        **({"learning_rate": 0.1} | SGD_RUN | BASE | fields),
    )
    if mesh is None and deepspeed is None:
        trainer_class = SFTTrainer
    else:
        from mesh_cp.integrations import hf

        trainer_class = hf.mesh_cp_trainer_class(SFTTrainer)
    extra = {} if mesh is None else {"parallel": mesh}  # with deepspeed: built from the config's block
    with mock.patch("trl.trainer.sft_trainer.get_act_offloading_ctx_manager", cpu_offloading):
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=sets[data],
            eval_dataset=sets["eval"],
            processing_class=tokenizer(),
            **extra,
        )
    # The same weights on both sides: rounding apart, equal. Not with DeepSpeed, where evaluate() before train()
    # leaves Trainer without a training engine (transformers' own limitation, huggingface/transformers#44889).
    before = trainer.evaluate() if deepspeed is None else dict.fromkeys(EVAL_KEYS)
    metrics = trainer.train().metrics
    steps = [h for h in trainer.state.log_history if "loss" in h]
    evaluated = trainer.evaluate()
    return {
        "case": name,
        "eval_loss_before": before["eval_loss"],
        "eval_entropy_before": before["eval_entropy"],
        "eval_accuracy_before": before["eval_mean_token_accuracy"],
        "loss": [h["loss"] for h in steps],
        "num_tokens": [h["num_tokens"] for h in steps],
        "mean_token_accuracy": [h["mean_token_accuracy"] for h in steps],
        "entropy": [h["entropy"] for h in steps],
        "eval_loss": evaluated["eval_loss"],
        "eval_samples": samples(evaluated, "eval"),
        "train_samples": samples(metrics, "train"),
        "offloading": getattr(trainer.maybe_activation_offload_context, "counts", None),
    }


REFUSED = {
    "label_smoothing_factor": {"label_smoothing_factor": 0.1},
    "neftune_noise_alpha": {"neftune_noise_alpha": 5.0},
    "average_tokens_across_devices": {"average_tokens_across_devices": False},
    "batch_rebalance": {"train_sampling_strategy": "batch_rebalance"},
    "use_liger_kernel": {"use_liger_kernel": True},
    "include_num_input_tokens_seen": {"include_num_input_tokens_seen": "all"},
    "use_cpu": {"use_cpu": False},  # last: accelerate then takes the CPU run for one process (the next sets it back)
}
"""Options the mesh_cp trainer refuses, with the fields that set them; the message must name the option."""


def refusals(mesh, output_dir: str) -> dict[str, str]:
    """The message of each refused option (:data:`REFUSED`), "accepted" if it was not refused."""
    from mesh_cp.integrations import hf

    messages = {}
    for name, fields in REFUSED.items():
        # accelerate launch's ACCELERATE_USE_CPU=true would stand in for use_cpu=True: a plain torchrun has none
        launched_cpu = os.environ.pop("ACCELERATE_USE_CPU", None) if name == "use_cpu" else None
        try:
            args = SFTConfig(**({"output_dir": output_dir, "use_cpu": True, "report_to": []} | BASE | fields))
            model = AutoModelForCausalLM.from_config(MODEL(), attn_implementation="sdpa")
            hf.mesh_cp_trainer_class(SFTTrainer)(
                model=model, args=args, train_dataset=datasets()["ragged"], processing_class=tokenizer(), parallel=mesh
            )
        except (ValueError, NotImplementedError, ImportError) as err:
            messages[name] = f"{type(err).__name__}: {err}"
        else:
            messages[name] = "accepted"
        finally:
            if launched_cpu is not None:
                os.environ["ACCELERATE_USE_CPU"] = launched_cpu
    return messages


def deepspeed_refusal(deepspeed: str, output_dir: str) -> str:
    """The message of a DeepSpeed run on CPU without ``use_cpu=True`` (accelerate takes it for one process), or
    "accepted"."""
    from mesh_cp.integrations import hf

    args = SFTConfig(output_dir=output_dir, deepspeed=deepspeed, **(SGD_RUN | BASE | {"use_cpu": False}))
    model = AutoModelForCausalLM.from_config(MODEL(), attn_implementation="sdpa")
    try:
        hf.mesh_cp_trainer_class(SFTTrainer)(
            model=model, args=args, train_dataset=datasets()["ragged"], processing_class=tokenizer()
        )
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def main(out: str, mesh: bool, cases: list[str], deepspeed: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if deepspeed:  # the deepspeed launcher; the trainer makes the process group and the layout
            from mesh_cp.testing import gloo_exit_workaround

            gloo_exit_workaround()
            results = [run_case(name, None, tmp, deepspeed) for name in cases]
            results.append({"case": "refusals", "messages": {"use_cpu": deepspeed_refusal(deepspeed, tmp)}})
        else:
            parallel = launched_layout(CP, DP) if mesh else None
            results = [run_case(name, parallel, tmp) for name in cases]
            if mesh:
                results.append({"case": "refusals", "messages": refusals(parallel, tmp)})
    write_results(out, results, mesh or deepspeed is not None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed config with a mesh_attention block")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--cases", default=",".join(CASES))
    cli = parser.parse_args()
    main(cli.out, cli.mesh, cli.cases.split(","), cli.deepspeed)
