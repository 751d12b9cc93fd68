"""The swap of ``accelerator.gather_for_metrics`` (TRL's training metrics, MeshCPTrainer's evaluation): inside the
context the given function, on leaving (an exception included, and nested) what was there before."""

from __future__ import annotations

import pytest

from mesh_cp.integrations.hf.compat import every_rank_once, gather_for_metrics_as


class _Accelerator:
    def gather_for_metrics(self, data, use_gather_object=False):
        return ("trimmed", data)

    def gather(self, data):
        return ("every rank", data)


def test_gather_for_metrics_swap_nests_and_restores() -> None:
    accelerator = _Accelerator()
    with gather_for_metrics_as(accelerator, lambda data: ("cp group", data)):
        with pytest.raises(RuntimeError, match="inside"), every_rank_once(accelerator):
            assert accelerator.gather_for_metrics(1) == ("every rank", 1)
            raise RuntimeError("inside")
        assert accelerator.gather_for_metrics(2) == ("cp group", 2)  # the outer swap again, not the class's method
    assert accelerator.gather_for_metrics(3) == ("trimmed", 3)
    assert "gather_for_metrics" not in vars(accelerator)
