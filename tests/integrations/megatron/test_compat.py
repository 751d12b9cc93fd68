"""``mesh_cp.integrations.megatron.compat`` against the installed megatron-core: each difference is detected where the
version's source says it is (0.17: ``async_strategy``; 0.18: ``is_hybrid_cp``, no ``get_thd_batch_on_this_cp_rank``),
and the checks that run before Megatron is called name the value, the rule and the fix. The sharding itself is compared
with TP1 x CP1 in test_megatron.py (zig-zag and THD rows, every layout)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import __version__ as megatron_version  # noqa: E402
from megatron.core import utils as megatron_utils  # noqa: E402
from packaging.version import Version  # noqa: E402

from mesh_cp.integrations.megatron import compat  # noqa: E402

VERSION = Version(Version(megatron_version).base_version)


def test_differences_are_detected_where_each_version_has_them() -> None:
    assert compat.takes_is_hybrid_cp() == (VERSION >= Version("0.18"))
    assert hasattr(megatron_utils, "get_thd_batch_on_this_cp_rank") == (VERSION < Version("0.18"))
    assert compat.async_save_options() == ({"async_strategy": "mcore"} if VERSION >= Version("0.17") else {})


@pytest.mark.parametrize(
    ("seq", "cp", "nearest"),
    [(1001, 4, "1000 or 1008"), (30, 4, "24 or 32"), (5, 4, "8"), (0, 2, "4")],
)
def test_sequence_length_names_the_multiple_and_the_nearest_lengths(seq: int, cp: int, nearest: str) -> None:
    with pytest.raises(ValueError) as err:
        compat.check_sequence_length(seq, cp=cp, name="--seq-len")
    assert str(err.value) == (
        f"--seq-len {seq} must be a positive multiple of 2*CP = {2 * cp} (CP {cp}) for Megatron's zig-zag layout, "
        f"which cuts each sequence into {2 * cp} chunks; the nearest valid lengths are {nearest}"
    )
    compat.check_sequence_length(2 * cp * 3, cp=cp)  # a multiple passes


def test_refusals_before_megatron_is_called() -> None:
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cp_group is None; pass the CP group"):
        compat.batch_on_this_cp_rank({"tokens": ids}, cp_group=None)
    with pytest.raises(
        ValueError, match=r"batch holds \['cu_seqlens'\]: megatron-core's metadata .* thd_batch_on_this_cp_rank"
    ):
        compat.batch_on_this_cp_rank({"tokens": ids, "cu_seqlens": torch.tensor([0, 8])}, cp_group=object())
    one_rank = type("OneRank", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    plain = {"tokens": ids, "cu_seqlens": None, "max_seqlen": None}  # metadata keys holding None: not a THD batch
    assert compat.batch_on_this_cp_rank(plain, cp_group=one_rank)["tokens"] is ids
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"THD batch keys \['attention_mask'\] are not partitioned by every"):
        compat.thd_batch_on_this_cp_rank(
            {"tokens": ids, "attention_mask": ids}, cu_seqlens=bounds, cu_seqlens_padded=bounds, max_seqlen=8,
            cp_group=object(),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"cu_seqlens \(1, 2\) and cu_seqlens_padded \(2,\) must be 1-D"):
        compat.thd_batch_on_this_cp_rank(
            {"tokens": ids}, cu_seqlens=bounds[None], cu_seqlens_padded=bounds, max_seqlen=8, cp_group=object()
        )
