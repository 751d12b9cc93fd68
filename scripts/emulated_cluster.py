"""Mesh-Attention vs Ring-Attention on an emulated 16-rank cluster: 4 nodes x 4 ranks, shaped links.

Every rank is a separate process in its own network namespace with its own link, as on GPU
clusters with one network card per GPU. All links meet in one Linux bridge (the "switch", in its
own namespace). Each link is shaped with ``tc`` in both directions (an htb qdisc on the rank's veth
for what it sends, one on the bridge port for what it receives), with two classes chosen by peer
address: one for the 3 same-node peers (fast, "NVLink") and one for the 12 other-node peers
(slow, "InfiniBand"). The intra-node and inter-node classes do not share bandwidth.

Reference point (what the default rates reproduce): on an H100 cluster (8 GPUs per node, NVLink
~450 GB/s per GPU, InfiniBand ~50 GB/s per GPU), Ring-Attention with MHA (32 heads x 128, bf16) at
4K tokens per rank is communication-bound: one KV chunk (2 x 4096 x 4096 x 2 B = 67 MB) takes
~1.3 ms over InfiniBand, one causal zig-zag block (4 x 4096^2 x 4096 / 2 = 1.4e11 FLOP) ~0.34 ms at
~400 TFLOP/s, a ratio of ~4 (~2 at 8K tokens per rank); intra-node links are ~10x faster than
inter-node ones. Here, at start-up and inside the emulation (so that the contention of 16
processes on the machine's cores is included), the ranks time the block kernel all at once; the
inter-node rate is then set so that one KV chunk (``2 * batch * seq_local * kv_heads * head_dim *
4`` bytes, fp32) takes ``--comm-ratio`` times one block (half a full ``seq_local x seq_local``
forward kernel call, as a zig-zag off-diagonal block is), and the intra-node rate ``--intra-factor``
times faster (or set fixed rates with ``--inter-mbit`` / ``--intra-mbit``). A probe then measures
what gloo achieves on both kinds of link, next to the configured rates.

For every tile and schedule (8 configurations by default) the benchmark runs warm-up rounds, one
untimed round counting the bytes every rank sends (per mesh group with ``mesh_cp.CommCounter``,
per link with the ``tc`` counters), then ``--repeats`` timed forward+backward rounds, round-robin
over the configurations, each timed from a barrier to the slowest rank's end. It prints a table
(median/min/max seconds, bytes, speed-ups over the ring) and can write everything as JSON,
including a ``"topology"`` dict for cost-model simulators.

Needs root (network namespaces, veth, bridge, tc); everything it creates is named ``mcp-*`` and is
removed on exit, including on Ctrl-C, SIGTERM or an error. ``--cleanup`` removes leftovers of a
run that was killed outright. Example::

    sudo .venv/bin/python scripts/emulated_cluster.py --schedules collective --json results/emul.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from mesh_cp.core import AttentionShape, Tiling
from mesh_cp.core.options import PHASES
from mesh_cp.sim import SimResult, Topology, plan_for_topology, simulate

WORLD = 16
RANKS_PER_NODE = 4
PREFIX = "mcp-"
SWITCH_NS = f"{PREFIX}sw"
BRIDGE = f"{PREFIX}br"
SUBNET = "10.77.0"
MTU = 65000  # near the veth maximum: the least CPU per byte, headers are ~0.1% of a frame
RUN_DIR_PREFIX = f"{PREFIX}emul-"
MASTER_PORT = 29500
TC_CLASSES = {"intra": "1:10", "inter": "1:20"}
WORKER = Path(__file__).with_name("_cluster_worker.py")
RING = (1, WORLD)
REFERENCE = (
    "Reference: H100 cluster (8 GPUs/node, NVLink ~450 GB/s, InfiniBand ~50 GB/s per GPU), Ring-Attention, MHA "
    "32x128 bf16 at 4K tokens/rank: one KV chunk over InfiniBand (~1.3 ms) takes ~4x one causal zig-zag block of "
    "compute (~0.34 ms at ~400 TFLOP/s); intra-node links ~10x faster than inter-node."
)


# ----------------------------------------------------------------------------------------------
# Command line


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"AxB"`` (a plain mesh) or ``"uU:AxB"`` (``U`` head-parallel ranks around an ``A x B`` mesh of ``WORLD / U``
    ranks; Note [Head-parallel x mesh]) as ``(U, A, B)``."""
    heads, _, tile = text.strip().rpartition(":")
    if heads and not (
        heads.startswith("u") and heads[1:].isdigit() and int(heads[1:]) >= 1 and WORLD % int(heads[1:]) == 0
    ):
        raise ValueError(f"{text!r}: the head-parallel prefix is uU: with U dividing {WORLD}, as in u4:1x4")
    u = int(heads[1:]) if heads else 1
    return (u, *Tiling.parse(tile, WORLD // u).shape)


def layout_label(u: int, a: int, b: int) -> str:
    return f"{a}x{b}" if u == 1 else f"u{u}:{a}x{b}"


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    tiles = [parse_layout(t) for t in text.split(",") if t.strip()]
    if not tiles or len(set(tiles)) != len(tiles):
        raise ValueError(f"--tiles needs distinct tiles, got {text!r}")
    return tiles


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--tiles",
        default="1x16,4x4,8x2,2x8",
        help=f"comma-separated mesh tiles AxB with A*B = {WORLD}, or uU:AxB with U head-parallel ranks around a mesh of "
        f"A*B = {WORLD}/U (u4:1x4 is USP); 1x{WORLD} is Ring-Attention (the speed-up baseline)",
    )
    p.add_argument("--schedules", default="collective,overlap", help="comma-separated mesh_attn_func schedules")
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward rounds per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before counting and timing")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq-local", type=int, default=1024, help="tokens per rank (even: zig-zag halves)")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads; default --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64, help="dimension of every head")
    p.add_argument(
        "--comm-ratio",
        type=float,
        default=4.0,
        help="inter-node seconds of one KV chunk / seconds of one causal zig-zag block (measured at start-up)",
    )
    p.add_argument("--intra-factor", type=float, default=10.0, help="intra-node rate / inter-node rate")
    p.add_argument("--inter-mbit", type=float, default=None, help="fixed inter-node rate in Mbit/s (no --comm-ratio)")
    p.add_argument(
        "--intra-mbit",
        type=float,
        default=None,
        help="fixed intra-node rate in Mbit/s (default: --intra-factor x inter)",
    )
    p.add_argument("--kernel-calls", type=int, default=5, help="block kernel calls timed at start-up")
    p.add_argument(
        "--probe-seconds", type=float, default=1.0, help="length of each link throughput probe at the configured rate"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random q, k, v and output gradient")
    p.add_argument("--gloo-timeout", type=float, default=30.0, help="gloo collective timeout in minutes")
    p.add_argument("--timeout", type=float, default=60.0, help="give up on the whole emulation after this many minutes")
    p.add_argument("--json", default=None, metavar="PATH", help="also write settings and results as JSON to PATH")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="only remove what a killed run left behind (mcp-* namespaces, their processes and links, run directories)",
    )
    args = p.parse_args(argv)

    try:
        args.tiles = parse_tiles(args.tiles)
    except ValueError as exc:
        p.error(str(exc))
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if not args.schedules:
        p.error("--schedules is empty")
    if args.repeats < 1 or args.warmup < 1 or args.kernel_calls < 1:
        p.error("--repeats, --warmup and --kernel-calls must be >= 1")
    if min(args.batch, args.heads, args.kv_heads, args.head_dim) < 1 or args.heads % args.kv_heads:
        p.error("--batch, --heads, --kv-heads, --head-dim must be >= 1 and --kv-heads must divide --heads")
    if args.seq_local < 2 or args.seq_local % 2:
        p.error("--seq-local must be even (the zig-zag layout splits it in two halves)")
    if min(args.comm_ratio, args.intra_factor, args.probe_seconds) <= 0:
        p.error("--comm-ratio, --intra-factor and --probe-seconds must be > 0")
    if any(x is not None and x <= 0 for x in (args.inter_mbit, args.intra_mbit)):
        p.error("--inter-mbit and --intra-mbit must be > 0")
    return args


