"""Megatron's attention_mask check compares a few rows at a time against the rank's positions: the causal mask of
the zig-zag chunks passes, any other mask is refused, whatever the block of rows the difference is in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mesh_cp.core import local_positions
from mesh_cp.integrations.megatron.attention import MaskCheck


@pytest.mark.parametrize("rows_at_once", [3, 1024])
def test_mask_check_in_blocks_of_rows(rows_at_once: int, monkeypatch) -> None:
    monkeypatch.setattr(MaskCheck, "ROWS", rows_at_once)
    mesh = SimpleNamespace(size=4, rank=1)
    seq, seq_local = 32, 8
    rows = torch.tensor(local_positions(seq, 4, 1, "zigzag"))
    good = (rows[:, None] < torch.arange(seq)[None, :]).expand(2, 1, seq_local, seq).clone()
    MaskCheck()(good, mesh, True, seq_local, 2)
    for row in (0, 4, seq_local - 1):  # a difference in the first, a middle and the last block of rows
        bad = good.clone()
        bad[1, 0, row, 0] = True
        with pytest.raises(NotImplementedError, match="not the causal mask of the zig-zag chunks"):
            MaskCheck()(bad, mesh, True, seq_local, 2)
    with pytest.raises(NotImplementedError, match="not the causal mask"):
        MaskCheck()(good, mesh, False, seq_local, 2)
