"""A Megatron Mamba hybrid stack with Mesh-Attention in its attention layers (``integrations/megatron/hybrid.py``).

The composition (Note [Mamba CP beside the mesh]): megatron-core's Mamba CP (``MambaContextParallel``) gathers the
CP ranks' shards in CP-rank order and undoes the zig-zag with ``_undo_attention_load_balancing``. Here, on the CPU,
the shards mesh_cp's Megatron integration cuts (``training.shard_batch``; THD rows: ``compat.thd_batch_on_this_cp_rank``)
are put through megatron-core's own functions: the undo gives positions ``0..S-1`` and the redo inverts it, for CP 2,
4 and 8, for every head-parallel mesh (``CPMesh.local_ranges`` whatever ``head_parallel``), and through
``pre_conv_ssm`` / ``post_conv_ssm`` with the CP ranks as threads exchanging by all-to-all. A packed row sharded as one
zig-zag sequence is not what the Mamba layers undo, and is refused. The spec is checked as a ``ModuleSpec`` tree, with
nothing constructed (megatron's ``MambaMixer`` allocates on CUDA)."""

from __future__ import annotations

import inspect
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron.core.utils as megatron_utils  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.ssm import mamba_context_parallel as mamba_cp  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules  # noqa: E402
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules  # noqa: E402
from megatron.core.transformer import attention as megatron_attention  # noqa: E402
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

import mesh_cp  # noqa: E402
from mesh_cp.core.layout import local_positions  # noqa: E402
from mesh_cp.core.split import thd_partitioned_indices  # noqa: E402
from mesh_cp.core.tiling import Tiling, factorizations  # noqa: E402
from mesh_cp.integrations.megatron import compat, training  # noqa: E402
from mesh_cp.integrations.megatron.attention import MeshCoreAttention, MeshProvider  # noqa: E402
from mesh_cp.integrations.megatron.hybrid import (  # noqa: E402
    HybridMeshCoreAttention,
    check_packed_for_mamba,
    get_mamba_stack_mesh_spec,
)
from mesh_cp.runtime.heads import _mesh_order  # noqa: E402
from mesh_cp.runtime.mesh import CPMesh  # noqa: E402

WORLDS = (2, 4, 8)
BATCH = 2


class _Threads:
    """``size`` CP ranks run as threads of this process; :meth:`all_to_all` is megatron-core's equal-split
    ``all_to_all`` among them (piece ``j`` of every rank's input to rank ``j``, received in rank order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._sent: list = [None] * size

    def all_to_all(self, group: _Rank, x: torch.Tensor) -> torch.Tensor:
        self._sent[group.rank()] = x.chunk(self.size, dim=0)
        self._barrier.wait()
        out = torch.cat([self._sent[i][group.rank()] for i in range(self.size)])
        self._barrier.wait()  # every rank has read before the next exchange writes
        return out

    def run(self, work) -> list:
        """``work(rank)`` on every rank at once; the results in rank order (the first error raised)."""
        results, errors = [None] * self.size, []

        def target(rank: int) -> None:
            try:
                results[rank] = work(_Rank(self, rank))
            except BaseException as error:  # noqa: BLE001  (re-raised below)
                errors.append(error)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class _Rank:
    """A CP rank as megatron-core reads a process group: ``size()`` and ``rank()``."""

    def __init__(self, world: _Threads | int, rank: int) -> None:
        self.world, self._rank = world, rank

    def size(self) -> int:
        return self.world if isinstance(self.world, int) else self.world.size

    def rank(self) -> int:
        return self._rank


def _thd_indices(cu_seqlens_padded: torch.Tensor, total, world: int, rank: int) -> torch.Tensor:
    """TransformerEngine's ``thd_get_partitioned_indices`` (CUDA) on the host (mesh_cp's transcription of its kernel,
    checked against it in tests/core/test_split.py)."""
    found = thd_partitioned_indices(cu_seqlens_padded.tolist(), int(total), world, rank)
    return torch.tensor(found, dtype=torch.int32, device=cu_seqlens_padded.device)


@pytest.fixture
def cpu_te(monkeypatch):
    """TransformerEngine's THD partition on the host, for Megatron's THD sharding and Mamba's undo and redo."""
    tex = SimpleNamespace(thd_get_partitioned_indices=_thd_indices)
    for module in (megatron_utils, mamba_cp):
        monkeypatch.setattr(module, "tex", tex)
        monkeypatch.setattr(module, "is_te_min_version", lambda version, check_equality=True: True)


