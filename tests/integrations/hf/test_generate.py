"""Generation with a sequence-sharded cache (Note [Sharded generation]) against single-process generation.

One gloo group per P (2, 3, 4: the first P ranks of one spawned group of 4) runs
``mesh_cp.integrations.hf.generate`` on tiny Llama models, MHA and GQA, with a batch of 1 and a batch of 3 prompts
of different lengths (left-padded, none a multiple of the CP size): the logits of every generated step must equal
those of single-process ``model.generate`` with SDPA attention on the same prompts within 1e-5 (fp32), and the
greedy tokens must be identical, on every rank. Sampling with one seed on
every rank gives the tokens single-process sampling gives with that seed. A stopping criterion on rank 0 only stops
every rank at the same step, and a streamer on rank 0 receives the tokens.

The static cache (Note [Static shard cache]): ``prefill`` then ``model.generate`` on the left-padded batch gives
the same logits, with every layer's K/V storage at one address and one shape from the prefill to the last token,
the capacity the prompt's slots plus ``ceil(max_new_tokens / P)``, and one all-gather per layer and token of the
plan's bytes; a cache prefilled for fewer tokens raises on every rank, naming its capacity and the fix. In one
process, ranks' layers fed alike fill their slots in place, hold every new column once, and all refuse the same
column once the slots run out.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mesh_cp.testing import expect_error, spawn_gloo
from tests.group_sizes import by_group_size, size_results

TOL = 1e-5
NEW_TOKENS = 6
PROMPTS = {"batch 1": (11,), "batch 3": (9, 4, 14)}
"""Prompt lengths of each batch."""


def prompts(lengths: tuple[int, ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (pad id 0) and their attention mask."""
    gen = torch.Generator().manual_seed(sum(lengths))
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


class StopAfter:
    """A stopping criterion on one rank: stop every row once ``steps`` tokens were generated."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= self.steps, dtype=torch.bool)


class Recorder:
    """A streamer that records what it is given."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.calls.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def run(group, rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.testing.models import VOCAB, tiny_causal_lms

    results: dict = {}
    mesh = mesh_cp.CPMesh.create(group, tile=(1, world))
    for name in ("llama", "llama-gqa"):
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(tiny_causal_lms()[name], attn_implementation="sdpa").eval()
        model = hf.attach(copy.deepcopy(reference), mesh)
        for label, lengths in PROMPTS.items():
            ids, mask = prompts(lengths, VOCAB)
            options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
            want = reference.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **options)
            got = hf.generate(model, ids, mask, mesh=mesh, pad_token_id=0, **options)
            case = f"{name} {label}"
            results[f"{case} logits"] = max(
                (a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True)
            )
            results[f"{case} steps"] = (len(got.logits), len(want.logits))
            results[f"{case} tokens"] = torch.equal(got.sequences, want.sequences)
        # Sampling: one seed on every rank gives single-process sampling's tokens.
        ids, mask = prompts(PROMPTS["batch 3"], VOCAB)
        torch.manual_seed(7)
        want = reference.generate(
            input_ids=ids, attention_mask=mask, pad_token_id=0, do_sample=True, max_new_tokens=NEW_TOKENS
        )
        torch.manual_seed(7)
        got = hf.generate(model, ids, mask, mesh=mesh, pad_token_id=0, do_sample=True, max_new_tokens=NEW_TOKENS)
        results[f"{name} sampled tokens"] = torch.equal(got, want)
    # Rank 0 alone stops after 2 tokens and streams: every rank stops there.
    stop = StoppingCriteriaList([StopAfter(ids.shape[1], 2)] if rank == 0 else [])
    streamer = Recorder()
    got = hf.generate(
        model,
        ids,
        mask,
        mesh=mesh,
        pad_token_id=0,
        max_new_tokens=NEW_TOKENS,
        stopping_criteria=stop,
        streamer=streamer,
    )
    results["stopped at"] = got.shape[1] - ids.shape[1]
    results["streamed"] = (len(streamer.calls), streamer.ended)
    results["refusals"] = refusals(model, mesh, ids, mask)
    results["static cache"] = static_cache(model, reference, mesh)
    return results


