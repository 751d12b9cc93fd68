"""Which row partials the collective schedule may send as the kernel returns them (pure Python).

Note [Partials as computed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A row partial of one kernel call is its ``o`` (forward) or ``dq`` (backward) in the input dtype: an fp32 accumulator
would hold exactly those values. So when every partial a rank sends its rows' owners is one call's (a kernel that
takes segments runs a Q chunk as one call) and the kernel returns ``dq`` in the input dtype, the collective schedule
sends the kernel's outputs as they are (``partials="input"`` of the plan): no copy into an accumulator, half the bytes
of the forward's and the backward's reduce, and the owner merges or sums them in fp32 as before, to the same values. A
call over some of the chunk's rows (a zig-zag chunk whose first half sees none of the keys) is written into a chunk
of the input dtype whose other rows hold the identity.
"""

from __future__ import annotations

from mesh_cp.core.program import KernelMode, Program, rank_program


def rows_as_computed(plan, mode: KernelMode) -> bool:
    """Whether every mesh rank computes each of its Q chunks in at most one call of the kernel (no tile of the
    reference kernel), in the collective schedule (Note [Partials as computed]); decided once per plan and mode."""
    cache = plan.__dict__.setdefault("_rows_as_computed", {})
    if mode not in cache:
        cache[mode] = all(_single(rank_program(plan, r, mode)) for r in range(plan.tiling.world))
    return cache[mode]


def _single(prog: Program) -> bool:
    slots = [c.slot for c in prog.calls]
    return len(slots) == len(set(slots)) and not any(c.reference for c in prog.calls)
