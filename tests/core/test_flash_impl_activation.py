"""``cuda_flash`` while ``torch.nn.attention.activate_flash_attention_impl`` has swapped PyTorch's flash ops for
FlashAttention 4 or 3 (Note [Activated flash implementations] in :mod:`mesh_cp.kernels.cuda_flash`).

The activation runs through torch's own registry (``torch/nn/attention/_registry.py``) with the implementation's
``register_fn`` replaced by one that registers no kernel (the real one imports flash-attn-4 and needs CUDA), so the
state the kernel reads is the one a user's call leaves. The crash the refusal avoids is shown on torch's own FA4
shim (``torch/nn/attention/_fa4.py``) fed a forward of flash-attn-4's four results.
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import _fa4, _registry

import mesh_cp.kernels as kernels
from mesh_cp.kernels import cuda_flash
from mesh_cp.kernels.cuda_flash import CudaFlashKernel
from tests.core.test_kernel_emulation import CUDA0, EmulatedCudaAttention, emulate_cuda
from tests.core.test_kernels import check_block_kernel, lse_grad_case


@dataclasses.dataclass
class _Handle:
    removed: bool = False

    def remove(self) -> None:
        self.removed = True


@pytest.fixture(autouse=True)
def _fresh_choices():
    kernels.forget_choices()
    yield
    kernels.forget_choices()


def activate(monkeypatch, impl: str) -> _Handle:
    """``activate_flash_attention_impl(impl)`` with a ``register_fn`` that registers nothing; undone at teardown."""
    handle = _Handle()
    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, impl, lambda: handle)
    monkeypatch.setattr(_registry, "_FLASH_ATTENTION_ACTIVE", None)
    torch.nn.attention.activate_flash_attention_impl(impl)
    return handle


def test_cuda_flash_is_refused_by_name_while_fa4_is_active(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (9, 0))
    assert not CudaFlashKernel.not_supported_reasons(CUDA0, torch.bfloat16, 128)
    handle = activate(monkeypatch, "FA4")
    assert torch.nn.attention.current_flash_attention_impl() == "FA4"
    (reason,) = CudaFlashKernel.not_supported_reasons(CUDA0, torch.bfloat16, 128)
    for words in ("'FA4' is active", "returns four since 4.0.0b19", "kernel='flash_attn4'", "restore_flash_attention"):
        assert words in reason, reason
    with pytest.raises(NotImplementedError, match=r"'cuda_flash' cannot run .*'FA4' is active"):
        kernels.resolve_kernel("cuda_flash", CUDA0, torch.bfloat16, 128)
    assert kernels.choose(CUDA0, torch.bfloat16, 128)[0] != "cuda_flash"
    torch.nn.attention.restore_flash_attention_impl()
    assert handle.removed and not CudaFlashKernel.not_supported_reasons(CUDA0, torch.bfloat16, 128)


def test_cuda_flash_refuses_before_calling_an_op_when_activated_after_it_was_chosen(monkeypatch) -> None:
    """The choice is cached per inputs; a later activation is still caught by the forward and the backward."""
    kernel = CudaFlashKernel.without_device_check()
    case = lse_grad_case(4, 2, 64, seed=1, lse_only=False)
    with EmulatedCudaAttention() as mode:
        check_block_kernel(kernel, torch.bfloat16, True, case)
    assert mode.ran
    activate(monkeypatch, "FA4")
    q, k, v, do, _ = (t.bfloat16() for t in case)
    lse = torch.zeros(2, 4, 12)
    with EmulatedCudaAttention() as mode:
        with pytest.raises(RuntimeError, match=r"kernel 'cuda_flash': flash attention implementation 'FA4' is active"):
            kernel.forward(q, k, v, causal=True, scale=0.1)
        with pytest.raises(RuntimeError, match=r"use kernel='flash_attn4'"):
            kernel.backward(do, q, k, v, lse, lse, causal=True, scale=0.1)
    assert mode.ran == []


def test_choices_made_before_an_activation_are_made_again_under_it(monkeypatch) -> None:
    """'auto' and the refusal reasons are decided per activated implementation: a choice of cuda_flash made before
    FA4 was activated does not stand under it, and stands again once restored."""
    emulate_cuda(monkeypatch, (8, 0))
    assert kernels.choose(CUDA0, torch.bfloat16, 128, needs=("mask|segments",))[0] in ("flash_attn", "cuda_flash")
    assert not kernels.not_supported_reasons("cuda_flash", CUDA0, torch.bfloat16, 128)
    activate(monkeypatch, "FA4")
    assert kernels.not_supported_reasons("cuda_flash", CUDA0, torch.bfloat16, 128)
    assert kernels.choose(CUDA0, torch.bfloat16, 128, needs=("mask|segments",))[0] != "cuda_flash"
    torch.nn.attention.restore_flash_attention_impl()
    assert not kernels.not_supported_reasons("cuda_flash", CUDA0, torch.bfloat16, 128)


def test_cuda_flash_refuses_fa3_with_the_kernel_to_use_instead(monkeypatch) -> None:
    emulate_cuda(monkeypatch, (9, 0))
    activate(monkeypatch, "FA3")
    reason = cuda_flash.activated_impl_reason()
    assert "'FA3' is active" in reason and "kernel='flash_attn3'" in reason and "four" not in reason
    assert reason in CudaFlashKernel.not_supported_reasons(CUDA0, torch.bfloat16, 128)
    assert any("'FA3' is active" in r for r in cuda_flash.decode_reasons(CUDA0, torch.bfloat16, 128))


def test_torch_fa4_shim_fails_on_flash_attn_4_forward_of_four_results(monkeypatch) -> None:
    """Why: torch 2.13's ``_fa4_run_forward`` unpacks two values; flash-attn-4 >= 4.0.0b19 returns
    ``(out, lse, p, row_max)``."""

    class FlashAttn4:
        @staticmethod
        def _flash_attn_fwd(q, k, v, **kwargs):
            return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1]), None, None

    monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", "flash_attn.cute.interface")
    monkeypatch.setattr(_fa4, "_fa4_import_module", lambda path: FlashAttn4)
    q = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    args = (None, None, 16, 16, 0.1, False, None, None, None)
    with pytest.raises(ValueError, match="too many values to unpack"):
        _fa4._fa4_run_forward(q, q, q, *args)
