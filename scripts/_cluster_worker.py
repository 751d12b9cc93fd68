"""One rank of the emulated cluster; started by ``scripts/emulated_cluster.py``, never by hand.

``python _cluster_worker.py RUN_CONFIG.json`` inside the rank's network namespace, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` (the rank's own veth)
in the environment. Every rank, in lock step:

1. times the block kernel on a full ``seq_local x seq_local`` block, all ranks at once (so the
   contention of all ranks on the machine's cores is included); rank 0 writes the times to
   ``calibration_path`` and every rank waits until the launcher has shaped the links and written
   ``rates_path``;
2. probes the links: every rank sends to a same-node peer (then to an other-node peer) while it
   receives from another, and ranks 0/1 and 0/``ranks_per_node`` ping-pong a small message;
3. builds one :class:`mesh_cp.CPMesh` per tile, runs ``warmup`` rounds (a configuration whose
   ``mesh_attn_func`` raises ``ValueError``/``NotImplementedError`` is skipped), one round under
   :class:`mesh_cp.CommCounter` that also reads the rank's ``tc`` class counters (bytes put on the
   intra-node and inter-node link), then ``repeats`` timed rounds, round-robin over the
   configurations.

Rank 0 writes everything to ``results_path`` as JSON.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mesh_cp
from mesh_cp.core.numerics import attention_delta
from mesh_cp.kernels import get_kernel
from mesh_cp.sim import Topology
from mesh_cp.testing import gloo_exit_workaround

PING_PONG_ROUNDS = 20


@dataclass(frozen=True)
class Rank:
    """This process's place in the emulated cluster."""

    rank: int
    world: int
    ranks_per_node: int
    ifname: str

    def peer(self, kind: str, step: int) -> int:
        """The rank ``step`` places ahead of this one on a same-node (``"intra"``) or cross-node ring."""
        node, local = divmod(self.rank, self.ranks_per_node)
        if kind == "intra":
            return node * self.ranks_per_node + (local + step) % self.ranks_per_node
        return (self.rank + step * self.ranks_per_node) % self.world


