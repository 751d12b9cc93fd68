"""One pass each for the elementwise work around the kernel calls: the LSE merge, the rows' ``delta`` and
``out_for_delta``.

Note [Fused passes]
~~~~~~~~~~~~~~~~~~~
The LSE merge (Note [LSE merge], :func:`mesh_cp.core.numerics.merge_`) reads and rewrites a row's fp32
accumulators for every partial merged in (the last one writing the output in the input dtype), the rows' ``delta =
rowsum(dO * O)`` widens ``dO`` and ``O`` to fp32 before it multiplies them, and ``out_for_delta`` (construction 1
of Note [Gradient of the lse], :func:`mesh_cp.kernels.base.out_for_delta`) builds the ``out`` a fused backward
takes, once per backward call. Eager, each is a chain of about ten elementwise ops and row reductions, every one a
kernel that reads and writes the rows: about 18 bytes per element for the merge and 50 for ``out_for_delta``, against
10 and 4 in one pass.

On CUDA each runs as one ``torch.compile``'d function (Inductor fuses the chain), compiled once per dtype
signature with dynamic shapes, so new row counts do not recompile; up to :data:`RECOMPILES` signatures each (the
accumulators' and the partials' dtypes, views or whole tensors, a batch of one), beyond which a call of a new one
runs eagerly. Elsewhere they run eagerly: on CPU the compile takes seconds in every process, which the sizes run
there do not pay back. A call under a ``TorchDispatchMode`` (a FLOP counter, emulated ops) runs eagerly too, as
``torch.compile`` does not run under one.

A compile that fails (no Triton, an unsupported GPU: an error of Dynamo's, raised before the compiled code writes
anything) is logged once with its reason, and the eager function runs from then on in that process; any other error
(out of memory, a caller's bad shapes) is raised as the eager function would raise it. The environment variable
``MESH_CP_FUSED`` overrides the choice: ``0`` runs them eagerly everywhere, ``1`` compiles them on every device (how
the tests check the compiled functions on CPU).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

from mesh_cp.core import numerics

logger = logging.getLogger("mesh_cp")

ENV = "MESH_CP_FUSED"

RECOMPILES = 64
"""Compiled signatures per function (Dynamo's ``recompile_limit``, 8 by default, set for these calls only)."""


class Fused:
    """``fn`` compiled where Note [Fused passes] says, else ``fn`` itself; called like ``fn``, its first argument a
    tensor on the device that decides."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed: str | None = None
        """Why the compiled function is no longer used in this process (``None``: it is, where it applies)."""
        functools.update_wrapper(self, fn)

    def __call__(self, first: Tensor, *args):
        if self.failed is not None or not compiles(first.device) or _dispatch_mode():
            return self.fn(first, *args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        try:
            with _dynamo_config().patch(recompile_limit=RECOMPILES):
                return self.compiled(first, *args)
        except FailOnRecompileLimitHit:  # raised before anything runs; the signatures compiled so far stay compiled
            return self.fn(first, *args)
        except TorchDynamoException as err:  # the compile failed, before the compiled code wrote anything
            self.failed = f"{type(err).__name__}: {err}"[:2000]
            logger.warning(
                "mesh_cp: %s runs eagerly from now on (Note [Fused passes]): its compiled version failed: %s "
                "(set %s=0 to skip the compile)",
                self.fn.__name__,
                self.failed,
                ENV,
            )
            return self.fn(first, *args)


def _dynamo_config():
    """Dynamo's configuration module (private: ``torch.compile`` takes no per-function recompile limit); its
    ``recompile_limit`` is checked by tests/core/test_fused.py."""
    import torch._dynamo.config

    return torch._dynamo.config


def _dispatch_mode() -> bool:
    """A ``TorchDispatchMode`` is active (a FLOP counter, a test's emulated ops): ``torch.compile`` does not run
    under one, so the call runs eagerly (private: torch has no public query of the mode stack)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def compiles(device: torch.device) -> bool:
    """Whether the passes run compiled on ``device``: on CUDA, unless ``MESH_CP_FUSED`` says otherwise."""
    mode = os.environ.get(ENV)
    if mode is None or mode == "":
        return device.type == "cuda"
    if mode not in ("0", "1"):
        raise ValueError(
            f"{ENV}={mode!r}: use 0 (eager everywhere), 1 (compiled on every device) or leave it unset "
            f"(compiled on CUDA)"
        )
    return mode == "1"


merge_ = Fused(numerics.merge_)
""":func:`mesh_cp.core.numerics.merge_` in one pass where it compiles (Note [Fused passes])."""

merged = Fused(numerics.merged)
""":func:`mesh_cp.core.numerics.merged` in one pass where it compiles (Note [Fused passes])."""

added = Fused(numerics.added)
""":func:`mesh_cp.core.numerics.added` (two partial gradients summed in fp32) in one pass where it compiles."""

attention_delta = Fused(numerics.attention_delta)
""":func:`mesh_cp.core.numerics.attention_delta` (``rowsum(dO * O) - dlse`` in fp32) in one pass where it compiles: it
reads ``dO`` and ``O`` once and writes the rows' ``delta``, with no widened copies of them (Note [Fused passes])."""
