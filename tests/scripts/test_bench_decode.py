"""``scripts/bench_decode.py`` at tiny settings: it exits 0, and its JSON has the tree, ring and one-process rows of
every context, the tree's bytes per token independent of the context and the ring's growing with it, one collective
per layer and token for the tree, the ring decoding the tree's greedy tokens, and each of the P = 2 tree ranks
holding about half the one-process K/V cache (its slots rounded up to a multiple of 256, Note [Static shard cache]).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_decode.py"
CONTEXTS = (480, 992)
"""Each rank's shard (half the prompt and the new tokens) fills most of its slots, 256 and 512 (a page multiple)."""
NEW_TOKENS = 3


def test_bench_decode_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["--world", "2", "--contexts", ",".join(map(str, CONTEXTS)), "--new-tokens", str(NEW_TOKENS)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    rows = {(r["context"], r["method"]): r for r in doc["rows"]}
    assert set(rows) == {(c, m) for c in CONTEXTS for m in ("tree", "ring", "one process")}

    tree = [rows[(c, "tree")]["bytes_per_token_per_rank"] for c in CONTEXTS]
    ring = [rows[(c, "ring")]["bytes_per_token_per_rank"] for c in CONTEXTS]
    assert tree[0] == tree[1] > 0
    assert ring[1] > ring[0] > tree[0]
    for c in CONTEXTS:
        assert rows[(c, "tree")]["tree_bytes_check"] == "OK"
        assert rows[(c, "tree")]["collectives_per_layer_token"] == 1  # one all-gather per layer and token
        assert rows[(c, "tree")]["bytes_per_token_per_rank"] == rows[(c, "tree")]["predicted_bytes_per_token_per_rank"]
        assert rows[(c, "ring")]["tokens"] == rows[(c, "tree")]["tokens"]
        assert rows[(c, "ring")]["same_tokens_as_tree"] and rows[(c, "ring")]["max_logit_diff_vs_tree"] <= 1e-4
        assert len(rows[(c, "tree")]["tokens"][0]) == NEW_TOKENS
        half = rows[(c, "tree")]["kv_bytes_per_rank"] / rows[(c, "one process")]["kv_bytes_per_rank"]
        assert 0.45 < half < 0.55, half
        for method in ("tree", "ring", "one process"):
            assert rows[(c, method)]["tokens_per_s"] > 0


def ring_against_tree(rank: int, world: int) -> float:
    """The script's ring decoder against ``mesh_cp.decode_attn_func`` on ragged shards (one empty, one row that
    sees nothing): the largest difference of their outputs."""
    import importlib.util

    import torch
    import torch.distributed as dist

    import mesh_cp

    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
    gen = torch.Generator().manual_seed(rank)
    length = (5, 0, 3)[rank]
    q = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(99))
    k, v = (torch.randn(2, length, 2, 8, generator=gen) for _ in range(2))
    k_positions = torch.arange(length).expand(2, -1) * world + rank
    k_positions = torch.where(torch.tensor([[True], [False]]), k_positions, -1)  # row 1 sees nothing
    q_positions = torch.tensor([[9, 10], [9, 10]])
    with torch.no_grad():
        want = mesh_cp.decode_attn_func(q, k, v, mesh=mesh, q_positions=q_positions, k_positions=k_positions)
        got = bench.ring_decode_attn_func(q, k, v, mesh=mesh, q_positions=q_positions, k_positions=k_positions)
    assert not got.isnan().any()
    return (got - want).abs().max().item()


def test_ring_decoder_equals_tree_on_ragged_shards() -> None:
    from mesh_cp.testing import spawn_gloo

    assert max(spawn_gloo(ring_against_tree, 3)) < 1e-6