def log(rank: Rank, message: str) -> None:
    """Progress line, from rank 0 only."""
    if rank.rank == 0:
        print(f"[rank 0] {message}", flush=True)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` so that a reader polling ``path`` never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn: Callable[[], None], calls: int = 1) -> float:
    """Seconds per call of ``fn`` run ``calls`` times by every rank at once, the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return max_over_ranks(time.perf_counter() - t0) / calls


# ----------------------------------------------------------------------------------------------
# 1. Block kernel calibration


def block_kernel_calls(cfg: dict[str, Any], rank: Rank) -> tuple[Callable[[], None], Callable[[], None]]:
    """Forward and backward of one full ``seq_local x seq_local`` block on seeded inputs (warmed up)."""
    kernel = get_kernel("cpu_flash")
    gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank.rank)
    b, n, h, hkv, d = cfg["batch"], cfg["seq_local"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, do = (torch.randn(b, n, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=gen) for _ in range(2))
    scale = d**-0.5
    out, lse = kernel.forward(q, k, v, causal=False, scale=scale)  # also the forward's warm-up
    delta = attention_delta(do, out)

    def forward() -> None:
        kernel.forward(q, k, v, causal=False, scale=scale)

    def backward() -> None:
        kernel.backward(do, q, k, v, lse, delta, causal=False, scale=scale)

    backward()  # warm-up
    return forward, backward


def calibrate_kernel(cfg: dict[str, Any], rank: Rank) -> dict[str, float]:
    """Forward and backward seconds of one full ``seq_local x seq_local`` block, all ranks at once."""
    forward, backward = block_kernel_calls(cfg, rank)
    calls = cfg["kernel_calls"]
    return {"full_block_fwd_s": timed(forward, calls), "full_block_bwd_s": timed(backward, calls)}


def calibrate_host_cost(cfg: dict[str, Any], rank: Rank, rates: dict[str, float], quiet_s: float) -> float:
    """Compute seconds a rank loses per byte it sends or receives while it computes.

    Every rank runs the forward block kernel ``kernel_calls`` times while streaming a payload to its
    intra-node neighbour (and receiving one), sized to last about 80% of the quiet kernel time at the
    shaped rate; the slowdown against ``quiet_s`` (per call, no traffic) over the bytes moved.
    """
    forward, _ = block_kernel_calls(cfg, rank)
    calls = cfg["kernel_calls"]
    numel = max(int(0.8 * rates["intra_bytes_per_s"] * quiet_s * calls) // 4, 1)
    payload, inbox = torch.zeros(numel), torch.empty(numel)
    exchange(rank, "intra", torch.zeros(1024), everyone=True)  # opens the connections
    dist.barrier()
    works = [dist.isend(payload, rank.peer("intra", 1)), dist.irecv(inbox, rank.peer("intra", -1))]
    t0 = time.perf_counter()
    for _ in range(calls):
        forward()
    busy = time.perf_counter() - t0
    for w in works:
        w.wait()
    lost = torch.tensor([max(busy - quiet_s * calls, 0.0) / (2 * 4 * numel)], dtype=torch.float64)
    dist.all_reduce(lost)
    return lost.item() / rank.world


class TimedKernel:
    """The CPU block kernel, adding up the wall-clock and CPU seconds spent in its calls: the block compute of a
    round as it runs under the benchmark's own load (every rank's processes and the network stack sharing the
    cores)."""

    name = "cpu_flash"

    def __init__(self) -> None:
        self.inner = get_kernel("cpu_flash")
        self.totals = [0.0] * 4  # forward wall, backward wall, forward CPU, backward CPU

    def _timed(self, phase: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            self.totals[phase] += time.perf_counter() - wall
            self.totals[2 + phase] += time.thread_time() - cpu

    def forward(self, *args: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._timed(0, self.inner.forward, *args, **kw)

    def backward(self, *args: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._timed(1, self.inner.backward, *args, **kw)

    def take(self) -> list[float]:
        """Forward and backward wall-clock seconds, then forward and backward CPU seconds, since the last call."""
        taken, self.totals = self.totals, [0.0] * 4
        return taken


def wait_for_rates(cfg: dict[str, Any], rank: Rank, calibration: dict[str, float]) -> dict[str, float]:
    """Hand the calibration to the launcher and wait until it has shaped the links."""
    if rank.rank == 0:
        write_json(cfg["calibration_path"], calibration)
    while not os.path.exists(cfg["rates_path"]):
        time.sleep(0.2)
    dist.barrier()
    with open(cfg["rates_path"]) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------
# 2. Link probes


def exchange(rank: Rank, kind: str, tensor: torch.Tensor, everyone: bool) -> None:
    """Send ``tensor`` to the next rank of the ``kind`` ring while receiving from the previous one.

    With ``everyone`` false only rank 0 sends (and its successor receives); the others wait.
    """
    works = []
    if everyone or rank.rank == 0:
        works.append(dist.isend(tensor, rank.peer(kind, 1)))
    if everyone or rank.peer(kind, -1) == 0:
        works.append(dist.irecv(torch.empty_like(tensor), rank.peer(kind, -1)))
    for w in works:
        w.wait()


def probe_throughput(rank: Rank, kind: str, rate_bytes_per_s: float, seconds: float, everyone: bool) -> float:
    """Bytes/s of one ``kind`` link, alone or while every rank sends on its own (best of 2)."""
    exchange(rank, kind, torch.zeros(1024), everyone=True)  # opens the connections
    numel = max(int(rate_bytes_per_s * seconds) // 4, 1 << 18)
    payload = torch.zeros(numel)
    best = min(timed(lambda: exchange(rank, kind, payload, everyone)) for _ in range(2))
    return 4 * numel / best


def probe_latency(rank: Rank, peer: int) -> float | None:
    """One-way seconds of a 4-byte message between rank 0 and ``peer`` (median ping-pong / 2)."""
    dist.barrier()
    result = None
    if rank.rank in (0, peer):
        other = peer if rank.rank == 0 else 0
        msg = torch.zeros(1)
        rtts = []
        for _ in range(PING_PONG_ROUNDS):
            t0 = time.perf_counter()
            if rank.rank == 0:
                dist.send(msg, other)
                dist.recv(msg, other)
            else:
                dist.recv(msg, other)
                dist.send(msg, other)
            rtts.append(time.perf_counter() - t0)
        result = statistics.median(rtts) / 2
    dist.barrier()
    return result


def probe_links(cfg: dict[str, Any], rank: Rank, rates: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Per kind of link: throughput of one link alone (the shaping) and with all ranks sending (CPU
    contention included), and the one-way latency of a small message."""
    seconds = cfg["probe_seconds"]
    links = {}
    for kind, peer in (("intra", 1), ("inter", rank.ranks_per_node)):
        rate = rates[f"{kind}_bytes_per_s"]
        links[kind] = {
            "latency_s": probe_latency(rank, peer),
            "single_link_bytes_per_s": probe_throughput(rank, kind, rate, seconds, everyone=False),
            "measured_bytes_per_s": probe_throughput(rank, kind, rate, seconds, everyone=True),
        }
        log(
            rank,
            f"{kind}-node link: configured {rate / 1e6:.2f} MB/s, measured {links[kind]['single_link_bytes_per_s'] / 1e6:.2f}"
            f" MB/s on one link alone, {links[kind]['measured_bytes_per_s'] / 1e6:.2f} MB/s with every rank sending",
        )
    return links


# ----------------------------------------------------------------------------------------------
# 3. Benchmark


_TC_CLASS = re.compile(r"^class htb (\S+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE | re.DOTALL)


def tc_bytes(cfg: dict[str, Any], rank: Rank) -> dict[str, int]:
    """Bytes this rank has put on its intra-node and inter-node link so far (``tc`` class counters)."""
    text = subprocess.run(
        ["tc", "-s", "class", "show", "dev", rank.ifname], check=True, capture_output=True, text=True
    ).stdout
    sent = {handle: int(nbytes) for handle, nbytes in _TC_CLASS.findall(text)}
    return {kind: sent[handle] for kind, handle in cfg["tc_classes"].items()}


def bench_inputs(cfg: dict[str, Any], rank: Rank) -> tuple[torch.Tensor, ...]:
    """Seeded ``q, k, v`` (leaves requiring grad) and the output gradient of this rank's shard."""
    gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + rank.rank)
    b, n, h, hkv, d = cfg["batch"], cfg["seq_local"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = torch.randn(b, n, h, d, generator=gen).requires_grad_()
    k, v = (torch.randn(b, n, hkv, d, generator=gen).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(b, n, h, d, generator=gen)


@dataclass
class Config:
    """One (layout, schedule) pair and what was measured on it."""

    tile: tuple[int, int, int]
    """``(u, a, b)``: ``u`` head-parallel ranks around an ``a x b`` mesh (``u = 1``: a plain mesh)."""
    schedule: str
    mesh: mesh_cp.CPMesh
    skipped: str | None = None
    times_s: list[float] | None = None
    counted: list[dict[str, Any]] | None = None
    kernel_s: list[list[list[float]]] | None = None
    """Per timed round, per rank: forward and backward wall-clock, then CPU, seconds inside the block kernel, then
    the CPU seconds of the process (all its threads) and of its main thread."""

    @property
    def name(self) -> str:
        u, a, b = self.tile
        return f"{'' if u == 1 else f'u{u}:'}{a}x{b}/{self.schedule}"

    def report(self) -> dict[str, Any]:
        return {
            "tile": list(self.tile),
            "schedule": self.schedule,
            "skipped": self.skipped,
            "times_s": self.times_s,
            "per_rank": self.counted,
            "kernel_s": self.kernel_s,
        }


def warm_up(configs: list[Config], step: Callable[[Config], None], rank: Rank, rounds: int) -> None:
    """Run every configuration ``rounds`` times; skip those that ``mesh_attn_func`` rejects.

    ``mesh_attn_func`` validates its arguments (the schedule name among them) before it communicates,
    so every rank raises alike; the flags are still agreed on, so that no rank runs a configuration
    another one skips.
    """
    errors: list[str | None] = []
    for c in configs:
        try:
            step(c)
            errors.append(None)
        except (ValueError, NotImplementedError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    failed = torch.tensor([e is not None for e in errors], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    for c, error, flag in zip(configs, errors, failed.tolist(), strict=True):
        if flag:
            c.skipped = error or "failed on another rank"
            log(rank, f"skipping {c.name}: {c.skipped}")
    for _ in range(rounds - 1):
        for c in active(configs):
            step(c)


def active(configs: list[Config]) -> list[Config]:
    return [c for c in configs if c.skipped is None]


def count_bytes(cfg: dict[str, Any], configs: list[Config], step: Callable[[Config], None], rank: Rank) -> None:
    """One untimed step per configuration under CommCounter, with the tc counters read around it."""
    for c in active(configs):
        dist.barrier()
        before = tc_bytes(cfg, rank)
        with mesh_cp.CommCounter() as counter:
            step(c)
        dist.barrier()  # every peer has received this rank's bytes, so they have left its qdisc
        after = tc_bytes(cfg, rank)
        mine = {
            "bytes_by_role": counter.bytes_by_role(c.mesh),
            "wire_bytes": {kind: after[kind] - before[kind] for kind in after},
        }
        gathered: list[Any] = [None] * rank.world
        dist.all_gather_object(gathered, mine)
        c.counted = gathered


def run_benchmark(cfg: dict[str, Any], rank: Rank, rates: dict[str, float]) -> list[dict[str, Any]]:
    q, k, v, do = bench_inputs(cfg, rank)
    # The configured link rates order the overlapped schedule's ring moves (kernel speed plays no part).
    topology = Topology(
        ranks_per_node=cfg["ranks_per_node"],
        intra_bandwidth=rates["intra_bytes_per_s"],
        inter_bandwidth=rates["inter_bytes_per_s"],
        pairs_per_second=1.0,
    )
    configs = []
    for u, a, b in cfg["tiles"]:
        mesh = mesh_cp.auto_mesh(dist.group.WORLD, topology=topology, tile=(a, b), head_parallel=u)
        configs += [Config(tile=(u, a, b), schedule=s, mesh=mesh) for s in cfg["schedules"]]

    kernel = TimedKernel()

    def step(c: Config) -> None:
        out = mesh_cp.mesh_attn_func(q, k, v, mesh=c.mesh, causal=True, schedule=c.schedule, kernel=kernel)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    log(rank, f"warm-up ({cfg['warmup']} round(s) of {len(configs)} configurations)")
    warm_up(configs, step, rank, cfg["warmup"])
    log(rank, "counting bytes (one untimed round)")
    count_bytes(cfg, configs, step, rank)
    for c in active(configs):
        c.times_s, c.kernel_s = [], []
    for r in range(cfg["repeats"]):
        for c in active(configs):
            kernel.take()
            cpu, main_thread = time.process_time(), time.thread_time()
            c.times_s.append(timed(lambda: step(c)))
            cpu, main_thread = time.process_time() - cpu, time.thread_time() - main_thread
            gathered: list[Any] = [None] * rank.world
            dist.all_gather_object(gathered, [*kernel.take(), cpu, main_thread])
            c.kernel_s.append(gathered)
        log(
            rank,
            f"round {r + 1}/{cfg['repeats']}: " + ", ".join(f"{c.name} {c.times_s[-1]:.2f}s" for c in active(configs)),
        )
    return [c.report() for c in configs]


# ----------------------------------------------------------------------------------------------


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    gloo_exit_workaround()
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["gloo_timeout_s"]))
    rank = Rank(dist.get_rank(), dist.get_world_size(), cfg["ranks_per_node"], os.environ["GLOO_SOCKET_IFNAME"])

    log(rank, "timing the block kernel on all ranks at once")
    calibration = calibrate_kernel(cfg, rank)
    rates = wait_for_rates(cfg, rank, calibration)
    log(rank, "probing the links")
    links = probe_links(cfg, rank, rates)
    calibration["host_s_per_byte"] = calibrate_host_cost(cfg, rank, rates, calibration["full_block_fwd_s"])
    log(rank, f"compute lost to transfers: {calibration['host_s_per_byte'] * 1e9:.2f} ns per byte sent or received")
    results = run_benchmark(cfg, rank, rates)
    if rank.rank == 0:
        write_json(cfg["results_path"], {"calibration": calibration, "links": links, "configs": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