class StorageProbe:
    """A stopping criterion that never stops and records, at every step, each layer's K/V storage (address and
    shape) and filled slots."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.steps = [self.read()]

    def read(self) -> list[tuple]:
        return [(ly.keys.data_ptr(), ly.values.data_ptr(), tuple(ly.keys.shape), ly.length) for ly in self.cache.layers]

    def __call__(self, input_ids, scores, **kwargs):
        self.steps.append(self.read())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def static_cache(model, reference, mesh) -> dict:
    """The last model of :func:`run` (GQA) on the left-padded batch: prefill, then ``model.generate`` with the
    cache, probed and counted."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from mesh_cp.core import DecodeShape
    from mesh_cp.debug import CommCounter
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.compat import cache_keyword
    from mesh_cp.kernels.base import round_up
    from mesh_cp.runtime.decode import reduction_groups
    from mesh_cp.testing.models import VOCAB

    ids, mask = prompts(PROMPTS["batch 3"], VOCAB)
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = reference.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **options)
    cache = hf.prefill(model, ids, mask, mesh=mesh, max_new_tokens=NEW_TOKENS)
    prompt_slots = cache.layers[0].length
    probe = StorageProbe(cache)
    with CommCounter() as counter:
        got = model.generate(
            input_ids=ids, attention_mask=mask, pad_token_id=0, **{cache_keyword(model): cache},
            stopping_criteria=StoppingCriteriaList([probe]), **options,
        )  # fmt: skip
    config = model.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    shape = DecodeShape(len(ids), 1, heads, config.num_key_value_heads, dim, 0, 4)
    calls = config.num_hidden_layers * NEW_TOKENS
    results: dict = {
        "logits": max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True)),
        "tokens": torch.equal(got.sequences, want.sequences),
        "storages": {tuple(step[i][:3] for step in probe.steps) == (probe.steps[0][i][:3],) * len(probe.steps)
                     for i in range(len(cache.layers))},
        "capacity": (probe.steps[0][0][2][2], round_up(prompt_slots + -(-NEW_TOKENS // mesh.size), 256)),
        "filled": probe.steps[-1][0][3] - prompt_slots,
        "prefix": [prefix_layout(layer) for layer in cache.layers],
        "collectives": ({r.op for r in counter.records}, len(counter.records), calls),
        "bytes": (counter.bytes_sent(), calls * reduction_groups(mesh)[1].bytes_sent(shape)),
    }  # fmt: skip
    small = hf.prefill(model, ids, mask, mesh=mesh, max_new_tokens=2)
    expect_error(
        results, "overflow", ValueError,
        rf"holds {-(-2 // mesh.size)} new columns per rank \(max_new_tokens=2 over {mesh.size} ranks\).*prefill with a "
        "larger",
        lambda: model.generate(input_ids=ids, attention_mask=mask, **{cache_keyword(model): small}, **options),
    )  # fmt: skip
    other = hf.prefill(model, ids, mask, mesh=mesh, max_new_tokens=NEW_TOKENS)
    expect_error(
        results, "other mask", ValueError, r"prefill's masks padding .*: prefill and generate with the same attention_mask",
        lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(mask), **{cache_keyword(model): other},
                               **options),
    )  # fmt: skip
    return results


def prefix_layout(layer) -> bool:
    """Each row's entries are its first ``lengths[b]`` slots (columns >= 0 there, -1 after), each column held once,
    and the row's entries are the prompt's real tokens and the new columns: no padding slot."""
    columns, lengths = layer.columns, layer.lengths.long()
    slots = torch.arange(columns.shape[1])
    return bool(((columns >= 0) == (slots < lengths[:, None])).all())


def refusals(model, mesh, ids, mask) -> dict:
    from transformers import DynamicCache, GenerationConfig

    from mesh_cp.integrations import hf

    results: dict = {}
    expect_error(
        results, "beams", NotImplementedError, r"\{'num_beams': 2\} not supported with a sharded cache",
        lambda: hf.generate(model, ids, mask, mesh=mesh, num_beams=2, max_new_tokens=2),
    )  # fmt: skip
    expect_error(
        results, "right padding", ValueError, r"attention_mask must pad on the left only",
        lambda: hf.generate(model, ids, mask.flip(1), mesh=mesh, max_new_tokens=2),
    )  # fmt: skip
    expect_error(
        results, "other cache", NotImplementedError, r"not supported with a sharded cache",
        lambda: hf.generate(model, ids, mask, mesh=mesh, past_key_values=DynamicCache(), max_new_tokens=2),
    )  # fmt: skip
    expect_error(
        results, "model.generate", NotImplementedError, r"called with a DynamicCache: with mesh_cp attention, generate",
        lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2),
    )  # fmt: skip
    expect_error(
        results, "beams in a config", NotImplementedError, r"\{'num_beams': 2\} not supported with a sharded cache",
        lambda: hf.generate(model, ids, mask, mesh=mesh, generation_config=GenerationConfig(num_beams=2)),
    )  # fmt: skip
    expect_error(
        results, "attention weights", NotImplementedError, r"does not take \['output_attentions'\]",
        lambda: hf.generate(model, ids, mask, mesh=mesh, max_new_tokens=2, output_attentions=True,
                            return_dict_in_generate=True),
    )  # fmt: skip
    torch.manual_seed(dist.get_rank())
    expect_error(
        results, "seeds", ValueError, r"same random generator state on every rank",
        lambda: hf.generate(model, ids, mask, mesh=mesh, do_sample=True, max_new_tokens=2),
    )  # fmt: skip
    model.generation_config.do_sample = True  # as many hub checkpoints set it
    try:
        expect_error(
            results, "seeds, sampling from the model's config", ValueError, r"same random generator state",
            lambda: hf.generate(model, ids, mask, mesh=mesh, max_new_tokens=2),
        )  # fmt: skip
    finally:
        model.generation_config.do_sample = False
    return results


