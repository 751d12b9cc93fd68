"""Checks of values that live on an accelerator, made without reading them on the host."""

from __future__ import annotations

import torch
from torch import Tensor


def check_on_device(ok: Tensor, error: Exception) -> None:
    """Raise ``error`` unless the boolean scalar ``ok`` is true, with no host synchronisation on a GPU.

    On the CPU ``error`` is raised at once. On an accelerator ``torch._assert_async(ok)`` queues a
    device-side assertion: a false ``ok`` stops the run at the next synchronisation (as a device-side
    assertion failure, not as ``error``), and a true one costs no host read. The message-taking
    overload of ``_assert_async`` is used on the CPU only (where it raises at once): on CUDA it refuses
    messages of 255 bytes or more with an immediate ``RuntimeError`` whatever ``ok`` is.
    """
    if ok.device.type == "cpu":
        try:
            torch._assert_async(ok, str(error))
        except RuntimeError:
            raise error from None
    else:
        torch._assert_async(ok)
