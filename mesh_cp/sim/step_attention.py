"""The attention's share of the whole-step memory model (:mod:`mesh_cp.sim.step`): the buffers of the layout the
cost model picks for the CP group, or of the attention kernel on one rank (pure Python, no torch)."""

from __future__ import annotations

from typing import Literal

from mesh_cp.core import AttentionShape, Tiling
from mesh_cp.sim.choice import candidates, choose, plan_for_topology
from mesh_cp.sim.memory import Backend, peak_bytes
from mesh_cp.sim.step_config import ModelConfig, StepOptions
from mesh_cp.sim.topology import Topology

ATTENTION_KERNEL = 1.15
"""One-device attention backward: multiples of dq + dk + dv (the kernel's gradients and temporaries), fitted."""


def attention_buffers(
    model: ModelConfig,
    seq: int,
    options: StepOptions,
    *,
    topology: Topology | None = None,
    backend: Backend = "nccl",
    memory_budget: int | Literal["least"] | None = None,
) -> tuple[int, int]:
    """Bytes the attention allocates ``(forward, backward)`` beyond its inputs and saved tensors on one rank.

    One rank (``cp == 1``): the kernel's backward gradients and temporaries (:data:`ATTENTION_KERNEL` times dq, dk,
    dv). CP: :func:`mesh_cp.sim.memory.peak_bytes` on rank 0 of the :func:`attention_layout` for ``seq / cp`` tokens
    per rank on ``topology`` (default the ``h100`` preset)."""
    act, cp = options.act_bytes, options.cp_degree
    if cp == 1:
        dqkv = seq * options.batch * (model.heads + 2 * model.kv_heads) * model.head_dim * act
        return 0, int(ATTENTION_KERNEL * dqkv)
    shape = AttentionShape(options.batch, seq // cp, model.heads, model.kv_heads, model.head_dim, act)
    topology = topology or Topology.preset("h100", head_dim=model.head_dim)
    layout = attention_layout(cp, shape, topology, memory_budget, backend=backend)
    plan = plan_for_topology(*layout, shape, topology)
    return peak_bytes(plan, "forward", backend=backend), peak_bytes(plan, "backward", backend=backend)


def attention_layout(
    cp: int,
    shape: AttentionShape,
    topology: Topology,
    memory_budget: int | Literal["least"] | None = None,
    *,
    backend: Backend = "nccl",
) -> tuple[int, Tiling]:
    """``(head_parallel, tiling)`` of the attention on ``cp`` ranks for ``shape`` (per-rank sizes): what
    :func:`mesh_cp.sim.choose` picks within ``memory_budget`` bytes of attention memory (``None``: the fastest), or
    with ``"least"`` the candidate whose larger :func:`mesh_cp.sim.memory.peak_bytes` of forward and backward on
    ``backend`` is least (overlapped schedule)."""
    if memory_budget == "least":

        def peak(key: tuple[int, Tiling]) -> int:
            plan = plan_for_topology(*key, shape, topology)
            return max(peak_bytes(plan, phase, backend=backend) for phase in ("forward", "backward"))

        return min(candidates(cp, shape), key=peak)
    u, tiling, _ = choose(cp, shape, topology, memory_budget=memory_budget)
    return u, tiling