WORLDS = (2, 3, 4)


def worker(rank: int, world: int) -> dict[int, dict]:
    return by_group_size(WORLDS, run, rank, world)


@pytest.fixture(scope="module")
def spawned() -> list[dict[int, dict]]:
    """One spawned group of 4 ranks; P = 2 and 3 run on its first P ranks."""
    return spawn_gloo(worker, max(WORLDS))


@pytest.fixture(scope="module", params=WORLDS)
def results(request, spawned) -> list[dict]:
    return size_results(spawned, request.param)


def test_generate_equals_single_process(results) -> None:
    for rank, result in enumerate(results):
        for name in ("llama", "llama-gqa"):
            for label in PROMPTS:
                case = f"{name} {label}"
                assert result[f"{case} steps"] == (NEW_TOKENS, NEW_TOKENS), (rank, case, result)
                assert result[f"{case} logits"] <= TOL, (rank, case, result[f"{case} logits"])
                assert result[f"{case} tokens"] is True, (rank, case)
            assert result[f"{name} sampled tokens"] is True, (rank, name)


def test_rank_zero_stopping_and_streaming(results) -> None:
    for rank, result in enumerate(results):
        assert result["stopped at"] == 2, (rank, result["stopped at"])
        calls, ended = result["streamed"]
        # The streamer gets the prompt, then one call per new token, on rank 0 only.
        assert (calls, ended) == ((3, True) if rank == 0 else (0, False)), (rank, calls, ended)


