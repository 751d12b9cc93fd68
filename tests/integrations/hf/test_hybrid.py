"""Hybrid models (attention beside Gated DeltaNet, KDA, lightning attention, Mamba 1/2, short convolutions) through
``hf.attach`` on 4 gloo ranks: every family exact against the stock single-process model, or refused by name.

Exact means: this rank's logits, the loss and every parameter gradient (summed over the CP group) within 1e-5 of
the stock model in fp32, at tiles 2x2 and 1x4, and with packed rows and left padding (the reference: the stock
model on each document alone). Refused: a mixer whose heads do not split over the 4 ranks, generation (recurrent
caches are not sharded), keywords a mixer does not take. The families come from the ``cases_*`` modules of
``tests/integrations/hf/hybrid``; one spawned group of 4 ranks runs them all.
"""

from __future__ import annotations

import copy
import importlib
import pathlib
import re

import pytest
import torch

pytest.importorskip("transformers")

import mesh_cp  # noqa: E402
from mesh_cp.testing import spawn_gloo  # noqa: E402
from mesh_cp.testing.models import VOCAB  # noqa: E402

TOL = 1e-5
SEQ = 32
WORLD = 4
DOCUMENTS = [[12, 14], [5, 17, 10]]
"""Packed rows: document lengths per row (row 0 ends in 6 tokens of padding)."""
LEFT_PAD = 6
"""Left padding of the padded case's second row."""

FAMILIES = (
    "qwen3_next",
    "qwen3_5",
    "kimi_linear",
    "minimax",
    "nemotron_h",
    "granitemoehybrid",
    "bamba",
    "falcon_h1",
    "zamba2",
    "jamba",
    "lfm2",
)
"""The eleven families the suite must run (more may be in the cases modules)."""


def _case_modules() -> list:
    folder = pathlib.Path(__file__).parent / "hybrid"
    return [
        importlib.import_module(f"tests.integrations.hf.hybrid.{p.stem}") for p in sorted(folder.glob("cases_*.py"))
    ]


def _cases(kind: str) -> dict:
    """Case name -> config over the ``cases_*`` modules; a name two modules give different configs is an error."""
    out: dict = {}
    for module in _case_modules():
        for name, config in getattr(module, kind, dict)().items():
            if name in out and out[name].to_dict() != config.to_dict():
                raise AssertionError(f"case {name!r} of {module.__name__} replaces another module's")
            out[name] = config
    return out


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


INIT = 0.1
"""Weights' init range (unless a case sets another): at transformers' 0.02 a mixer's share of the logits is so small
that a wrong channel moves them by less than the tolerance."""