@pytest.fixture
def fake_dist(monkeypatch):
    """``torch.distributed`` reads as initialized, so megatron-core takes a fake CP group's ``size()`` and
    ``rank()`` (``get_pg_size`` answers 1 otherwise)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)


def _zigzag_shards(seq: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Every CP rank's batch from ``training.shard_batch`` of rows ``1000 * row + 0..seq`` (token = its position)."""
    window = torch.arange(seq + 1).repeat(BATCH, 1) + 1000 * torch.arange(BATCH)[:, None]
    return [training.shard_batch(window, cp_group=_Rank(world, rank)) for rank in range(world)]


def _thd_row(world: int) -> tuple[list[int], list[int]]:
    """Document bounds of a THD row over ``world`` CP ranks: real lengths 5, ``4 * world`` and 3, each padded to a
    multiple of ``2 * world``."""
    lengths = [5, 4 * world, 3]
    padded = [-(-n // (2 * world)) * 2 * world for n in lengths]
    bounds = lambda sizes: [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # noqa: E731
    return bounds(lengths), bounds(padded)


def _thd_shards(world: int) -> tuple[list[dict[str, torch.Tensor]], PackedSeqParams]:
    """Every CP rank's share of one THD row from ``compat.thd_batch_on_this_cp_rank`` (token = its position)."""
    real, padded = (torch.tensor(b, dtype=torch.int32) for b in _thd_row(world))
    total = int(padded[-1])
    row = {"tokens": torch.arange(total)[None], "position_ids": torch.arange(total)[None]}
    shards = []
    for rank in range(world):
        shard, params = compat.thd_batch_on_this_cp_rank(
            row, cu_seqlens=real, cu_seqlens_padded=padded, max_seqlen=total, cp_group=_Rank(world, rank)
        )
        shards.append(shard)
    return shards, params


def _gathered(shards: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The CP ranks' tokens ``[seq, batch, 1]`` in CP-rank order: the sequence Mamba's all-to-all leaves."""
    return torch.cat([shard["tokens"] for shard in shards], dim=1).T.unsqueeze(-1)


@pytest.mark.parametrize("world", WORLDS)
def test_mamba_undoes_the_zigzag_shards_of_shard_batch(world: int, fake_dist) -> None:
    seq = 2 * world * 3
    shards = _zigzag_shards(seq, world)
    for rank, shard in enumerate(shards):
        assert shard["position_ids"][0].tolist() == local_positions(seq, world, rank, "zigzag")
    gathered = _gathered(shards)
    undone = mamba_cp._undo_attention_load_balancing(gathered, world)
    rows = torch.arange(seq)[None] + 1000 * torch.arange(BATCH)[:, None]
    assert torch.equal(undone[..., 0].T, rows)
    assert torch.equal(mamba_cp._redo_attention_load_balancing(undone, world), gathered)


@pytest.mark.parametrize("world", WORLDS)
def test_head_parallel_meshes_hold_the_same_tokens(world: int, fake_dist) -> None:
    """Every head-parallel mesh of ``world`` CP ranks (``u`` dividing it, every tile of ``world / u``) holds the
    shards of ``shard_batch`` (its ``local_ranges`` and ``mesh_cp.position_ids``; so Mamba's undo gives
    ``0..S-1``), and its head exchange reads them as the zig-zag of the ``world / u`` mesh ranks (Note
    [Head-parallel x mesh])."""
    seq = 2 * world * 3
    shards = [shard["position_ids"][0].tolist() for shard in _zigzag_shards(seq, world)]
    undone = mamba_cp._undo_attention_load_balancing(torch.tensor(sum(shards, []))[:, None, None], world)
    assert undone.flatten().tolist() == list(range(seq))
    meshes = 0
    for u in (d for d in range(1, world + 1) if world % d == 0):
        m = world // u
        for a, b in factorizations(m):
            for rank in range(world):
                mesh = CPMesh(
                    group=None, tiling=Tiling(world=m, a=a, b=b), rank=rank, global_ranks=tuple(range(world)),
                    q_group=None, kv_group=None, check_group=None, head_parallel=u,
                )  # fmt: skip
                assert mesh.size == world
                assert [p for lo, hi in mesh.local_ranges(seq, "zigzag") for p in range(lo, hi)] == shards[rank]
                assert mesh_cp.position_ids(seq, mesh=mesh, layout="zigzag").tolist() == shards[rank]
            order, _ = _mesh_order(u, seq // world, "zigzag", torch.device("cpu"))
            for g in range(m):
                group = torch.tensor(sum(shards[g * u : (g + 1) * u], []))
                in_mesh_order = group if order is None else group[order]
                assert in_mesh_order.tolist() == local_positions(seq, m, g, "zigzag")
            meshes += 1
    assert meshes == sum(len(factorizations(world // u)) for u in range(1, world + 1) if world % u == 0)


@pytest.mark.parametrize("world", WORLDS)
def test_mamba_undoes_thd_shards(world: int, cpu_te) -> None:
    shards, params = _thd_shards(world)
    gathered = _gathered(shards)
    total = gathered.shape[0]
    undone = mamba_cp._undo_attention_load_balancing(gathered, world, params)
    assert undone.flatten().tolist() == list(range(total))
    assert torch.equal(mamba_cp._redo_attention_load_balancing(undone, world, params), gathered)


def _mamba_exchange(world: int, ngroups: int, shards: list[torch.Tensor], packed) -> None:
    """megatron-core's ``MambaContextParallel.pre_conv_ssm`` on every CP rank (threads) of in_proj outputs whose
    every channel holds ``t + S * (b + B * c)`` for token position ``t`` (from ``shards``), row ``b``, channel ``c``:
    each rank gets the whole sequence in order for its heads; ``post_conv_ssm`` gives each rank its shard back."""
    d_state, headdim, nheads = 2, 2, 2 * world
    d_inner = nheads * headdim
    conv_dim = d_inner + 2 * ngroups * d_state
    channels = 2 * d_inner + 2 * ngroups * d_state + nheads
    seq, batch = sum(len(positions) for positions in shards), len(shards[0][0])
    t = torch.arange(seq, dtype=torch.float64)[:, None, None]
    b = torch.arange(batch, dtype=torch.float64)[None, :, None]
    c = torch.arange(channels, dtype=torch.float64)[None, None, :]
    projected = t + seq * (b + batch * c)  # [seq, batch, channels]: the in_proj output of the whole sequence
    threads = _Threads(world)

    def work(group: _Rank) -> None:
        rank = group.rank()
        exchange = mamba_cp.MambaContextParallel(
            cp_group=group, d_inner_local_tp=d_inner, nheads_local_tp=nheads, ngroups_local_tp=ngroups,
            d_state=d_state, conv1d_cp1=torch.nn.Conv1d(conv_dim, conv_dim, 4, groups=conv_dim, padding=3),
            dt_bias_cp1=torch.zeros(nheads), A_log_cp1=torch.zeros(nheads), D_cp1=torch.zeros(nheads),
            D_has_hdim=False,
        )  # fmt: skip
        positions = shards[rank]  # [seq / world, batch]
        local = projected[positions, torch.arange(batch)[None, :]]
        whole = exchange.pre_conv_ssm(local, packed)  # [seq, batch, channels of this rank's heads]
        assert torch.equal(whole.remainder(seq), t.expand_as(whole)), f"rank {rank}: not in sequence order"
        assert torch.equal((whole // seq).remainder(batch), b.expand_as(whole)), f"rank {rank}: rows mixed"
        width = d_inner // world
        z = whole[..., :width]
        assert torch.equal(z // (seq * batch), torch.arange(rank * width, (rank + 1) * width).double().expand_as(z))
        assert torch.equal(exchange.post_conv_ssm(z, packed), local[..., :d_inner]), f"rank {rank}: not its shard"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mamba_cp, "all_to_all", lambda group, x: group.world.all_to_all(group, x))
        threads.run(work)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("groups", ["one group", "a group per rank"])
def test_megatrons_mamba_exchange_on_shard_batch_shards(world: int, groups: str, fake_dist) -> None:
    shards = [s["position_ids"].T for s in _zigzag_shards(2 * world * 3, world)]  # [seq / world, batch]
    _mamba_exchange(world, 1 if groups == "one group" else world, shards, None)


def test_megatrons_mamba_exchange_rejects_contiguous_shards(fake_dist) -> None:
    """The exchange check discriminates: contiguous shards (rank ``r`` holding ``r * S / P ..``) are not the order
    megatron-core's Mamba undoes."""
    world, seq = 4, 24
    shards = [torch.arange(r * seq // world, (r + 1) * seq // world)[:, None].expand(-1, BATCH) for r in range(world)]
    with pytest.raises(AssertionError, match="not in sequence order"):
        _mamba_exchange(world, 1, shards, None)


@pytest.mark.parametrize("world", WORLDS)
def test_megatrons_mamba_exchange_on_thd_shards(world: int, cpu_te) -> None:
    shards, params = _thd_shards(world)
    _mamba_exchange(world, 1, [s["position_ids"].T for s in shards], params)


def test_a_packed_row_sharded_as_one_sequence_is_not_mambas_layout_and_is_refused(fake_dist) -> None:
    """mesh_cp's ``qkv_format="sbhd"`` packed row is cut zig-zag as one sequence; with ``packed_seq_params`` Mamba
    undoes the THD partition of its documents instead, which differs as soon as there are two."""
    world, seq = 2, 12
    bounds = torch.tensor([0, 4, 12], dtype=torch.int32)
    sbhd = PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=seq, max_seqlen_kv=seq
    )
    gathered = _gathered(_zigzag_shards(seq, world))[:, :1]
    with pytest.MonkeyPatch.context() as patch:
        tex = SimpleNamespace(thd_get_partitioned_indices=_thd_indices)
        patch.setattr(mamba_cp, "tex", tex)
        patch.setattr(mamba_cp, "is_te_min_version", lambda version, check_equality=True: True)
        undone = mamba_cp._undo_attention_load_balancing(gathered, world, sbhd)
    assert undone.flatten().tolist() != list(range(seq))

    message = r"qkv_format='sbhd' under CP 2 in a Mamba hybrid: .* compat\.thd_batch_on_this_cp_rank"
    with pytest.raises(NotImplementedError, match=message):
        check_packed_for_mamba(sbhd, 2)
    with pytest.raises(NotImplementedError, match="qkv_format=None under CP 4"):
        check_packed_for_mamba(PackedSeqParams(cu_seqlens_q=bounds, cu_seqlens_kv=bounds), 4)
    check_packed_for_mamba(sbhd, 1)  # no CP: Mamba does not reorder
    check_packed_for_mamba(PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds), 2)
    check_packed_for_mamba(None, 8)
    layer = SimpleNamespace(mesh=SimpleNamespace(size=2))  # refused before the attention runs
    q = torch.zeros(6, 1, 2, 4)
    with pytest.raises(NotImplementedError, match=message):
        HybridMeshCoreAttention.forward(layer, q, q, q, None, packed_seq_params=sbhd)


class _AnyAttribute(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return object


@pytest.fixture(scope="module")
def mamba_specs():
    """megatron-core's ``mamba_layer_specs`` module. Its ``MambaMixer`` module imports Triton (for inference kernels
    only); where Triton is not installed (the CPU), a stand-in is in ``sys.modules`` for that import and removed
    after. Nothing is constructed."""
    name = "megatron.core.models.mamba.mamba_layer_specs"
    try:
        import triton  # noqa: F401
    except ImportError:
        stub, language = _AnyAttribute("triton"), _AnyAttribute("triton.language")
        stub.jit, stub.language = (lambda fn=None, **options: fn if fn is not None else (lambda f: f)), language
        saved = {key: sys.modules.get(key) for key in ("triton", "triton.language")}
        sys.modules.update({"triton": stub, "triton.language": language})
        try:
            __import__(name)
        except ImportError as error:
            pytest.skip(f"megatron-core's Mamba specs do not import here: {error}")
        finally:
            for key, module in saved.items():
                if module is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = module
    return sys.modules[name] if name in sys.modules else __import__(name, fromlist=["mamba_stack_spec"])


def _slots(spec: ModuleSpec):
    layer = spec.submodules.attention_layer
    return layer, layer.submodules.self_attention, spec.submodules.mamba_layer.submodules.mixer


def test_spec_swaps_core_attention_and_keeps_megatrons_mamba_layers(mamba_specs) -> None:
    from megatron.core.ssm.mamba_mixer import MambaMixer

    megatron_spec = mamba_specs.mamba_stack_spec
    megatron_core_attention = megatron_spec.submodules.attention_layer.submodules.self_attention.submodules
    before = megatron_core_attention.core_attention
    spec = get_mamba_stack_mesh_spec(tile=(1, 2), head_parallel=2, ranks_per_node=8)
    layer, attention, mixer = _slots(spec)
    core = attention.submodules.core_attention
    assert isinstance(core, ModuleSpec) and core.module is HybridMeshCoreAttention
    assert issubclass(core.module, MeshCoreAttention)
    provider = core.params["mesh_provider"]
    assert isinstance(provider, MeshProvider) and provider.mesh is None
    assert (provider.tile, provider.head_parallel, provider.ranks_per_node) == ((1, 2), 2, 8)
    assert spec.module is MambaStack and layer.module is TransformerLayer and attention.module is SelfAttention
    assert attention.params == {"attn_mask_type": AttnMaskType.causal}
    assert mixer.module is MambaMixer and spec.submodules.mamba_layer.module is MambaLayer
    # a copy: megatron's spec keeps its core attention; classes and functions are shared, containers are not
    assert megatron_core_attention.core_attention is before
    megatron_layer, megatron_attention_spec, megatron_mixer = _slots(megatron_spec)
    assert layer is not megatron_layer and attention.params is not megatron_attention_spec.params
    assert attention.submodules.linear_qkv is megatron_attention_spec.submodules.linear_qkv
    assert mixer is not megatron_mixer and mixer.submodules.in_proj is megatron_mixer.submodules.in_proj
    for other in ("mlp_layer", "moe_layer"):
        assert getattr(spec.submodules, other).module is getattr(megatron_spec.submodules, other).module
    pinned = SimpleNamespace(global_ranks=(0, 1))
    assert (
        _slots(get_mamba_stack_mesh_spec(mesh=pinned))[1].submodules.core_attention.params["mesh_provider"].mesh
        is pinned
    )


def test_core_attention_takes_what_megatrons_attention_hands_it() -> None:
    """megatron-core's protocols for a core attention (``CoreAttentionBuilder.__call__``, ``CoreAttention.forward``:
    what ``Attention`` passes in GPT and Mamba stacks alike) bind to the layer's signatures, with the spec's params."""
    build = inspect.signature(megatron_attention.CoreAttentionBuilder.__call__)
    given = {name: None for name in build.parameters if name != "self"}
    inspect.signature(HybridMeshCoreAttention.__init__).bind(None, **given, mesh_provider=MeshProvider())
    forward = inspect.signature(megatron_attention.CoreAttention.forward)
    positional = [p for p in forward.parameters.values() if p.kind is p.POSITIONAL_ONLY and p.name != "self"]
    keywords = {p.name: None for p in forward.parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert [p.name for p in positional] == ["query", "key", "value", "attention_mask"]
    assert set(keywords) == {"attn_mask_type", "attention_bias", "packed_seq_params"}
    for layer in (HybridMeshCoreAttention, MeshCoreAttention):
        inspect.signature(layer.forward).bind(None, *[None] * len(positional), **keywords)


def _stack(mixer=("megatron.core.ssm.mamba_mixer", "MambaMixer"), attention_layer=None, **others) -> ModuleSpec:
    """A Mamba stack spec of megatron's form (the mixer named by path: nothing imports Triton)."""
    if attention_layer is None:
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=IdentityOp, core_attention=IdentityOp, linear_proj=IdentityOp
            ),
        )
        attention_layer = ModuleSpec(
            module=TransformerLayer, submodules=TransformerLayerSubmodules(self_attention=attention)
        )
    mamba_layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(mixer=ModuleSpec(module=mixer)))
    submodules = MambaStackSubmodules(mamba_layer=mamba_layer, attention_layer=attention_layer, **others)
    return ModuleSpec(module=MambaStack, submodules=submodules)


def test_base_spec_is_copied_not_modified() -> None:
    base = _stack()
    spec = get_mamba_stack_mesh_spec(base_spec=base)
    assert _slots(base)[1].submodules.core_attention is IdentityOp
    assert _slots(spec)[1].submodules.core_attention.module is HybridMeshCoreAttention
    assert _slots(spec)[2].module == ("megatron.core.ssm.mamba_mixer", "MambaMixer")


@pytest.mark.parametrize(
    ("base", "message"),
    [
        (
            get_gpt_layer_local_spec(),
            r"no submodules\.attention_layer\.submodules\.self_attention\.submodules\.core_attention slot \(a GPT "
            r"layer spec: use get_gpt_layer_mesh_spec\); pass megatron\.core\.models\.mamba\.mamba_layer_specs",
        ),
        (_stack(attention_layer=IdentityOp), r"no submodules\.attention_layer\.submodules\.self_attention"),
        (
            _stack(mixer=IdentityOp),
            r"submodules\.mamba_layer\.submodules\.mixer is <class '.*IdentityOp'>, not a ModuleSpec of "
            r"megatron-core's MambaMixer",
        ),
        (
            _stack(mlp_layer=ModuleSpec(module=GatedDeltaNet)),
            r"holds GatedDeltaNet at submodules\.mlp_layer: megatron-core 0\.16's GatedDeltaNet has no context "
            r"parallelism",
        ),
        (
            _stack(mixer=("megatron.core.ssm.gated_delta_net", "GatedDeltaNet")),
            r"mixer is \('megatron\.core\.ssm\.gated_delta_net', 'GatedDeltaNet'\), not a ModuleSpec of",
        ),
    ],
    ids=["gpt layer", "no attention layer", "no mamba mixer", "gated deltanet", "gated deltanet mixer"],
)
def test_refuses_a_base_spec_without_the_slots(base, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_mamba_stack_mesh_spec(base_spec=base)