def test_refusals(results) -> None:
    for result in results:
        refused = result["refusals"]
        assert len(refused) == 8 and all(v is True for v in refused.values()), refused


def test_static_cache_in_place_one_collective_and_overflow(results) -> None:
    world = len(results)
    for rank, result in enumerate(results):
        got = result["static cache"]
        assert got["logits"] <= TOL and got["tokens"] is True, (rank, got)
        assert got["storages"] == {True}, (rank, got)  # one address and shape per layer, every step
        capacity, want = got["capacity"]
        assert capacity == want, (rank, got)
        # Columns d = 0 .. NEW_TOKENS - 1 of the decode, rank r owning d % P == r.
        assert got["filled"] == len(range(rank, NEW_TOKENS, world)), (rank, got)
        ops, count, calls = got["collectives"]
        assert ops == {"all_gather"} and count == calls, (rank, got)  # one per layer and token
        assert got["bytes"][0] == got["bytes"][1], (rank, got)
        assert got["overflow"] is True, (rank, got["overflow"])
        assert got["other mask"] is True, (rank, got["other mask"])
        assert got["prefix"] == [True] * len(got["prefix"]), (rank, got["prefix"])


def test_shard_layers_fill_in_place_and_refuse_the_same_column() -> None:
    from mesh_cp.integrations.hf.shard_cache import ShardedLayer

    world, prompt, budget, batch, heads, dim = 3, 5, 6, 2, 2, 4
    layers = [ShardedLayer(rank, world) for rank in range(world)]
    for rank, layer in enumerate(layers):  # two prompt columns each; rank 0 holds a padding slot (-1), row 1 pads 0
        columns = torch.tensor([[0, 5], [1, 4], [2, 3]][rank]) if rank else torch.tensor([-1, 0])
        seen = (columns >= 0) & (columns[None] != torch.tensor([[-2], [0]]))
        layer.prefill_columns, layer.prefill_seen, layer.prefill_length = columns, seen, prompt
        layer.max_new_tokens = budget
        layer.update(*(columns.float()[None, None, :, None].expand(batch, heads, 2, dim) for _ in "kv"))
    where = [(ly.keys.data_ptr(), ly.values.data_ptr(), ly.columns.data_ptr()) for ly in layers]
    seen = prompt
    for new in (1, 3, 2):  # budget columns in all
        keys = torch.arange(seen, seen + new, dtype=torch.float32)[None, None, :, None].expand(batch, heads, -1, dim)
        for layer in layers:
            out_k, out_v = layer.update(keys, -keys)
            assert out_k is layer.keys and tuple(out_k.shape) == (batch, heads, 256, dim)
        seen += new
    assert [(ly.keys.data_ptr(), ly.values.data_ptr(), ly.columns.data_ptr()) for ly in layers] == where
    for row, skipped in ((0, set()), (1, {0})):  # every column the row sees, once, at the front of some shard
        held = sorted(c for ly in layers for c in ly.columns[row, : int(ly.lengths[row])].tolist())
        assert held == sorted(set(range(prompt + budget)) - skipped), (row, held)
    for layer in layers:
        for row in range(batch):
            length = int(layer.lengths[row])
            filled = layer.columns[row, :length].float()
            assert (layer.columns[row, length:] == -1).all()
            assert torch.equal(layer.keys[row, 0, :length, 0], filled), (row, layer.keys[row, 0, :length, 0])
            new = filled >= prompt
            assert torch.equal(layer.values[row, 1, :length, 0][new], -filled[new])
    for layer in layers:  # the next column fits no longer on rank 0: every rank refuses it
        with pytest.raises(ValueError, match=r"holds 2 new columns per rank \(max_new_tokens=6 over 3 ranks\)"):
            layer.update(keys[:, :, :1], keys[:, :, :1])


