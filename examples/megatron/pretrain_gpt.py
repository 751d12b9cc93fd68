"""Pretrain a GPT with megatron-core, Mesh-Attention context parallelism, tensor and data parallelism.

On CPU (8 gloo processes, TP 2 x CP 4 on a 2x2 mesh, 8192-token sequences)::

    .venv/bin/torchrun --nproc-per-node 8 examples/megatron/pretrain_gpt.py \\
        --config configs/megatron_cpu_demo.yaml

Megatron-core only (``GPTModel``, ``parallel_state``, ``GPTDataset``, ``get_batch_on_this_cp_rank``, called through
:mod:`mesh_cp.integrations.megatron.compat` in every supported megatron-core, 0.16 to 0.20);
the layer spec is :func:`mesh_cp.integrations.megatron.get_gpt_layer_mesh_spec`. ``--head-parallel u`` (config
key ``head_parallel``, default 1; the former ``--cp-heads`` / ``cp_heads`` are refused, naming it) runs the
head-parallel x mesh hybrid on Megatron's own zig-zag layout (Note [Hybrid on Megatron's layout] in
:mod:`mesh_cp.integrations.megatron.heads`): ``--tile`` then tiles ``CP / u`` ranks. The text is the Python
standard library's source read from this machine, tokenized by megatron-core's byte-level tokenizer into
a Megatron indexed dataset (nothing is downloaded). Each step every DP replica takes its own
``--micro-batch`` samples; each CP rank holds their zig-zag chunks ``r`` and ``2CP-1-r``; the loss is
every rank's token losses over the token count of the whole global batch, and gradients are summed
over ``get_data_parallel_group(with_context_parallel=True)``. On CUDA Megatron's
``DistributedDataParallel`` and ``get_megatron_optimizer`` do that (bf16); on CPU (fp32) a plain torch
AdamW steps after :func:`~examples.megatron.cpu_workarounds.reduce_gradients_cpu`, because both assert CUDA
(the CPU workarounds live beside this script, in ``examples/megatron/cpu_workarounds.py``; the step pieces used on
every device are :mod:`mesh_cp.integrations.megatron.training`). ``--checkpoint-dir``
saves a Megatron distributed checkpoint (``megatron.core.dist_checkpointing``, torch_dist format) every
``--save-every`` steps and resumes from the latest one, in this or any other TP x CP(tile) x DP layout: the
model, the optimizer state, the samples consumed and the RNG state (see
:mod:`mesh_cp.integrations.megatron.checkpoint`).

Rank 0 ends its output with one JSON line::

    {"example": "megatron", "world": 8, "device": "cpu", "layouts": ["TP(2)-CP(2x2)-DP(1) rank 0: ...", ...],
     "steps": 30, "first_step": 1, "losses": [...], "grad_norms": [...], "resumed_from": null | step,
     "checkpoint": null | path, "tokens_per_step": 8192, "tokens_per_s": median}

``layouts`` holds every rank's line of the layout, in rank order; ``losses[i]`` and ``grad_norms[i]``
(before clipping) are those of step ``first_step + i`` (steps count from 1; a resumed run starts after
``resumed_from``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root: examples/ is not installed

import torch
import torch.distributed as dist

from examples.common import bind_local_device, print_result
from mesh_cp.testing import gloo_exit_workaround

# megatron-core warns at import, once per process, that TransformerEngine/Apex are absent and about CUDA
# settings; on CPU those are expected.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
# Loading a distributed checkpoint, megatron-core 0.16.1 calls torch.distributed.checkpoint APIs that torch marks
# as deprecated (load_state_dict, ShardedTensor); the files and their loading are unaffected.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron\.core|torch\.distributed)\.")

DEFAULTS = dict(
    tp=1,
    cp=None,
    tile="square",
    head_parallel=1,
    ranks_per_node=None,
    topology=None,
    seq_len=8192,
    micro_batch=1,
    steps=30,
    lr=3e-3,
    min_lr=3e-4,
    warmup=3,
    clip_grad=1.0,
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn_hidden=256,
    position_embedding="rope",
    normalization="RMSNorm",
    vocab=512,
    corpus_mb=4.0,
    data_dir=None,
    seed=1234,
    checkpoint_dir=None,
    save_every=10,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", default=None, help="YAML file of these options (dashes as underscores); flags override")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--cp", type=int, help="context-parallel size (default: world / TP, so DP = 1)")
    p.add_argument(
        "--tile", help="mesh tile AxB with A*B = CP; 'square' (node-local when ranks per node known) or 'auto'"
    )
    p.add_argument(
        "--head-parallel",
        type=int,
        help="head-parallel ranks per CP group (the head-parallel x mesh hybrid: groups of this many consecutive CP "
        "ranks exchange heads, --tile tiles CP / head-parallel; must divide CP and the heads per TP rank)",
    )
    p.add_argument("--cp-heads", dest="renamed_cp_heads", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--ranks-per-node", type=int, help="GPUs per node (default: torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--topology", help="cluster preset for --tile auto (h100, a100; default h100)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (a multiple of 2*CP)")
    p.add_argument("--micro-batch", type=int, help="sequences per DP replica and step")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate")
    p.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup", type=int, help="linear warm-up steps")
    p.add_argument("--clip-grad", type=float, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--layers", type=int, help="transformer layers")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (query groups, GQA)")
    p.add_argument("--ffn-hidden", type=int, help="MLP width")
    p.add_argument("--position-embedding", choices=["rope", "learned_absolute"], help="position embedding")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], help="layer norm kind")
    p.add_argument("--vocab", type=int, help="vocabulary size of the byte-level tokenizer (>= 257)")
    p.add_argument("--corpus-mb", type=float, help="megabytes of standard-library source to train on")
    p.add_argument("--data-dir", help="where the indexed dataset is written (default: <checkpoint-dir or /tmp>/data)")
    p.add_argument("--seed", type=int, help="seed of the initial weights and of the sample order")
    p.add_argument("--checkpoint-dir", help="save here and resume from the latest checkpoint")
    p.add_argument("--save-every", type=int, help="steps between checkpoints")
    p.set_defaults(**DEFAULTS)
    first, _ = p.parse_known_args(argv)
    if first.config:
        import yaml

        with open(first.config) as f:
            values = yaml.safe_load(f) or {}
        unknown = sorted(set(values) - set(DEFAULTS))
        if "cp_heads" in values:
            raise ValueError(f"{first.config}: key cp_heads was renamed head_parallel (the head-parallel degree u)")
        if unknown:
            raise ValueError(f"unknown keys {unknown} in {first.config}; the keys are {sorted(DEFAULTS)}")
        p.set_defaults(**values)
    args = p.parse_args(argv)
    if hasattr(args, "renamed_cp_heads"):
        p.error("--cp-heads was renamed --head-parallel (the head-parallel degree u)")
    return args


def build_dataset(args, tokenizer, samples: int, rank: int):
    """Megatron's ``GPTDataset`` over the standard library's ``.py`` files (one document each), written
    once by rank 0 as an indexed dataset; ``samples`` windows of ``seq_len + 1`` tokens."""
    import numpy
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = Path(args.data_dir or Path(args.checkpoint_dir or "/tmp/mesh_cp_megatron") / "data")
    prefix = root / f"stdlib_{round(args.corpus_mb * 1000)}kb_v{args.vocab}"
    if rank == 0 and not prefix.with_suffix(".idx").exists():
        root.mkdir(parents=True, exist_ok=True)
        builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=numpy.uint16)
        size = 0
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            ids = tokenizer.tokenize(path.read_text(encoding="utf-8", errors="replace")) + [tokenizer.eod]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            size += len(ids)
            if size >= args.corpus_mb * 1e6:
                break
        builder.finalize(str(prefix.with_suffix(".idx")))
    dist.barrier()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_len,
        blend=([str(prefix)], None),
        split="100,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(root / "cache"),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, config).build()
    return train


def replica_batch(dataset, consumed: int, dp_rank: int, micro_batch: int) -> dict[str, torch.Tensor]:
    """The full-length samples DP replica ``dp_rank`` trains on in the step after ``consumed`` samples (the global
    batch is the next ``DP * micro_batch`` samples, replica ``i`` taking the ``i``-th ``micro_batch`` of them)."""
    first = consumed + dp_rank * micro_batch
    samples = [dataset[i % len(dataset)] for i in range(first, first + micro_batch)]
    return {
        k: torch.stack([torch.as_tensor(s[k]) for s in samples])
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    }


def learning_rate(args, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def main(argv: list[str] | None = None) -> None:
    from megatron.core import parallel_state as ps

    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise RuntimeError("start it with torchrun (see the module docstring)")
    device = bind_local_device()  # on GPUs: torch.cuda.set_device(LOCAL_RANK) before the NCCL group
    gloo_exit_workaround()  # before init_process_group
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        result = run(args, device)
    finally:
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    if result is not None:
        print_result("megatron", **result)


def run(args: argparse.Namespace, device: torch.device) -> dict | None:
    """Build the layout, data, model and optimizer, then train on ``device`` (see the module docstring).

    ``device`` is this rank's GPU (``cuda:LOCAL_RANK``, the current device) or the CPU. The model is moved
    there; the samples are read and cut into this CP rank's zig-zag chunks on the host, and only those
    chunks are copied there each step. Returns, on rank 0, the fields of the result line (the module
    docstring), else ``None``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tqdm import tqdm

    from mesh_cp.integrations.megatron import MeshLayout, checkpoint, compat, training

    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.cp or world // args.tp
    if world % (args.tp * cp):
        raise ValueError(f"TP {args.tp} x CP {cp} = {args.tp * cp} must divide the {world} processes")
    compat.check_sequence_length(args.seq_len, cp=cp, name="--seq-len")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, context_parallel_size=cp)
    ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    tile = tuple(int(x) for x in args.tile.split("x")) if "x" in str(args.tile) else args.tile
    auto = {}
    if tile == "auto":  # the cost model needs the cluster and the per-rank attention shape
        from mesh_cp.core import AttentionShape

        auto["topology"] = args.topology or "h100"
        auto["shape"] = AttentionShape(
            batch=args.micro_batch,
            seq_local=args.seq_len // cp,
            heads=args.heads // args.tp,
            kv_heads=max(1, args.kv_heads // args.tp),
            head_dim=args.hidden // args.heads,
            itemsize=2 if cuda else 4,
        )
    layout = MeshLayout.from_parallel_state(
        tile=tile, head_parallel=args.head_parallel, ranks_per_node=ranks_per_node, **auto
    )
    lines = [None] * world
    dist.all_gather_object(lines, str(layout))
    main_rank = rank == 0
    if main_rank:
        print(f"{world} processes ({'cuda/nccl' if cuda else 'cpu/gloo'}), {ranks_per_node} per node:")
        print("\n".join(lines), flush=True)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, vocab_size=args.vocab)
    dataset = build_dataset(args, tokenizer, args.steps * dp * args.micro_batch, rank)

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        ffn_hidden_size=args.ffn_hidden,
        normalization=args.normalization,
        tensor_model_parallel_size=args.tp,
        context_parallel_size=cp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=not cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        bf16=cuda,
        calculate_per_token_loss=True,  # DDP sums gradients: each rank's loss is its share of the global mean
    )
    torch.manual_seed(args.seed)  # CPU: the full weights, split over TP by use_cpu_initialization
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layout.layer_spec(normalization=args.normalization),
        vocab_size=args.vocab,
        max_sequence_length=args.seq_len,
        position_embedding_type=args.position_embedding,
    ).to(device)
    step_fn = CudaStep(model, config, args) if cuda else CpuStep(model, args)

    start, consumed, resumed = 0, 0, False
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt_dir is not None and (ckpt_dir / "latest").exists():
        start, resumed = int((ckpt_dir / "latest").read_text()), True
        common = checkpoint.load(ckpt_dir / f"step_{start}", step_fn.model, step_fn.optimizer)
        consumed = common["consumed_samples"]  # each rank's RNG states come back with the checkpoint
        if main_rank:
            print(
                f"resumed from {ckpt_dir / f'step_{start}'} at step {start} ({consumed} samples consumed), saved in "
                f"layout {common['layout']}",
                flush=True,
            )

    tokens_per_step = args.seq_len * args.micro_batch * dp
    losses, norms, rates = [], [], []
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    bar = tqdm(range(start, args.steps), disable=not main_rank, desc="pretraining", unit="step", dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        batch = replica_batch(dataset, consumed, dp_rank, args.micro_batch)
        consumed += dp * args.micro_batch
        batch = compat.batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        global_tokens = training.global_token_count(batch["loss_mask"])
        per_token = step_fn.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = training.loss_share(per_token, batch["loss_mask"], global_tokens)
        loss.backward()
        norm = step_fn.step(learning_rate(args, step))
        total = loss.detach().double()
        dist.all_reduce(total, group=dp_cp)
        loss_value, norm = total.item(), float(norm)  # host sync: printed
        seconds = time.perf_counter() - t0
        losses.append(loss_value)
        norms.append(norm)
        rates.append(tokens_per_step / seconds)
        bar.set_postfix(loss=f"{loss_value:.4f}", gnorm=f"{norm:.3f}", tok_s=f"{tokens_per_step / seconds:,.0f}")
        if main_rank:
            bar.write(
                f"step {step + 1:4d}  loss {loss_value:.6f}  grad norm {norm:.6f}  tokens/s {tokens_per_step / seconds:,.0f}"
            )
        if ckpt_dir is not None and (step + 1) % args.save_every == 0:
            save(ckpt_dir, step + 1, step_fn, {"consumed_samples": consumed, "layout": lines[0]})
    if not main_rank:
        return None
    if losses:
        print(
            f"done: steps {start + 1}-{args.steps}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"median {statistics.median(rates):,.0f} tokens/s ({tokens_per_step} tokens per step)",
            flush=True,
        )
    return {
        "world": world,
        "device": device.type,
        "layouts": lines,
        "steps": args.steps,
        "first_step": start + 1,
        "losses": losses,
        "grad_norms": norms,
        "resumed_from": start if resumed else None,
        "checkpoint": str(ckpt_dir / f"step_{start}") if resumed else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": statistics.median(rates) if rates else None,
    }


def save(directory: Path, step: int, step_fn, common: dict) -> None:
    """A Megatron distributed checkpoint of the model and optimizer in ``directory/step_<step>`` (any layout can
    load it), with ``common`` and every rank's RNG states; rank 0 then marks the step as the latest."""
    from mesh_cp.integrations.megatron import checkpoint

    common = {"step": step, **common}
    checkpoint.save(directory / f"step_{step}", step_fn.model, step_fn.optimizer, common=common)
    if dist.get_rank() == 0:
        (directory / "latest").write_text(str(step))
    dist.barrier()


class CpuStep:
    """CPU: gradients summed over DP x CP by hand, global norm, clipping, torch AdamW (Megatron's DDP and
    optimizer assert CUDA)."""

    def __init__(self, model, args):
        from examples.megatron import cpu_workarounds

        cpu_workarounds.use_cpu_rotary_embedding(model)
        self.model, self.args, self.cpu = model, args, cpu_workarounds
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def step(self, lr: float) -> torch.Tensor:
        """Reduce, clip and step; the global gradient norm before clipping (a tensor: no host sync)."""
        self.cpu.reduce_gradients_cpu(self.model)
        norm = self.cpu.grad_norm_cpu(self.model)
        self.cpu.clip_gradients_cpu(self.model, self.args.clip_grad, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm


class CudaStep:
    """CUDA: Megatron's ``DistributedDataParallel`` (summing, as ``calculate_per_token_loss`` is set),
    ``finalize_model_grads`` and ``get_megatron_optimizer`` (Adam, bf16 with fp32 main weights)."""

    def __init__(self, model, config, args):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.finalize = finalize_model_grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            bf16=True,
            clip_grad=args.clip_grad,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    def step(self, lr: float) -> float:
        """Reduce (Megatron's DDP), clip and step; the global gradient norm Megatron's optimizer returns."""
        self.finalize([self.model])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(norm or 0.0)


if __name__ == "__main__":
    main()