# ----------------------------------------------------------------------------------------------
# Network: namespaces, bridge, veth links, shaping


def rank_ns(rank: int) -> str:
    return f"{PREFIX}r{rank}"


def rank_if(rank: int) -> str:
    """The rank's end of its veth link (in its namespace)."""
    return f"{PREFIX}v{rank}"


def port_if(rank: int) -> str:
    """The bridge's end of the rank's veth link (in the switch namespace)."""
    return f"{PREFIX}s{rank}"


def address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def same_node(r: int, s: int) -> bool:
    return r // RANKS_PER_NODE == s // RANKS_PER_NODE


def sh(*cmd: str, stdin: str | None = None, check: bool = True) -> str:
    """Run a command, return its stdout; raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def create_network() -> None:
    """The switch namespace with its bridge, and per rank a namespace with a veth link to the bridge."""
    sh("ip", "netns", "add", SWITCH_NS)
    sh("ip", "-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    sh("ip", "-n", SWITCH_NS, "link", "set", BRIDGE, "mtu", str(MTU), "up")
    for r in range(WORLD):
        ns = rank_ns(r)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", SWITCH_NS, "link", "add", port_if(r), "type", "veth", "peer", "name", rank_if(r), "netns", ns)
        sh("ip", "-n", SWITCH_NS, "link", "set", port_if(r), "mtu", str(MTU), "master", BRIDGE, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", rank_if(r), "mtu", str(MTU), "up")
        sh("ip", "-n", ns, "addr", "add", f"{address(r)}/24", "dev", rank_if(r))


def shaping_commands(dev: str, rank: int, direction: str, intra_bps: float, inter_bps: float) -> str:
    """``tc -batch`` lines shaping ``dev``: one htb class per kind of peer, chosen by peer address.

    ``direction`` is ``"dst"`` for what ``rank`` sends, ``"src"`` for what it receives. Unmatched
    traffic (ARP) takes the intra-node class.
    """
    lines = [f"qdisc replace dev {dev} root handle 1: htb default {TC_CLASSES['intra'].split(':')[1]}"]
    for kind, bps in (("intra", intra_bps), ("inter", inter_bps)):
        bits = max(int(bps * 8), 8000)
        # Bursts of 2 ms of traffic (at least two frames): smooth, yet little over the rate. The
        # classes never borrow from each other, so the quantum only keeps htb from warning.
        burst = max(int(bps * 0.002), 2 * MTU)
        lines.append(
            f"class replace dev {dev} parent 1: classid {TC_CLASSES[kind]} htb rate {bits}bit ceil {bits}bit "
            f"burst {burst} cburst {burst} quantum {MTU}"
        )
    for peer in range(WORLD):
        if peer != rank:
            kind = "intra" if same_node(rank, peer) else "inter"
            lines.append(
                f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip {direction} {address(peer)}/32 "
                f"flowid {TC_CLASSES[kind]}"
            )
    return "\n".join(lines) + "\n"


def shape_links(intra_bps: float, inter_bps: float) -> None:
    """Shape every rank's link, both ways, to ``intra_bps`` / ``inter_bps`` bytes per second."""
    for r in range(WORLD):
        sh("tc", "-n", rank_ns(r), "-batch", "-", stdin=shaping_commands(rank_if(r), r, "dst", intra_bps, inter_bps))
        sh("tc", "-n", SWITCH_NS, "-batch", "-", stdin=shaping_commands(port_if(r), r, "src", intra_bps, inter_bps))