def test_the_steps_mask_must_be_the_prompts_then_ones() -> None:
    """The lengths form applies the prompt's padding, then every new column (Note [Static shard cache]): a first
    step's mask that differs from the prefill's raises then, a step that drops a new column raises when read."""
    from types import SimpleNamespace

    from mesh_cp.integrations.hf.shard_cache import ShardedKVCache

    prompt = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    mesh = SimpleNamespace(rank=0, size=1)
    ones = torch.ones(2, 1, dtype=torch.long)
    cache = ShardedKVCache(mesh, 1, prompt_mask=prompt)
    cache.check_mask(torch.cat([prompt.long(), ones], 1))
    cache.check_mask(torch.cat([prompt.long(), ones, ones], 1))
    cache.raise_if_mask_dropped()  # nothing dropped
    cache.check_mask(torch.cat([prompt.long(), ones, ones, torch.tensor([[1], [0]])], 1))
    with pytest.raises(ValueError, match=r"dropped a generated column or changed the prompt's"):
        cache.raise_if_mask_dropped()
    later = ShardedKVCache(mesh, 1, prompt_mask=prompt)  # a later step that unmasks a padded prompt column
    later.check_mask(torch.cat([prompt.long(), ones], 1))
    later.check_mask(torch.cat([torch.ones_like(prompt, dtype=torch.long), ones, ones], 1))
    with pytest.raises(ValueError, match=r"changed the prompt's"):
        later.raise_if_mask_dropped()
    for padding in (torch.ones(2, 4, dtype=torch.long), torch.cat([prompt.long(), 1 - ones], 1)):
        with pytest.raises(ValueError, match=r"must be the prompt's mask that prefill was given, then ones"):
            ShardedKVCache(mesh, 1, prompt_mask=prompt).check_mask(padding)
    with pytest.raises(ValueError, match=r"without an attention mask, but prefill's masks padding"):
        ShardedKVCache(mesh, 1, prompt_mask=prompt).check_mask(None)
    unpadded = ShardedKVCache(mesh, 1, prompt_mask=torch.ones(2, 3, dtype=torch.bool))
    unpadded.check_mask(None)
    assert unpadded.mask_checked and unpadded.mask_kept is None
    several = ShardedKVCache(mesh, 1, prompt_mask=prompt)  # a step of 3 new columns, one dropped, then one of 1
    with pytest.raises(ValueError, match=r"then ones"):
        several.check_mask(torch.cat([prompt.long(), ones, 1 - ones, ones], 1))


@pytest.mark.parametrize(
    "call, model_config",
    [
        ({}, {}),  # nothing set anywhere: transformers' 20 new tokens
        ({}, {"max_new_tokens": 5}),
        ({"max_length": 14}, {"max_new_tokens": 5}),  # the call's max_length, the model's max_new_tokens wins
        ({"config": {"max_length": 17}}, {}),
        ({"config": {"max_length": 17}}, {"max_new_tokens": 4}),  # a passed config's empty fields: the model's
        ({"config": {"max_new_tokens": 3}}, {"max_new_tokens": 9}),
        ({"max_new_tokens": 7, "config": {"max_new_tokens": 3}}, {}),
    ],
)
def test_the_cache_is_sized_for_what_generate_makes(call, model_config) -> None:
    """``new_token_budget`` equals the tokens single-process ``model.generate`` makes with the same options."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mesh_cp.integrations.hf.generation import new_token_budget
    from mesh_cp.testing.models import VOCAB, tiny_causal_lms

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lms()["llama"], attn_implementation="sdpa").eval()
    model.generation_config.update(eos_token_id=None, pad_token_id=0, **model_config)
    options = {k: v for k, v in call.items() if k != "config"}
    if "config" in call:
        options["generation_config"] = GenerationConfig(**call["config"])
    ids, mask = prompts((6, 9), VOCAB)
    made = model.generate(input_ids=ids, attention_mask=mask, **options).shape[1] - ids.shape[1]
    assert new_token_budget(model, ids.shape[1], options) == made, (call, model_config, made)
