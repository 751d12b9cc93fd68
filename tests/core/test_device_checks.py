"""check_on_device: the caller's error on the CPU; on an accelerator a message-free device assertion."""

from __future__ import annotations

import pytest
import torch

from mesh_cp.runtime.device_checks import check_on_device


def test_cpu_raises_the_callers_error_at_once() -> None:
    check_on_device(torch.tensor(True), ValueError("never raised"))
    long = "x" * 400  # longer than CUDA's 255-byte assertion message
    with pytest.raises(ValueError, match="^x{400}$"):
        check_on_device(torch.tensor(False), ValueError(long))


def test_accelerator_gets_the_plain_assertion_without_a_message(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch, "_assert_async", lambda *args: calls.append(args))
    ok = torch.empty((), dtype=torch.bool, device="meta")
    check_on_device(ok, ValueError("x" * 400))
    assert len(calls) == 1 and len(calls[0]) == 1 and calls[0][0] is ok
