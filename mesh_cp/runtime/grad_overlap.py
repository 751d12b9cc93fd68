"""Gradient reduction overlapped with backward: each bucket's all-reduce starts as soon as backward has produced
its gradients, instead of after backward, and ``finish()`` waits for them all.

Note [Overlapped gradient reduction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`~mesh_cp.runtime.gradients.all_reduce_gradients` starts when backward has ended, so the step waits for the
whole gradient all-reduce after the whole backward. Backward produces the gradients from the last layer to the
first, so, like torch DDP and Megatron's ``overlap_grad_reduce``, :class:`OverlappedReduction` cuts the parameters
in *reverse* order into the buckets of Note [Gradient buckets] (one persistent flat buffer per bucket), registers
a ``post_accumulate_grad`` hook on every parameter that copies its accumulated gradient into the parameter's
slot of its bucket, and launches the bucket's all-reduce (``async_op=True``) once all of its gradients are in:
the reduction of the last layers runs while backward computes the first ones. ``finish()`` waits for every
all-reduce, divides by the DP size, and makes each gradient a view of its bucket (no copy back, DDP's
``gradient_as_bucket_view``; a non-contiguous parameter gets a copy in its own layout). The next backward either
accumulates into those views in place (``zero_grad(set_to_none=False)``) or makes new gradients that the hooks
copy in; ``finish()`` re-arms the hooks for the next step.

Every rank must launch the same all-reduces in the same order, or NCCL pairs different buckets and hangs (or
sums the wrong bytes). Buckets are therefore launched strictly in bucket order, each exactly once per step: a
bucket whose gradients are in waits for the buckets before it. A parameter that received no gradient in the
step (a branch this rank skipped, a frozen-in-practice layer) holds its bucket back until ``finish()``, which
fills its slot with its ``.grad`` if it has one (an earlier micro-batch's) and zeros otherwise, then launches
every bucket not yet launched. So every rank reduces every bucket once, in order, whatever it used, and the sum
is the sum over the ranks that used the parameter. ``unused="zeros"`` (the default) keeps that, and a parameter
no rank used keeps no gradient, as in one process (each bucket's flags, Note [Used flags] in
:mod:`mesh_cp.runtime.gradients`: an optimizer skips it). ``unused="error"`` raises in ``finish()`` naming the
parameters that got no gradient on this rank, after the collectives have completed, so the other ranks are not
left waiting in one. One caveat, as
DDP's for unused parameters: a bucket one rank holds back until ``finish()`` while the others launch it during
backward is then issued, on that rank, after the attention's own backward collectives on the CP subgroups, on the
others before some of them. NCCL asks for collectives on different communicators to be issued in one order on
every rank where they can block each other, so a model whose ranks skip different parameters is best reduced with
``unused="error"`` (which names them) or without overlap (:meth:`~mesh_cp.DataContextParallel.reduce_gradients`).

Gradient accumulation: run the backward of every micro-batch but the last under ``no_sync()`` (DDP's name). The
hooks then only note that the parameter was used; gradients accumulate in ``.grad`` as without the hooks, and
the last backward reduces the accumulated sums. A second backward without ``finish()`` between is refused by
name (its gradients would be added into a bucket already sent).

The buckets hold the parameters that required a gradient when the reduction was made: ``finish()`` raises, naming
them, once a parameter is frozen or unfrozen after that (make the reduction again).

Buckets follow the reverse of ``model.named_parameters()``, the order backward produces gradients for a model
that registers its layers in the order it calls them; a model that does not still gets the right gradients, with
less overlap (DDP rebuilds its buckets from the first step's order; this does not, so every rank keeps the same
buckets without a broadcast). ``torch.nn.parallel.DistributedDataParallel(model, process_group=group)``
averages over all the ``dp x cp`` ranks where mesh_cp sums over CP and averages over DP: its gradients are
mesh_cp's divided by ``cp_size``, so multiply the loss by ``cp_size`` to get the same ones with DDP.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from mesh_cp.core.options import positive_int
from mesh_cp.runtime.gradients import BUCKET_BYTES, gradient_buckets, read_flags

Unused = Literal["zeros", "error"]
UNUSED: tuple[str, ...] = get_args(Unused)


class OverlappedReduction:
    """Sum the gradients of ``model`` over ``group`` (then divide them by ``divide_by``) in buckets whose
    all-reduces start during backward; see Note [Overlapped gradient reduction].

    ``loss.backward(); reduction.finish(); optimizer.step()`` every step; ``with reduction.no_sync():`` around the
    backward of every micro-batch but the last; ``remove()`` takes the hooks off the parameters. Every rank of
    ``group`` must build it from the same model (the same parameters, in the same order), once the model has its
    final device and dtype: the buckets are allocated here, like the parameters'."""

    def __init__(
        self,
        model: torch.nn.Module,
        group: dist.ProcessGroup,
        *,
        divide_by: int = 1,
        bucket_bytes: int = BUCKET_BYTES,
        unused: Unused = "zeros",
    ) -> None:
        if unused not in UNUSED:
            raise ValueError(f"unused {unused!r} is not supported; choose one of {list(UNUSED)}")
        positive_int("divide_by", divide_by)
        every = list(model.named_parameters())
        self._trainable = [p.requires_grad for _, p in every]
        self._every = every
        named = [(name, p) for name, p in every if p.requires_grad][::-1]
        if not named:
            raise ValueError(f"{type(model).__name__} has no parameter that requires a gradient: nothing to reduce")
        self.group, self.divide_by, self.unused = group, divide_by, unused
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.buffers: list[Tensor] = []
        """One flat buffer per bucket, in launch order."""
        self._slots: list[Tensor] = [None] * len(named)  # type: ignore[list-item]
        self._flags: list[Tensor] = [None] * len(named)  # type: ignore[list-item]
        """Each parameter's flag in its bucket (Note [Used flags] in :mod:`mesh_cp.runtime.gradients`)."""
        self._bucket_of = [0] * len(named)
        self._sizes: list[int] = []
        index = {id(p): i for i, p in enumerate(self.params)}
        for b, bucket in enumerate(gradient_buckets(self.params, bucket_bytes)):
            size = sum(p.numel() for p in bucket)
            buffer = torch.zeros(size + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for k, p in enumerate(bucket):
                i = index[id(p)]
                self._slots[i], self._bucket_of[i] = buffer[offset : offset + p.numel()], b
                self._flags[i] = buffer[size + k]
                offset += p.numel()
            self.buffers.append(buffer)
            self._sizes.append(len(bucket))
        self._lock = threading.Lock()  # hooks of parameters on different devices run on different threads
        self._sync = True
        self._reset()
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, i))
            for i, p in enumerate(self.params)
        ]

    @property
    def num_buckets(self) -> int:
        """The number of all-reduces of a step."""
        return len(self.buffers)

    def _reset(self) -> None:
        """Re-arm for the next step: no parameter seen or ready, no bucket launched."""
        self._seen = [False] * len(self.params)
        self._ready = [False] * len(self.params)
        self._pending = list(self._sizes)
        self._missing: list[int] = []
        """Parameters this rank had no gradient for in the step (their flags are 0)."""
        self._next = 0
        self._works: list[dist.Work] = []

    def _on_gradient(self, i: int, param: torch.nn.Parameter) -> None:
        """The hook of parameter ``i``, run by autograd once its gradient of this backward is accumulated."""
        with self._lock:
            self._seen[i] = True
            if not self._sync:
                return
            if self._ready[i]:
                raise RuntimeError(
                    f"{self.names[i]}: a second backward since the last finish() accumulated its gradient after its "
                    f"bucket was sent; call finish() after each step's backward and run the backward of every "
                    f"micro-batch but the last under no_sync()"
                )
            self._fill(i, param.grad)
            self._launch_ready()

    def _fill(self, i: int, grad: Tensor | None) -> None:
        """Put this rank's gradient of parameter ``i`` (zeros for none) into its slot; the slot is ready."""
        slot = self._slots[i]
        if grad is None:
            slot.zero_()
            self._missing.append(i)
        elif grad.is_sparse:
            raise NotImplementedError(f"{self.names[i]}: sparse gradients are not reduced in buckets; use dense ones")
        elif grad.data_ptr() != slot.data_ptr():  # not already the view finish() made
            slot.copy_(grad.reshape(-1))
        self._ready[i] = True
        self._pending[self._bucket_of[i]] -= 1

    def _launch_ready(self) -> None:
        """Start the all-reduce of every complete bucket whose predecessors are all started, in bucket order."""
        while self._next < len(self.buffers) and self._pending[self._next] == 0:
            flags = self.buffers[self._next][-self._sizes[self._next] :]
            flags.fill_(1)
            for i in self._missing:
                if self._bucket_of[i] == self._next:
                    self._flags[i].fill_(0)
            self._works.append(dist.all_reduce(self.buffers[self._next], group=self.group, async_op=True))
            self._next += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients in ``.grad`` without reducing them (every
        micro-batch but the last; the last backward, outside, reduces the sums)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> int:
        """Launch the buckets still held back (by parameters without a gradient: zeros), wait for every all-reduce,
        divide by ``divide_by`` and make the gradients views of the buckets; re-arms the hooks for the next step.
        Returns the number of all-reduces (the number of buckets)."""
        if not self._sync:
            raise RuntimeError("finish() inside no_sync(): finish after the backward of the last micro-batch")
        with self._lock:
            unseen = [name for name, seen in zip(self.names, self._seen, strict=True) if not seen]
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._fill(i, self.params[i].grad)
            self._launch_ready()
            works, missing = self._works, self._missing
            self._reset()
        for work, buffer in zip(works, self.buffers, strict=True):
            work.wait()
            if self.divide_by != 1:
                buffer.div_(self.divide_by)
        unused = {i for i, used in zip(missing, read_flags([self._flags[i] for i in missing]), strict=True) if not used}
        self._write_back(unused)
        changed = [name for (name, p), was in zip(self._every, self._trainable, strict=True) if p.requires_grad != was]
        if changed:
            raise RuntimeError(
                f"requires_grad changed since the reduction was made for {changed[:8]}: its buckets hold the "
                f"parameters that required a gradient then; call remove() and make it again after freezing or "
                f"unfreezing parameters"
            )
        if unseen and self.unused == "error":
            shown = ", ".join(unseen[:8]) + (f" and {len(unseen) - 8} more" if len(unseen) > 8 else "")
            raise RuntimeError(
                f"{len(unseen)} parameter(s) got no gradient on this rank since the last finish(): {shown}. Every "
                f"bucket was still reduced (zeros for them), so the ranks are in step; pass unused='zeros' to "
                f"reduce zeros for parameters a step may skip, or requires_grad_(False) the ones never trained"
            )
        return len(works)

    def _write_back(self, unused: set[int]) -> None:
        """Every gradient becomes the reduced view of its slot (a copy for a non-contiguous parameter), but those of
        the ``unused`` parameters, which no rank had, stay ``None``."""
        for i, (p, slot) in enumerate(zip(self.params, self._slots, strict=True)):
            if i in unused or (p.grad is not None and p.grad.data_ptr() == slot.data_ptr()):
                continue
            view = slot.view(p.shape)
            if p.is_contiguous():
                p.grad = view
            elif p.grad is not None:
                p.grad.copy_(view)
            else:
                p.grad = torch.empty_like(p).copy_(view)

    def remove(self) -> None:
        """Take the hooks off the parameters (the gradients stay as the last ``finish()`` left them)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (
            f"OverlappedReduction({len(self.params)} parameters in {self.num_buckets} buckets over "
            f"{dist.get_world_size(self.group)} ranks, unused={self.unused!r})"
        )
