"""mesh_cp with ``accelerate launch``: data and tokenizer for the long-context fine-tuning example.

The example (``integrations/accelerate/finetune.py``, module ``mesh_cp.integrations.accelerate.finetune``)
is started by ``accelerate launch``; accelerate starts the processes and the gloo/NCCL group and does
mixed precision, and mesh_cp adds the DP x CP layout (:class:`mesh_cp.integrations.hf.DataContextParallel`),
the ``mesh_cp`` attention and the sharded batches. accelerate's own ``ParallelismConfig`` only knows
its torch context parallelism (``cp_backend="torch"``, CUDA only), so it is not used.

Nothing is downloaded: the text is the Python standard library's source, read from this machine, and
the tokenizer is a byte-level BPE trained on it with the ``tokenizers`` library.
"""

from __future__ import annotations

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