def _stock(config):
    from transformers import AutoModelForCausalLM

    if "initializer_range" not in config.to_diff_dict():
        config = copy.deepcopy(config)
        config.initializer_range = INIT

    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def _reference(ref, ids: torch.Tensor, spans: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The stock model on each document alone: logits placed at the documents' positions (zeros elsewhere), the
    summed next-token loss over the documents divided by their label count, and that count."""
    logits = torch.zeros(*ids.shape, VOCAB)
    total, count = 0.0, 0
    for row, row_spans in enumerate(spans):
        for start, stop in row_spans:
            doc = ids[row : row + 1, start:stop]
            out = ref(input_ids=doc, use_cache=False).logits
            logits[row, start:stop] = out[0]
            total = total + torch.nn.functional.cross_entropy(out[0, :-1], doc[0, 1:], reduction="sum")
            count += stop - start - 1
    (total / count).backward()
    return logits.detach(), (total / count).detach(), count


def run_case(config, mesh, rows: str, checkpointing: bool = False) -> str:
    """``"exact"`` or what differs. ``rows``: ``"plain"`` (whole rows), ``"packed"`` (:data:`DOCUMENTS`) or
    ``"padded"`` (right padding in row 0, :data:`LEFT_PAD` tokens of left padding in row 1); ``checkpointing``:
    with transformers' gradient checkpointing."""
    import torch.distributed as dist

    from mesh_cp.integrations import hf

    ref = _stock(config)
    model = copy.deepcopy(ref)
    if checkpointing:  # layers run again in backward: a mixer not handed the mask reads the forward's
        model.activation_checkpointing_enable()
        model.train()
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    if rows == "plain":
        spans = [[(0, SEQ)], [(0, SEQ)]]
        shard = {}
    elif rows == "packed":
        spans = [
            [(s - n, s) for n, s in zip(r, [sum(r[: i + 1]) for i in range(len(r))], strict=True)] for r in DOCUMENTS
        ]
        shard = {"documents": DOCUMENTS}
    else:
        spans = [[(0, SEQ - 5)], [(LEFT_PAD, SEQ)]]
        mask = torch.zeros(2, SEQ, dtype=torch.long)
        for row, ((start, stop),) in enumerate(spans):
            mask[row, start:stop] = 1
        shard = {"attention_mask": mask}
    logits, loss, count = _reference(ref, ids, spans)
    try:
        hf.attach(model, mesh)
        # gradients summed over the CP group; a parameter the stock model leaves unused keeps none here too
        ddp = hf.data_parallel(model, mesh=mesh, find_unused_parameters=True)
        batch = hf.shard_batch(ids, mesh=mesh, **shard)
        extra = {} if batch.mask is None else {"mesh_cp_mask": batch.mask}
        cache = {"use_cache": False} if rows != "plain" else {}  # plain rows: the model makes its own cache
        local = ddp(input_ids=batch.input_ids, position_ids=batch.position_ids, **cache, **extra).logits
        local_loss = hf.causal_lm_loss(local, batch.shift_labels, batch.num_items_in_batch)
        local_loss.backward()
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"raised {type(err).__name__}: {err}"
    summed = local_loss.detach().clone()
    dist.all_reduce(summed, group=mesh.group)
    real = torch.zeros(2, SEQ, 1)
    for row, row_spans in enumerate(spans):
        for start, stop in row_spans:
            real[row, start:stop] = 1
    shard_of = lambda t: mesh_cp.shard_sequence(t, mesh=mesh, dim=1, layout="zigzag")  # noqa: E731
    errors = {
        "logits": _max_err(local.detach() * shard_of(real), shard_of(logits)),
        "loss": _max_err(summed, loss),
        "label count": abs(int(batch.num_items_in_batch) - count),
    }
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return f"gradient of {name} is {'missing' if p.grad is None else 'unexpected'}"
        if p.grad is not None:
            errors[name] = _max_err(p.grad, q.grad)
    worst = max(errors, key=errors.get)
    dist.barrier(group=mesh.group)
    return "exact" if errors[worst] <= TOL else f"wrong: {worst} error {errors[worst]:.2e}"


def refusal(config, mesh, what: str) -> str:
    """The message of the refusal of ``what``: ``"heads"`` (attach over too many ranks), ``"generate"``,
    ``"keyword"`` (``cu_seq_lens_q`` given to the model)."""
    from mesh_cp.integrations import hf

    model = _stock(config)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    try:
        hf.attach(model, mesh)
        if what == "generate":
            hf.generate(model, ids, mesh=mesh, max_new_tokens=2, do_sample=False)
        elif what == "keyword":
            batch = hf.shard_batch(ids, mesh=mesh)
            cu = torch.tensor([0, SEQ // WORLD], dtype=torch.int32)
            model(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=cu, use_cache=False)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return "not refused"


KERNELS = {
    "bamba": (
        "transformers.models.bamba.modeling_bamba",
        "mamba2_chunk_scan",
        "mamba2_split_conv1d_scan_combined",
        # argument -> axis of heads (h) or groups (g)
        {0: ("h", 2), 1: ("h", 2), 2: ("h", 0), 3: ("g", 2), 4: ("g", 2), "D": ("h", 0), "dt_bias": ("h", 0)},
    ),
    **{
        family: (
            f"transformers.models.{family}.modeling_{family}",
            "torch_chunk_gated_delta_rule",
            None,
            {0: ("g", 2), 1: ("g", 2), 2: ("h", 2), "g": ("h", 2), "beta": ("h", 2)},
        )
        for family in ("qwen3_next", "qwen3_5", "olmo_hybrid")
    },
}
"""Family -> (its modeling module, the scan it calls, its fused kernel the core must not take, the scan's tensor
arguments with their head or group axis)."""


def kernel_arguments(family: str, config, mesh) -> str:
    """Where a GPU calls its kernel (fla, mamba_ssm) a rank's core calls the same function as the single process,
    with the single process's arguments restricted to the rank's heads (and their groups), over the whole sequence;
    the fused kernel (which folds in the norm and the output projection) is never called. Checked by recording the
    calls of the function transformers dispatches to."""
    import importlib

    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.hybrid import MIXER_KEYWORDS
    from mesh_cp.integrations.hf.mixer_spec import groups_of, share

    module_name, scan, fused, axes = KERNELS[family]
    module = importlib.import_module(module_name)
    calls: dict[str, list] = {"scan": [], "fused": []}
    original, original_fused = getattr(module, scan), getattr(module, fused) if fused else None

    def record(*args, **kwargs):
        calls["scan"].append((args, kwargs))
        return original(*args, **kwargs)

    def record_fused(*args, **kwargs):
        calls["fused"].append(1)
        return original_fused(*args, **kwargs)  # None on the CPU: the layer goes on unfused

    setattr(module, scan, record)
    if fused:
        setattr(module, fused, record_fused)
    try:
        ref = _stock(config)
        model = copy.deepcopy(ref)
        ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
        ref(input_ids=ids, use_cache=False)
        full, fused_full = calls["scan"][:], len(calls["fused"])
        calls["scan"].clear(), calls["fused"].clear()
        hf.attach(model, mesh)
        batch = hf.shard_batch(ids, mesh=mesh)
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    finally:
        setattr(module, scan, original)
        if fused:
            setattr(module, fused, original_fused)
    if len(calls["scan"]) != len(full) or calls["fused"] or not full or (fused and not fused_full):
        return f"calls: {len(calls['scan'])} scans (single process {len(full)}), {len(calls['fused'])} fused"
    layer = next(m for m in model.modules() if hasattr(m, "mesh_cp_mixer"))
    heads = getattr(layer, "num_heads", None) or layer.num_v_heads
    groups = getattr(layer, "n_groups", None) or layer.num_k_heads
    kept = {"h": share(heads, mesh.size, mesh.rank), "g": groups_of(groups, heads, mesh.size, mesh.rank)}
    for (args, kwargs), (ref_args, ref_kwargs) in zip(calls["scan"], full, strict=True):
        for key, (kind, axis) in axes.items():
            got = args[key] if isinstance(key, int) else kwargs[key]
            want = ref_args[key] if isinstance(key, int) else ref_kwargs[key]
            want = want.index_select(axis, torch.tensor(list(kept[kind])))
            if got.shape != want.shape or _max_err(got, want) > TOL:
                return f"argument {key}: got {tuple(got.shape)}, expected {tuple(want.shape)} (the heads' slice)"
        options = {k: v for k, v in ref_kwargs.items() if k not in MIXER_KEYWORDS and not isinstance(v, torch.Tensor)}
        if any(k not in kwargs or kwargs[k] != v for k, v in options.items()):
            return f"options {options} expected (keywords that ride along left out), got {kwargs}"
    return "exact"


def hybrid_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    meshes = {f"{a}x{b}": mesh_cp.CPMesh.create(dist.group.WORLD, tile=(a, b)) for a, b in ((2, 2), (1, 4))}
    out = {}
    for family, config in _cases("configs").items():
        for tile, mesh in meshes.items():
            out[f"{family} {tile}"] = run_case(config, mesh, "plain")
        out[f"{family} packed"] = run_case(config, meshes["2x2"], "packed")
        out[f"{family} padded"] = run_case(config, meshes["1x4"], "padded")
    for family in ("bamba", "jamba"):
        if family in _cases("configs"):
            out[f"{family} packed, checkpointed"] = run_case(_cases("configs")[family], meshes["2x2"], "packed", True)
    for family, config in _cases("too_few_heads").items():
        out[f"{family} too few heads"] = refusal(config, meshes["2x2"], "heads")
    for family in KERNELS:
        if family in _cases("configs"):
            out[f"{family} kernel arguments"] = kernel_arguments(family, _cases("configs")[family], meshes["2x2"])
    first = next(iter(_cases("configs").values()))
    out["generate"] = refusal(first, meshes["2x2"], "generate")
    out["keyword"] = refusal(first, meshes["2x2"], "keyword")
    return out


REFUSALS = {
    "too few heads": r"runs head-parallel over the CP group of 4 ranks, and its .* do not split over 4 ranks",
    "generate": r"generation with mesh_cp does not shard recurrent",
    "keyword": r"does not take 'cu_seq_lens_q'",
}


def test_hybrid_families_are_exact_or_refused_by_name() -> None:
    configs = _cases("configs")
    assert set(FAMILIES) <= set(configs), f"families without a case: {sorted(set(FAMILIES) - set(configs))}"
    assert _cases("too_few_heads"), "no case of a mixer whose heads do not split over the ranks"
    per_rank = spawn_gloo(hybrid_worker, WORLD)
    failures = []
    for name in per_rank[0]:
        got = sorted({res[name] for res in per_rank})
        pattern = next((p for key, p in REFUSALS.items() if name.endswith(key)), None)
        ok = all(re.search(pattern, g) for g in got) if pattern else got == ["exact"]
        if not ok:
            failures.append(f"{name:40} got {' | '.join(got)}")
    assert not failures, "hybrid outcomes differ from exact / refused by name:\n" + "\n".join(failures)


def test_unhandled_mixers_are_refused_by_name() -> None:
    """A mixer class without a spec, or a config naming non-attention layers with no handled layer, is refused."""
    from types import SimpleNamespace

    from mesh_cp.integrations.hf.mixers import SPECS
    from mesh_cp.integrations.hf.model_checks import refuse_other_sequence_mixers

    class RwkvBlock(torch.nn.Module):
        pass

    class Model(torch.nn.Module):
        def __init__(self, kinds):
            super().__init__()
            self.block = RwkvBlock()
            self.config = SimpleNamespace(layer_types=kinds)

    with pytest.raises(NotImplementedError, match=r"outside attention \(RwkvBlock\) in layers mesh_cp does not run"):
        refuse_other_sequence_mixers(Model(["full_attention"]), [], set(SPECS))
    plain = Model(["mamba", "full_attention"])
    plain.block = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match=r"config.layer_types \['mamba'\]"):
        refuse_other_sequence_mixers(plain, [plain], set(SPECS))


def test_exchange_bytes_and_the_plan_row() -> None:
    """The exchange's bytes per rank (P - 1 pieces of the rank's tokens, in and out), and `mesh-cp plan --mixer`."""
    import contextlib
    import io

    from mesh_cp.cli import main
    from mesh_cp.core.mixers import mixer_exchange_bytes

    assert (
        mixer_exchange_bytes(seq_local=4, channels_in=10, channels_out=6, world=4, itemsize=2, batch=3)
        == 3 * 4 * 16 * 2 * 3
    )
    with pytest.raises(ValueError, match="world"):
        mixer_exchange_bytes(seq_local=4, channels_in=1, channels_out=1, world=0, itemsize=2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(
            [
                "plan",
                "--world",
                "8",
                "--seq",
                "65536",
                "--heads",
                "16",
                "--kv-heads",
                "2",
                "--head-dim",
                "256",
                "--mixer",
                "gdn=1032,512",
            ]
        )
    row = next(line for line in out.getvalue().splitlines() if "gdn:" in line)
    expected = 2 * mixer_exchange_bytes(seq_local=8192, channels_in=1032, channels_out=512, world=8, itemsize=2)
    assert f"{expected / 2**20:.1f} MiB" in row, row
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        main(["plan", "--world", "8", "--seq", "64", "--heads", "4", "--head-dim", "8", "--mixer", "gdn=12"])
    assert "NAME=CIN,COUT" in err.getvalue()


def test_core_channels_of_a_grouped_layer() -> None:
    """Bamba's Mamba 2 with one group at P = 4: each rank reads its heads' x, dt and the group's B and C."""
    import transformers as tf

    from mesh_cp.integrations.hf.mixer_spec import core_channels
    from mesh_cp.integrations.hf.mixers import SPECS

    config = tf.BambaConfig(
        hidden_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        num_hidden_layers=2,
    )
    layer = tf.AutoModelForCausalLM.from_config(config).model.layers[0].mamba
    assert core_channels(layer, SPECS["BambaMixer"], 4) == (16 + 2 * 8 + 1, 16)