def our_namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.startswith(PREFIX)]


def remove_network() -> list[str]:
    """Delete every ``mcp-*`` namespace (with its links) and ``mcp-*`` link; return what was removed.

    Processes still inside a namespace (workers of a killed run) are killed first, by pid.
    """
    removed = []
    for ns in our_namespaces():
        for pid in sh("ip", "netns", "pids", ns, check=False).split():
            kill_pid(int(pid))
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for line in sh("ip", "-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            sh("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    return removed


def remove_run_dirs() -> list[str]:
    """Delete the run directories (``<tmp>/mcp-emul-*``) that killed runs left behind."""
    dirs = sorted(Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"))
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return [f"dir {d}" for d in dirs]


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------------------------
# Rates from the calibration


def kv_chunk_bytes(args: argparse.Namespace) -> int:
    return 2 * args.batch * args.seq_local * args.kv_heads * args.head_dim * 4


def choose_rates(args: argparse.Namespace, calibration: dict[str, float]) -> dict[str, Any]:
    """Link rates in bytes/s: from ``--comm-ratio`` and the measured block time, or fixed ones."""
    block_s = calibration["full_block_fwd_s"] / 2
    if args.inter_mbit is None:
        inter = kv_chunk_bytes(args) / (args.comm_ratio * block_s)
    else:
        inter = args.inter_mbit * 1e6 / 8
    intra = inter * args.intra_factor if args.intra_mbit is None else args.intra_mbit * 1e6 / 8
    return {
        "rate_source": "comm-ratio" if args.inter_mbit is None else "fixed",
        "block_s": block_s,
        "intra_bytes_per_s": intra,
        "inter_bytes_per_s": inter,
        "intra_mbit": intra * 8 / 1e6,
        "inter_mbit": inter * 8 / 1e6,
        "comm_ratio": kv_chunk_bytes(args) / inter / block_s,
    }


# ----------------------------------------------------------------------------------------------
# The emulation: network + rank processes


@dataclass
class RunFiles:
    """Files the launcher and rank 0 exchange, in a private temporary directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def calibration(self) -> Path:
        return self.root / "calibration.json"

    @property
    def rates(self) -> Path:
        return self.root / "rates.json"

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    def log(self, rank: int) -> Path:
        return self.root / f"rank{rank}.log"


class Emulation:
    """Owns the network and the rank processes; :meth:`teardown` removes both and may run twice."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.files = RunFiles(Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)))
        self.procs: list[subprocess.Popen] = []
        self.logs: list[IO[str]] = []
        self.rates: dict[str, Any] | None = None
        self.torn_down = False

    def worker_config(self) -> dict[str, Any]:
        a = self.args
        return {
            "batch": a.batch,
            "seq_local": a.seq_local,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "tiles": [list(t) for t in a.tiles],
            "schedules": a.schedules,
            "warmup": a.warmup,
            "repeats": a.repeats,
            "kernel_calls": a.kernel_calls,
            "probe_seconds": a.probe_seconds,
            "seed": a.seed,
            "gloo_timeout_s": a.gloo_timeout * 60,
            "ranks_per_node": RANKS_PER_NODE,
            "tc_classes": TC_CLASSES,
            "calibration_path": str(self.files.calibration),
            "rates_path": str(self.files.rates),
            "results_path": str(self.files.results),
        }

    def start(self) -> None:
        create_network()
        self.files.config.write_text(json.dumps(self.worker_config(), indent=2))
        for r in range(WORLD):
            env = {
                **os.environ,
                "GLOO_SOCKET_IFNAME": rank_if(r),
                "MASTER_ADDR": address(0),
                "MASTER_PORT": str(MASTER_PORT),
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR",  # no warning that the namespace has no host name
            }
            out = None  # rank 0 prints its progress on our stdout
            if r:
                out = open(self.files.log(r), "w")  # closed in teardown
                self.logs.append(out)
            cmd = ["ip", "netns", "exec", rank_ns(r), sys.executable, str(WORKER), str(self.files.config)]
            # Own session: a Ctrl-C reaches only the launcher, which then stops the ranks itself.
            self.procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=subprocess.STDOUT if r else None, start_new_session=True
                )
            )

    def wait(self) -> dict[str, Any]:
        """Shape the links once rank 0 has timed the kernel; return rank 0's results."""
        deadline = time.monotonic() + self.args.timeout * 60
        while True:
            codes = [p.poll() for p in self.procs]
            for r, code in enumerate(codes):
                if code not in (None, 0):
                    raise RuntimeError(f"rank {r} exited with status {code}{self.log_tail(r)}")
            if all(code == 0 for code in codes):
                return json.loads(self.files.results.read_text())
            if self.rates is None and self.files.calibration.exists():
                self.apply_rates(json.loads(self.files.calibration.read_text()))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the emulation did not finish within --timeout {self.args.timeout} minutes")
            time.sleep(0.2)

    def apply_rates(self, calibration: dict[str, float]) -> None:
        rates = choose_rates(self.args, calibration)
        shape_links(rates["intra_bytes_per_s"], rates["inter_bytes_per_s"])
        print_rates(self.args, calibration, rates)
        tmp = self.files.rates.with_suffix(".tmp")
        tmp.write_text(json.dumps(rates))
        os.replace(tmp, self.files.rates)
        self.rates = rates

    def log_tail(self, rank: int, lines: int = 30) -> str:
        if rank == 0:
            return " (its output is above)"
        text = self.files.log(rank).read_text(errors="replace").splitlines()[-lines:]
        return "; last lines of its log:\n" + "\n".join(text)

    def teardown(self) -> None:
        """Stop the rank processes, remove the network and the run files; safe to call again."""
        if self.torn_down:
            return
        self.torn_down = True
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the cleanup
        try:
            for p in self.procs:
                if p.poll() is None:
                    p.terminate()
            for p in self.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in self.logs:
                f.close()
            remove_network()
            shutil.rmtree(self.files.root, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    """Turn Ctrl-C, SIGTERM and SIGHUP into SystemExit, so that the ``finally`` clean-up runs."""
    print(f"\n{signal.Signals(signum).name}: stopping the ranks and removing the network", file=sys.stderr)
    raise SystemExit(128 + signum)


# ----------------------------------------------------------------------------------------------
# Report


def load_average() -> str:
    """The 1/5/15-minute load average: other work on the machine skews compute and link rates."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def print_settings(args: argparse.Namespace) -> None:
    print(REFERENCE)
    print(
        f"emulated cluster: {WORLD} ranks = {WORLD // RANKS_PER_NODE} nodes x {RANKS_PER_NODE}, one process per rank, "
        f"{os.cpu_count()} CPU cores shared, 1 thread per rank; load average now {load_average()}"
    )
    print(
        f"workload: causal zig-zag, fp32, batch {args.batch}, seq_local {args.seq_local} (seq {WORLD * args.seq_local}), "
        f"heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}; "
        f"KV chunk {mib(kv_chunk_bytes(args))} MiB"
    )
    print(
        f"tiles {', '.join(layout_label(*t) for t in args.tiles)}; schedules {', '.join(args.schedules)}; "
        f"{args.warmup} warm-up + {args.repeats} timed round(s)",
        flush=True,
    )


def print_rates(args: argparse.Namespace, calibration: dict[str, float], rates: dict[str, Any]) -> None:
    block = rates["block_s"]
    print(
        f"block kernel (all {WORLD} ranks at once): full {args.seq_local}x{args.seq_local} block fwd "
        f"{calibration['full_block_fwd_s'] * 1e3:.1f} ms, bwd {calibration['full_block_bwd_s'] * 1e3:.1f} ms; "
        f"one zig-zag block (half) {block * 1e3:.1f} ms"
    )
    kv = kv_chunk_bytes(args)
    print(
        f"links ({rates['rate_source']}): inter-node {rates['inter_mbit']:.1f} Mbit/s "
        f"({rates['inter_bytes_per_s'] / 1e6:.2f} MB/s), intra-node {rates['intra_mbit']:.1f} Mbit/s "
        f"({rates['intra_bytes_per_s'] / 1e6:.2f} MB/s); one KV chunk takes "
        f"{kv / rates['inter_bytes_per_s'] * 1e3:.1f} ms inter-node, {kv / rates['intra_bytes_per_s'] * 1e3:.1f} ms "
        f"intra-node: comm ratio {rates['comm_ratio']:.2f} x block",
        flush=True,
    )


def link_report(rates: dict[str, Any], links: dict[str, Any]) -> dict[str, Any]:
    """Configured next to measured rates, per kind of link."""
    return {
        kind: {
            "configured_mbit": rates[f"{kind}_mbit"],
            "configured_bytes_per_s": rates[f"{kind}_bytes_per_s"],
            "single_link_bytes_per_s": m["single_link_bytes_per_s"],
            "measured_bytes_per_s": m["measured_bytes_per_s"],
            "measured_fraction": m["measured_bytes_per_s"] / rates[f"{kind}_bytes_per_s"],
            "latency_s": m["latency_s"],
        }
        for kind, m in links.items()
    }


def summarize(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: time statistics, bytes per rank, and speed-ups over the ring."""
    rows = []
    for c in configs:
        row = {"tile": layout_label(*c["tile"]), "schedule": c["schedule"], "skipped": c["skipped"]}
        if c["skipped"] is None:
            per_rank = c["per_rank"]
            roles = sorted({role for r in per_rank for role in r["bytes_by_role"]})
            row |= {
                "times_s": c["times_s"],
                "median_s": statistics.median(c["times_s"]),
                "min_s": min(c["times_s"]),
                "max_s": max(c["times_s"]),
                "bytes_by_role_max": {role: max(r["bytes_by_role"].get(role, 0) for r in per_rank) for role in roles},
                "wire_bytes_mean": {k: statistics.mean(r["wire_bytes"][k] for r in per_rank) for k in TC_CLASSES},
                "wire_bytes_max": {k: max(r["wire_bytes"][k] for r in per_rank) for k in TC_CLASSES},
                "per_rank": per_rank,
                "kernel_s": kernel_seconds(c["kernel_s"]),
            }
        rows.append(row)
    ring = {r["schedule"]: r for r in rows if r["tile"] == f"{RING[0]}x{RING[1]}" and r["skipped"] is None}
    for row in rows:
        if row["skipped"] is None:
            for key, base in (
                ("speedup_vs_ring_collective", ring.get("collective")),
                ("speedup_vs_ring_same", ring.get(row["schedule"])),
            ):
                row[key] = base["median_s"] / row["median_s"] if base else None
    return rows


def kernel_seconds(rounds: list[list[list[float]]]) -> dict[str, float]:
    """Per timed round and rank: wall-clock and CPU seconds inside the block kernel (forward, backward), CPU seconds
    of the process and of its main thread; the median over rounds of the mean over ranks (every rank computes the same blocks)."""
    names = (*PHASES, "forward_cpu", "backward_cpu", "cpu", "cpu_main_thread")
    return {
        name: statistics.median(statistics.mean(r[i] for r in ranks) for ranks in rounds)
        for i, name in enumerate(names)
    }


def measured_comm_ratio(args: argparse.Namespace, rates: dict[str, Any], links: dict[str, Any]) -> float:
    """Seconds of one KV chunk at the inter-node rate measured with every rank sending, per block."""
    return kv_chunk_bytes(args) / links["inter"]["measured_bytes_per_s"] / rates["block_s"]


def print_links(args: argparse.Namespace, rates: dict[str, Any], links: dict[str, Any]) -> None:
    print()
    print("-- links: configured rate vs what gloo achieves, on one link alone / with every rank sending at once --")
    for kind, m in links.items():
        configured = m["configured_bytes_per_s"]
        print(
            f"{kind}-node: configured {configured / 1e6:8.2f} MB/s ({m['configured_mbit']:.0f} Mbit/s), measured "
            f"{m['single_link_bytes_per_s'] / 1e6:8.2f} MB/s alone ({100 * m['single_link_bytes_per_s'] / configured:.0f}%), "
            f"{m['measured_bytes_per_s'] / 1e6:8.2f} MB/s all at once ({100 * m['measured_fraction']:.0f}%); "
            f"one-way latency {m['latency_s'] * 1e3:.2f} ms"
        )
    print(
        f"comm ratio: {rates['comm_ratio']:.2f} x block configured, {measured_comm_ratio(args, rates, links):.2f} x block "
        f"at the inter-node rate measured with every rank sending"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print("-- forward+backward seconds (barrier to slowest rank); MiB sent per rank in one fwd+bwd --")
    print("   wire = tc counters (mean over ranks, max for inter), groups = CommCounter (max over ranks)")
    header = (
        f"{'tile':5} {'schedule':10} {'median':>7} {'min':>7} {'max':>7}  {'intra':>7} {'inter':>7} {'inter max':>9}  "
        f"{'q grp':>7} {'kv grp':>7} {'other':>7}  {'vs ring coll':>12} {'vs ring same':>12}"
    )
    print(header)
    for r in rows:
        if r["skipped"] is not None:
            print(f"{r['tile']:5} {r['schedule']:10} skipped: {r['skipped']}")
            continue
        groups = r["bytes_by_role_max"]
        speedups = [f"{r[k]:.2f}x" if r[k] else "n/a" for k in ("speedup_vs_ring_collective", "speedup_vs_ring_same")]
        print(
            f"{r['tile']:5} {r['schedule']:10} {r['median_s']:7.2f} {r['min_s']:7.2f} {r['max_s']:7.2f}  "
            f"{mib(r['wire_bytes_mean']['intra']):>7} {mib(r['wire_bytes_mean']['inter']):>7} "
            f"{mib(r['wire_bytes_max']['inter']):>9}  {mib(groups.get('q', 0)):>7} {mib(groups.get('kv', 0)):>7} "
            f"{mib(groups.get('cp', 0) + groups.get('other', 0)):>7}  {speedups[0]:>12} {speedups[1]:>12}"
        )


def topology(
    args: argparse.Namespace, calibration: dict[str, float], rates: dict[str, Any], links: dict[str, Any]
) -> Topology:
    """The setting as the cost model sees it: the shaped link rates (which one link alone achieves,
    see the probe), the measured one-way latencies, the block kernel throughput measured with every
    rank computing at once, and the compute a rank loses per byte it moves meanwhile (16 ranks share
    the host's cores with the network stack)."""
    pairs = args.seq_local**2 * args.batch * args.heads
    return Topology(
        ranks_per_node=RANKS_PER_NODE,
        intra_bandwidth=rates["intra_bytes_per_s"],
        inter_bandwidth=rates["inter_bytes_per_s"],
        intra_latency=links["intra"]["latency_s"],
        inter_latency=links["inter"]["latency_s"],
        pairs_per_second=pairs / calibration["full_block_fwd_s"],
        backward_factor=calibration["full_block_bwd_s"] / calibration["full_block_fwd_s"],
        host_seconds_per_byte=calibration["host_s_per_byte"],
    )


def attention_shape(args: argparse.Namespace) -> AttentionShape:
    return AttentionShape(
        batch=args.batch,
        seq_local=args.seq_local,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        itemsize=4,
    )


def simulated(args: argparse.Namespace, row: dict[str, Any], topo: Topology) -> SimResult:
    u, a, b = parse_layout(row["tile"])
    tiling = Tiling(world=WORLD // u, a=a, b=b)
    plan = plan_for_topology(u, tiling, attention_shape(args), topo, causal=True, schedule=row["schedule"])
    return simulate(plan, topo)


def ring_topology(args: argparse.Namespace, rows: list[dict[str, Any]], topo: Topology) -> Topology | None:
    """``topo`` with the host's compute rates as the ring's timed rounds measured them (``None`` without a ring row).

    The ranks share the host's cores, so a CPU second of one rank costs ``ranks / cores`` seconds of wall-clock
    while every rank is busy (the start-up timing, all ranks at once, is in those units). In the ring's rounds,
    each rank's CPU seconds inside the block kernel give the kernel rates (forward and backward) on the blocks the
    mesh runs, and its other CPU seconds (all threads: gloo, packing and unpacking what moves, merging partial
    results) over the bytes it sent and received give the compute lost per byte (``host_seconds_per_byte``). The
    ring is calibrated on, every other layout is predicted."""
    rings = [row for row in rows if row["tile"] == layout_label(1, *RING) and row["skipped"] is None]
    if not rings:
        return None
    ring = next((row for row in rings if row["schedule"] == "overlap"), rings[0])
    share = max(1.0, WORLD / (os.cpu_count() or 1))
    cpu, predicted = ring["kernel_s"], simulated(args, ring, topo)
    forward = cpu["forward_cpu"] * share / predicted.forward.compute
    backward = cpu["backward_cpu"] * share / predicted.backward.compute
    moved = 2 * sum(ring["bytes_by_role_max"].values())  # every ring rank sends and receives as much
    other = cpu["cpu"] - cpu["forward_cpu"] - cpu["backward_cpu"]
    return replace(
        topo,
        pairs_per_second=topo.pairs_per_second / forward,
        backward_factor=topo.backward_factor * backward / forward,
        host_seconds_per_byte=other * share / moved,
    )


def predict(args: argparse.Namespace, rows: list[dict[str, Any]], topo: Topology, ring_topo: Topology | None) -> None:
    """Add the simulator's forward+backward seconds to every row that ran: with the host's rates timed at start-up
    and, when the ring ran, with those its rounds measured (:func:`ring_topology`)."""
    for row in rows:
        if row["skipped"] is None:
            row["predicted_s"] = simulated(args, row, topo).time
            row["prediction_error"] = row["predicted_s"] / row["median_s"] - 1
            if ring_topo is not None:
                row["predicted_ring_calibrated_s"] = simulated(args, row, ring_topo).time
                row["prediction_ring_calibrated_error"] = row["predicted_ring_calibrated_s"] / row["median_s"] - 1


def print_predictions(rows: list[dict[str, Any]], ring_topo: Topology | None) -> None:
    print()
    print("-- simulator (mesh_cp.sim, measured topology) vs measured median, forward+backward --")
    print("   CPU s per rank and round: in the block kernel / in all threads; start-up: the host's rates timed at")
    print(
        "   start-up; ring-calibrated: those the ring's rounds measured (the ring calibrates, the others are predicted)"
    )
    if ring_topo is not None:
        print(
            f"   ring calibration: {ring_topo.pairs_per_second:.3g} pairs/s, backward x{ring_topo.backward_factor:.2f}, "
            f"{ring_topo.host_seconds_per_byte * 1e9:.2f} ns per byte sent or received"
        )
    print(
        f"{'tile':>8} {'schedule':<10} {'measured s':>10} {'kernel cpu':>10} {'all cpu':>7} {'start-up s':>10} "
        f"{'error':>7} {'ring-cal s':>10} {'error':>7}"
    )
    for row in rows:
        if row["skipped"] is None:
            cpu = row["kernel_s"]
            calibrated = "n/a"
            if ring_topo is not None:
                error = 100 * row["prediction_ring_calibrated_error"]
                calibrated = f"{row['predicted_ring_calibrated_s']:>10.2f} {error:>+6.1f}%"
            print(
                f"{row['tile']:>8} {row['schedule']:<10} {row['median_s']:>10.2f} "
                f"{cpu['forward_cpu'] + cpu['backward_cpu']:>10.2f} {cpu['cpu']:>7.2f} "
                f"{row['predicted_s']:>10.2f} {100 * row['prediction_error']:>+6.1f}% {calibrated}"
            )


def write_json(
    path: str,
    args: argparse.Namespace,
    calibration: dict[str, float],
    rates: dict[str, Any],
    links: dict[str, Any],
    rows: list[dict[str, Any]],
    runtime_s: float,
    topo: Topology,
    ring_topo: Topology | None,
) -> None:
    report = {
        "reference": REFERENCE,
        "settings": {
            "world": WORLD,
            "ranks_per_node": RANKS_PER_NODE,
            "tiles": [layout_label(*t) for t in args.tiles],
            "schedules": args.schedules,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "batch": args.batch,
            "seq_local": args.seq_local,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": "float32",
            "causal": True,
            "layout": "zigzag",
            "kv_chunk_bytes": kv_chunk_bytes(args),
            "comm_ratio_requested": args.comm_ratio,
            "intra_factor": args.intra_factor,
            "mtu": MTU,
            "cpu_count": os.cpu_count(),
            "load_average_end": load_average(),
            "seed": args.seed,
        },
        "calibration": {
            **calibration,
            **rates,
            "comm_ratio_measured": measured_comm_ratio(args, rates, links),
        },
        "links": links,
        "topology": topo.to_dict(),
        "topology_ring_calibrated": None if ring_topo is None else ring_topo.to_dict(),
        "results": rows,
        "runtime_s": runtime_s,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"results written to {path}")


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print(
            "emulated_cluster.py must run as root: it creates network namespaces, veth links, a bridge and tc qdiscs.",
            file=sys.stderr,
        )
        return 2
    if args.cleanup:
        removed = remove_network() + remove_run_dirs()
        print(
            "removed: " + (", ".join(removed) if removed else "nothing (no mcp-* namespaces, links or run directories)")
        )
        return 0
    leftovers = our_namespaces()
    if leftovers:
        print(
            f"mcp-* namespaces exist ({', '.join(leftovers)}): another run is active or crashed; try --cleanup",
            file=sys.stderr,
        )
        return 2

    t0 = time.monotonic()
    print_settings(args)
    emulation = Emulation(args)
    atexit.register(emulation.teardown)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # respect nohup and the like
            signal.signal(sig, _exit_on_signal)
    try:
        emulation.start()
        results = emulation.wait()
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        emulation.teardown()
    runtime = time.monotonic() - t0

    rates = emulation.rates
    links = link_report(rates, results["links"])
    rows = summarize(results["configs"])
    print_links(args, rates, links)
    print_table(rows)
    topo = topology(args, results["calibration"], rates, links)
    ring_topo = ring_topology(args, rows, topo)
    predict(args, rows, topo, ring_topo)
    print_predictions(rows, ring_topo)
    print(f"total runtime {runtime:.0f} s (network set-up and removal included); load average now {load_average()}")
    if args.json:
        write_json(args.json, args, results["calibration"], rates, links, rows, runtime, topo, ring_topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
