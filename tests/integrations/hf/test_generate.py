"""Generation with a sequence-sharded cache (Note [Sharded generation]) against single-process generation.

One spawned group per P (2, 3, 4) runs ``mesh_cp.integrations.hf.generate`` on tiny Llama models, MHA and GQA, with
a batch of 1 and a batch of 3 prompts of different lengths (left-padded, none a multiple of the CP size): the
logits of every generated step must equal those of single-process ``model.generate`` with SDPA attention on the
same prompts within 1e-5 (fp32), and the greedy tokens must be identical, on every rank. Sampling with one seed on
every rank gives the tokens single-process sampling gives with that seed. A stopping criterion on rank 0 only stops
every rank at the same step, and a streamer on rank 0 receives the tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mesh_cp.testing import expect_error, spawn_gloo

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


def run(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    import mesh_cp
    from mesh_cp.integrations import hf
    from mesh_cp.testing.models import VOCAB, tiny_causal_lms

    results: dict = {}
    mesh = mesh_cp.CPMesh.create(dist.group.WORLD, tile=(1, world))
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
    return results


def refusals(model, mesh, ids, mask) -> dict:
    from transformers import DynamicCache

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
    torch.manual_seed(dist.get_rank())
    expect_error(
        results, "seeds", ValueError, r"same random generator state on every rank",
        lambda: hf.generate(model, ids, mask, mesh=mesh, do_sample=True, max_new_tokens=2),
    )  # fmt: skip
    return results


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request) -> list[dict]:
    return spawn_gloo(run, request.param)


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
        assert len(refused) == 5 and all(v is True for v in refused.values()), refused
