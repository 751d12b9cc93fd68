"""What the examples share: the fine-tuning examples' text, tokenizer, model and options (accelerate and
DeepSpeed), the device every example binds before its process group, and the result line every example
prints last.

Nothing is downloaded: the text is the Python standard library's source, read from this machine, and
the tokenizer is a byte-level BPE trained on it with the ``tokenizers`` library. The model is a small
Llama (transformers) built from the command-line options.

The examples are scripts, not part of the installed package: each puts the repository root on
``sys.path`` and imports this module as ``examples.common``.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch


def local_corpus(max_bytes: int) -> str:
    """Up to ``max_bytes`` of text: the Python standard library's ``.py`` files in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    return "".join(parts)[:max_bytes]


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on ``text`` (deterministic for the same text), as a transformers
    ``PreTrainedTokenizerFast`` with ``<pad>`` and ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def token_sequences(text: str, tokenizer, seq_len: int) -> torch.Tensor:
    """The token stream of ``text`` cut into ``(n, seq_len)`` training sequences."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one sequence of {seq_len}; raise --corpus-mb")
    return ids[: n * seq_len].view(n, seq_len)


def build_model(args: argparse.Namespace, vocab_size: int, pad_token_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        pad_token_id=pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def replica_batch(sequences: torch.Tensor, step: int, replica: int, replicas: int, batch: int) -> torch.Tensor:
    """The sequences replica ``replica`` trains on at ``step`` (every rank can compute every replica's)."""
    first = (step * replicas + replica) * batch
    return sequences[torch.arange(first, first + batch) % len(sequences)]


def reference_step(model, optimizer, sequences: torch.Tensor, step: int, replicas: int, batch: int) -> float:
    """One step of the unsharded reference on the step's global batch: the mean over the replicas of their
    token-mean losses (what the CP run's gradients are of); returns that loss (printed beside the CP run's).

    The batches are copied from ``sequences`` (on the host) to the device of ``model``'s parameters."""
    device = next(model.parameters()).device
    loss = sum(
        model(input_ids=ids, labels=ids).loss
        for ids in (replica_batch(sequences, step, r, replicas, batch).to(device) for r in range(replicas))
    )
    loss = loss / replicas
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()  # host sync: printed


def bind_local_device() -> torch.device:
    """The device this process trains on, bound before the process group is made.

    On a machine with CUDA, under a launcher that sets ``LOCAL_RANK`` (torchrun, ``accelerate launch``, the
    deepspeed launcher): ``torch.cuda.set_device(LOCAL_RANK)`` and that GPU, so NCCL's communicators and
    every ``torch.cuda.current_device()`` are this rank's GPU (without it every rank talks from GPU 0).
    Otherwise the CPU, where the process group is gloo."""
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; start at most "
                f"that many processes per node (--nproc-per-node / num_processes)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def add_example_arguments(p: argparse.ArgumentParser, *, steps: int) -> argparse.ArgumentParser:
    """The options of the data, the model, the side-by-side reference and checkpoints."""
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (a multiple of 2 * CP size)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--corpus-mb", type=float, default=4.0, help="megabytes of text to train on")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights")
    p.add_argument("--reference", action="store_true", help="also train an unsharded SDPA copy on rank 0")
    p.add_argument("--checkpoint-dir", default=None, help="save here and resume from the latest checkpoint")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    return p


def example_data(args: argparse.Namespace):
    """``(tokenizer, sequences)``: the BPE tokenizer and the ``(n, seq_len)`` training sequences."""
    text = local_corpus(int(args.corpus_mb * 1e6))
    tokenizer = train_tokenizer(text, args.vocab)
    return tokenizer, token_sequences(text, tokenizer, args.seq_len)


def print_result(example: str, **fields) -> None:
    """Print the run's result as one JSON object, ``{"example": example, **fields}``, on one line (rank 0
    calls it last, so the run's output ends with it; :func:`read_result` reads it back)."""
    print(json.dumps({"example": example, **fields}), flush=True)


def read_result(output: str) -> dict:
    """The last result line (:func:`print_result`) in an example's ``output``, as a dict; ``ValueError`` if
    there is none. Lines a launcher prints after it, and a prefix a launcher puts before it, are skipped."""
    for line in reversed(output.splitlines()):
        start = line.find('{"example"')
        if start >= 0:
            return json.loads(line[start:])
    raise ValueError(f'no result line (a JSON object starting with {{"example") in: ...{output[-2000:]}')
