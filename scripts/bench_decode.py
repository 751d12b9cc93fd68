"""Decoding throughput, traffic and memory of Tree Attention against Ring Attention and one process.

The demo model (``examples/common.build_model``: a Llama with random seeded weights, fp32) generates
``--new-tokens`` greedy tokens after a random prompt (seeded token ids, ``--batch`` rows of one length) of each
``--contexts`` length, three ways:

* ``tree``: on ``--world`` gloo ranks (:func:`mesh_cp.testing.spawn_gloo`, mesh tile ``1 x P``),
  ``mesh_cp.integrations.hf.generation.prefill`` then ``model.generate(past_key_values=cache)``: every
  layer's decode attention is :func:`mesh_cp.decode_attn_func` (local attention over the preallocated shard,
  then one all-gather of the packed fp32 ``[out, lse]`` and a local merge);
* ``ring``: the same, with :func:`ring_decode_attn_func` (below) swapped in for the decode attention: the K/V
  shards travel around the ring of all ``P`` ranks (``P - 1`` steps, each overlapping the next transfer
  with the attention to the shard in hand), every rank merging every shard's ``(out, lse)`` itself;
* ``one process``: the same model with ``attn_implementation="sdpa"`` and transformers' DynamicCache: a
  forward over the prompt but its last token (``logits_to_keep=1``), then ``model.generate`` from that cache.

Decode time is the ``generate`` call alone (after prefill; its first step feeds the prompt's last token, so
it runs ``N`` forwards of one token per row, the same in the three ways), the slowest rank's; tokens/s is ``N /
seconds``. The bytes a rank sends are counted by :class:`mesh_cp.CommCounter` in a second, untimed ``generate``
from the same prefilled cache (a dispatch mode costs time on every op), the most of any rank, per generated
token, and the collectives of that decode per layer and token. ``KV bytes/rank`` is the K/V cache a rank holds
after decoding (the most of any rank; its share of the prefill's padding and the slots preallocated for the new
tokens included). ``RSS MiB`` is the growth of the process's peak resident memory over prefill and
decode (``ru_maxrss`` after, less the resident set before, the peak first reset through
``/proc/self/clear_refs`` where Linux allows it; the most of any rank): noisy and an upper bound, since the
allocator keeps and reuses freed memory. Every process gets ``--threads`` torch threads, and on a machine with
fewer cores than ranks the ranks share them, so the tree and ring tokens/s are those of an oversubscribed CPU.

Checks (exit status 1 if one fails): ring and tree pick the same greedy tokens with logits within 1e-4; the
tree sends exactly ``layers x DecodeReduction.for_tile(1, P).bytes_sent(shape)`` bytes per token and rank, in
one all-gather per layer and token.
The cost model's bytes per token and rank (:func:`mesh_cp.sim.simulate_decode`, tile ``1 x P``) are printed
beside the measured ones; ring's measured bytes also carry the positions of the entries (8 bytes each) and
the exchange of shard lengths.

Example::

    .venv/bin/python scripts/bench_decode.py --world 4 --contexts 4096,16384 --new-tokens 16 --json decode.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # for examples.common

from examples.common import build_model  # noqa: E402
from mesh_cp.core.decode import DecodeReduction, DecodeShape  # noqa: E402
from mesh_cp.integrations.hf.compat import cache_keyword, output_cache  # noqa: E402
from mesh_cp.runtime.decode import local_attention  # noqa: E402
from mesh_cp.sim import Topology, simulate_decode  # noqa: E402
from mesh_cp.testing import spawn_gloo  # noqa: E402

TOL = 1e-4
WARMUP = 64
"""Prompt length of the untimed first run of each method (first calls pay one-time costs)."""
TIMEOUT = datetime.timedelta(minutes=30)  # P ranks share few cores: a collective may wait a whole prefill


# ----------------------------------------------------------------------------------------------
# Ring decoding


def _attend(q, k, v, q_positions, k_positions, scale: float):
    """This shard's ``(out, lse)`` in fp32, computed as the tree computes its local part: entry ``j`` seen by
    query ``i`` iff ``0 <= p_j <= p_i``."""
    out, lse = local_attention(None, q, k, v, q_positions, k_positions, scale)
    return out.float(), lse.float()


def merge(acc: tuple, part: tuple) -> tuple:
    """LSE merge of two partial results ``(out (B, k, H, D), lse (B, H, k))``; ``-inf`` rows weigh 0."""
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1, w2 = (torch.exp(lse_g - finite).transpose(1, 2)[..., None] for lse_g in (l1, l2))
    return w1 * o1 + w2 * o2, lse


def ring_decode_attn_func(q, k, v, *, mesh, q_positions=None, k_positions=None, k_lengths=None, softmax_scale=None):
    """:func:`mesh_cp.decode_attn_func`'s result by Ring Attention: the shards ``(B, L, Hkv, D)`` (any lengths)
    go around all ranks of ``mesh``'s CP group, each rank merging every shard's result; no reduction. The lengths
    form is taken as its positions (every entry of a row's prefix seen by its one query)."""
    if k_lengths is not None:
        k_positions = torch.where(torch.arange(k.shape[1], device=k.device) < k_lengths[:, None], 0, -1)
        q_positions = torch.zeros(q.shape[0], 1, dtype=torch.long, device=q.device)
    group = getattr(mesh, "group", mesh)
    world, rank = group.size(), group.rank()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    lengths = torch.zeros(world, dtype=torch.long)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.10: old name
    gather(lengths, torch.tensor([k.shape[1]]), group=group)
    shard, positions, dim = torch.cat([k, v], dim=-1), k_positions.contiguous(), k.shape[-1]
    acc = None
    for step in range(world):
        requests, incoming = [], None
        if step < world - 1:  # post this step's transfer, then attend to the shard in hand
            size = int(lengths[(rank - step - 1) % world])
            incoming = (shard.new_empty(shard.shape[0], size, *shard.shape[2:]), positions.new_empty(len(q), size))
            requests = _pass_on((shard, positions), incoming, group, rank, world)
        part = _attend(q, shard[..., :dim], shard[..., dim:], q_positions, positions, scale)
        acc = part if acc is None else merge(acc, part)
        for request in requests:
            request.wait()
        if incoming is not None:
            shard, positions = incoming
    return acc[0].to(q.dtype)


def _pass_on(outgoing: tuple, incoming: tuple, group, rank: int, world: int) -> list:
    """Send ``outgoing`` to the next rank and receive ``incoming`` from the previous (empty tensors skipped:
    both sides know every length)."""
    requests = []
    for tag, (send, recv) in enumerate(zip(outgoing, incoming, strict=True)):
        if send.shape[1]:
            requests.append(dist.isend(send, dist.get_global_rank(group, (rank + 1) % world), group, tag))
        if recv.shape[1]:
            requests.append(dist.irecv(recv, dist.get_global_rank(group, (rank - 1) % world), group, tag))
    return requests


# ----------------------------------------------------------------------------------------------
# Measurement


def make_model(cfg: SimpleNamespace):
    args = SimpleNamespace(**vars(cfg), seq_len=max(cfg.contexts) + cfg.new_tokens)
    return build_model(args, cfg.vocab, pad_token_id=0).eval()


def prompt(cfg: SimpleNamespace, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed + context)
    ids = torch.randint(1, cfg.vocab, (cfg.batch, context), generator=gen)
    return ids, torch.ones_like(ids)


def _rss_mib() -> float:
    """Resident set now, after resetting the peak to it where Linux allows (``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_growth_mib(before: float) -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def _kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _generate(model, ids, mask, cache, new_tokens: int):
    return model.generate(
        input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache}, max_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip


def _max(value: float, dtype=torch.float64) -> float:
    t = torch.tensor([value], dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_sharded(model, mesh, ids, mask, new_tokens: int) -> dict:
    """Prefill, timed decode, then a counted decode from the same prefilled cache; maxima over the ranks."""
    from mesh_cp import CommCounter
    from mesh_cp.integrations.hf.generation import prefill

    before = _rss_mib()
    start = time.perf_counter()
    cache = prefill(model, ids, mask, mesh=mesh, max_new_tokens=new_tokens)
    prefill_s = time.perf_counter() - start
    # generate writes the new columns into the preallocated slots: keep the prefilled state to decode again (the
    # slots it filled are past the rows' lengths again, their column -1).
    prefilled = [(layer.columns.clone(), layer.lengths.clone(), layer.seen, layer.length) for layer in cache.layers]
    dist.barrier()
    start = time.perf_counter()
    out = _generate(model, ids, mask, cache, new_tokens)
    decode_s = time.perf_counter() - start
    kv_bytes = _kv_bytes(cache)
    for layer, (columns, lengths, seen, length) in zip(cache.layers, prefilled, strict=True):
        layer.columns.copy_(columns)
        layer.lengths.copy_(lengths)
        layer.seen, layer.length = seen, length
    dist.barrier()
    with CommCounter() as counter:
        counted = _generate(model, ids, mask, cache, new_tokens)
    if not torch.equal(counted.sequences, out.sequences):
        raise RuntimeError("the counted decode chose other tokens than the timed one")
    return {
        "prefill_s": _max(prefill_s),
        "decode_s": _max(decode_s),
        "bytes_sent": int(_max(counter.bytes_sent(), torch.int64)),
        "collectives": int(_max(len(counter.records), torch.int64)),
        "kv_bytes_per_rank": int(_max(kv_bytes, torch.int64)),
        "peak_rss_growth_mib": _max(_peak_growth_mib(before)),
        "sequences": out.sequences,
        "logits": torch.stack(out.logits),
    }


def worker(rank: int, world: int, cfg: SimpleNamespace) -> list[dict]:
    """Tree then ring at every context (after one untimed warm-up of each on a short prompt); rank 0 returns
    the rows."""
    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf import generation

    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    model = hf.attach(make_model(cfg), mesh)
    tree_fn, rows = generation.decode_attn_func, []
    for context in [WARMUP, *cfg.contexts]:
        ids, mask = prompt(cfg, context)
        for method, fn in (("tree", tree_fn), ("ring", ring_decode_attn_func)):
            generation.decode_attn_func = fn
            try:
                with torch.no_grad():
                    row = run_sharded(model, mesh, ids, mask, cfg.new_tokens)
            finally:
                generation.decode_attn_func = tree_fn
            if context != WARMUP:
                rows.append({"context": context, "method": method, **row})
        if rank == 0 and context != WARMUP:
            print(f"context {context}: tree and ring done", file=sys.stderr, flush=True)
    return rows if rank == 0 else []


def run_one_process(cfg: SimpleNamespace) -> list[dict]:
    """SDPA and a DynamicCache at every context (after a warm-up): a forward over the prompt but its last
    token, then a timed generate from that cache."""
    model = make_model(cfg)
    rows = [_one_process(model, cfg, context) for context in [WARMUP, *cfg.contexts]]
    return rows[1:]


def _one_process(model, cfg: SimpleNamespace, context: int) -> dict:
    from transformers import DynamicCache

    ids, mask = prompt(cfg, context)
    before = _rss_mib()
    with torch.no_grad():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], **{cache_keyword(model): cache}, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        out = _generate(model, ids, mask, cache, cfg.new_tokens)
        decode_s = time.perf_counter() - start
    return {
        "context": context, "method": "one process", "prefill_s": prefill_s, "decode_s": decode_s, "bytes_sent": 0,
        "collectives": 0,
        "kv_bytes_per_rank": _kv_bytes(output_cache(out)), "peak_rss_growth_mib": _peak_growth_mib(before),
        "sequences": out.sequences, "logits": torch.stack(out.logits),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Results


def finish_rows(rows: list[dict], cfg: SimpleNamespace, topology: Topology) -> list[str]:
    """Fill in the derived fields of every row (in place); returns the failed checks."""
    tree = {r["context"]: (r["logits"], r["sequences"]) for r in rows if r["method"] == "tree"}
    ring_rate = {r["context"]: cfg.new_tokens / r["decode_s"] for r in rows if r["method"] == "ring"}
    failures = []
    for row in rows:
        context, method = row["context"], row["method"]
        shape = DecodeShape(cfg.batch, 1, cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads, context, itemsize=4)
        cost = simulate_decode(shape, cfg.world, topology, tile=(1, cfg.world)).get(method)
        row["tokens_per_s"] = cfg.new_tokens / row["decode_s"]
        row["speedup_vs_ring"] = row["tokens_per_s"] / ring_rate[context]
        row["bytes_per_token_per_rank"] = row["bytes_sent"] / cfg.new_tokens
        row["collectives_per_layer_token"] = row.pop("collectives") / (cfg.layers * cfg.new_tokens)
        row["predicted_bytes_per_token_per_rank"] = cfg.layers * cost.bytes_total if cost else None
        row["predicted_us_per_token"] = cfg.layers * cost.time_s * 1e6 if cost else None
        row["max_logit_diff_vs_tree"] = (row.pop("logits") - tree[context][0]).abs().max().item()
        sequences = row.pop("sequences")
        row["same_tokens_as_tree"] = torch.equal(sequences, tree[context][1])
        row["tokens"] = sequences[:, -cfg.new_tokens :].tolist()
        if method == "ring" and (not row["same_tokens_as_tree"] or row["max_logit_diff_vs_tree"] > TOL):
            failures.append(f"context {context}: ring and tree differ (logits {row['max_logit_diff_vs_tree']:.2e})")
        if method == "tree":
            want = cfg.layers * DecodeReduction.for_tile(1, cfg.world).bytes_sent(shape)
            row["tree_bytes_check"] = "OK" if row["bytes_per_token_per_rank"] == want else "MISMATCH"
            if row["tree_bytes_check"] != "OK":
                failures.append(f"context {context}: tree sent {row['bytes_per_token_per_rank']} B/token, want {want}")
            if row["collectives_per_layer_token"] != 1:
                failures.append(
                    f"context {context}: tree ran {row['collectives_per_layer_token']} collectives per layer"
                )
    return failures


def format_table(rows: list[dict]) -> str:
    head = ["context", "method", "tokens/s", "B/token/rank", "model B/token", "coll/layer", "KV B/rank", "RSS MiB"]
    head += ["vs ring"]
    head += ["dlogit vs tree", "same tokens"]
    lines = [head]
    for r in rows:
        lines.append([
            str(r["context"]), r["method"], f"{r['tokens_per_s']:.1f}", f"{r['bytes_per_token_per_rank']:,.0f}",
            "-" if r["predicted_bytes_per_token_per_rank"] is None else f"{r['predicted_bytes_per_token_per_rank']:,}",
            f"{r['collectives_per_layer_token']:g}", f"{r['kv_bytes_per_rank']:,}", f"{r['peak_rss_growth_mib']:.0f}", f"{r['speedup_vs_ring']:.2f}x",
            f"{r['max_logit_diff_vs_tree']:.1e}", "yes" if r["same_tokens_as_tree"] else "NO",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536", help="prompt lengths, comma-separated")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch (all of one length)")
    p.add_argument("--world", type=int, default=4, help="gloo ranks the cache is sharded over (P)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (ranks and one process)")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--topology", default="h100", help="cost model topology: a preset name or a JSON file")
    p.add_argument("--json", default=None, help="write the config, rows and checks here")
    args = p.parse_args(argv)
    args.contexts = sorted(int(c) for c in args.contexts.split(","))
    if args.world < 2 or args.new_tokens < 1 or min(args.contexts) < 2:
        p.error("need --world >= 2, --new-tokens >= 1 and contexts >= 2")
    return args


def load_topology(spec: str, head_dim: int) -> Topology:
    if Path(spec).is_file():
        return Topology.from_dict(json.loads(Path(spec).read_text()))
    return Topology.preset(spec, head_dim=head_dim, ranks_per_node=8)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = SimpleNamespace(**{k: v for k, v in vars(args).items() if k not in ("json", "topology")})
    topology = load_topology(args.topology, args.hidden // args.heads)
    rows = spawn_gloo(worker, args.world, cfg, threads_per_rank=args.threads, timeout=TIMEOUT)[0]
    torch.set_num_threads(args.threads)
    rows += run_one_process(cfg)
    rows.sort(key=lambda r: (r["context"], ("tree", "ring", "one process").index(r["method"])))
    failures = finish_rows(rows, cfg, topology)
    print(format_table(rows))
    print(f"tree bytes/token/rank = layers x DecodeReduction.for_tile(1, {args.world}).bytes_sent(shape): ", end="")
    print("OK" if not any(r.get("tree_bytes_check") == "MISMATCH" for r in rows) else "MISMATCH")
    for failure in failures:
        print(f"FAIL: {failure}")
    if args.json:
        doc = {"config": vars(args), "topology": topology.to_dict(), "rows": rows, "failures": failures}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
