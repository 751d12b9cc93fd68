"""Every rank's RNG states for Megatron checkpoints (Note [Per-rank state] in
:mod:`mesh_cp.integrations.megatron.checkpoint`)."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist


def rank_grid() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, this rank's position) of the PP x TP x CP x DP grid of Megatron's parallel_state, or ``(world,)``
    and the rank when parallel_state is not initialized."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return (dist.get_world_size(),), (dist.get_rank(),)
    shape = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )
    position = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_context_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    return shape, position


def _rng_tracker():
    """Megatron's tensor-parallel RNG tracker if something created it (asking for it would create one)."""
    from megatron.core.tensor_parallel import random as tp_random

    if not getattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return tp_random.get_cuda_rng_tracker()


def get_rng_state() -> dict[str, Any]:
    """This rank's RNG states: Python's ``random``, NumPy's global generator, torch's CPU generator, the current
    CUDA device's generator (when CUDA is initialized) and the states of Megatron's tensor-parallel RNG tracker
    (when one exists)."""
    state: dict[str, Any] = {"random": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _rng_tracker()
    if tracker is not None:
        state["rng_tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("rng_tracker"):
        from megatron.core.tensor_parallel import random as tp_random

        tp_random.get_cuda_rng_tracker().set_states(state["rng_tracker"])
