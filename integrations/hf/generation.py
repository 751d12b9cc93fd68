"""Generation with a sequence-sharded K/V cache: prefill under Mesh-Attention, decode with Tree Attention.

::

    out = hf.generate(model, input_ids, attention_mask=mask, mesh=mesh, max_new_tokens=64, do_sample=False)

Note [Sharded generation]
~~~~~~~~~~~~~~~~~~~~~~~~~
The prompts (right-aligned, padded on the left as transformers' generation expects) are cut at their last column:
every column before it is run through the model once, sharded along the sequence over the CP mesh as in training
(:func:`prefill`): each rank keeps the K/V of its zig-zag shard in a :class:`ShardedKVCache`, a transformers
``Cache`` whose layers hold that rank's entries and their column in the batch. ``model.generate`` then feeds the
last column and every new token to all ranks alike: each layer's new K/V go to one rank (columns dealt round-robin,
so the shards stay balanced), and attention over the cache is :func:`mesh_cp.decode_attn_func` (Note [Tree
decoding]): the queries see the entries whose column is at most theirs and that the batch's attention mask
keeps (padding), each rank over its shard, combined by one all-gather per mesh level. Every rank ends each step
with the same logits, so greedy search and sampling (the same seed on every rank) pick the same tokens everywhere.
:func:`generate` also makes every stopping decision the same on all ranks (any rank's stop stops all: a rank that
stopped alone would leave the others waiting in the all-gather) and hands a streamer to rank 0 only.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from mesh_cp.integrations.hf.compat import CACHE_KEYWORDS, cache_keyword
from mesh_cp.integrations.hf.masks import CacheMask
from mesh_cp.integrations.hf.shard_cache import ShardedKVCache
from mesh_cp.runtime.batch import shard_batch
from mesh_cp.runtime.decode import decode_attn_func
from mesh_cp.runtime.mesh import CPMesh
from mesh_cp.runtime.sharding import position_ids


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    modules = [m for m in model.modules() if hasattr(m, "mesh_cp_attached")]
    if not modules:
        raise ValueError("the model has no mesh_cp attention: call mesh_cp.integrations.hf.attach(model, mesh) first")
    return modules


def prefill(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    mesh: CPMesh,
    max_new_tokens: int | None = None,
) -> ShardedKVCache:
    """Run every column of the left-padded prompts ``input_ids (B, T)`` but the last through ``model`` sharded over
    ``mesh`` (Mesh-Attention, as in training) and return the :class:`ShardedKVCache` of this rank, ready for
    ``model.generate(input_ids, attention_mask=..., cache=cache)`` (``past_key_values=cache`` before transformers
    5.24). Collective over the mesh; every rank passes the same prompts. ``attention_mask`` (``B, T``, default all
    ones) must pad on the left only. ``max_new_tokens`` sizes the cache (Note [Static shard cache]): the most tokens
    the ``generate`` that follows may make (default: as ``model.generation_config`` sets it)."""
    modules = _attention_modules(model)
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be (batch, T) with T >= 2 (a prompt to prefill and its last token), got {tuple(input_ids.shape)}"
        )
    batch, width = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
    _check_left_padding(mask)
    length = width - 1
    multiple = mesh.seq_multiple("zigzag")
    extra = -length % multiple
    pad = input_ids.new_zeros(batch, extra)
    ids, keep = torch.cat([pad, input_ids[:, :length]], 1), torch.cat([pad, mask[:, :length]], 1)
    if not bool(keep.any(1).all()):  # a row whose only real token is its last: one dummy column it never sees
        keep[:, -1] = 1
    sharded = shard_batch(ids, mesh=mesh, attention_mask=keep, device=next(model.parameters()).device)
    columns = position_ids(length + extra, mesh=mesh, layout="zigzag", device=sharded.input_ids.device) - extra
    columns = torch.where(columns >= 0, columns, -1)
    # The entries each row sees: real prompt tokens, not the mesh's padding nor the row's own (Note [Static shard cache]).
    prompt = mask[:, :length].to(columns.device, torch.bool)
    seen = (columns >= 0) & prompt.gather(1, columns.clamp_min(0).expand(batch, -1))
    cache = ShardedKVCache(mesh, len(modules), prompt_mask=prompt)
    budget = new_token_budget(model, width, {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens})
    for layer in cache.layers:
        layer.prefill_columns, layer.prefill_seen, layer.prefill_length = columns, seen, length
        layer.max_new_tokens = budget
    for module in modules:
        module.mesh_cp_cache = cache
    # The prefill's logits are not used (generate runs the last column): keep one per row, not (B, S / P, vocab).
    keep_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        model(
            input_ids=sharded.input_ids, position_ids=sharded.position_ids, mesh_cp_mask=sharded.mask,
            **{cache_keyword(model): cache}, use_cache=True, **keep_logits,
        )  # fmt: skip
    if any(layer.seen != length for layer in cache.layers):
        raise ValueError(
            f"the model updated {sum(layer.seen == length for layer in cache.layers)} of {len(cache.layers)} cache layers"
        )
    return cache


def generation_option(model: torch.nn.Module, options: dict[str, Any], name: str) -> Any:
    """Option ``name`` as ``model.generate(**options)`` reads it (transformers' order): the call's keyword, else the
    ``generation_config`` it passes, else ``model.generation_config``; ``None`` where none sets it."""
    configs = (options.get("generation_config"), getattr(model, "generation_config", None))
    for value in (options.get(name), *(getattr(c, name, None) for c in configs if c is not None)):
        if value is not None:
            return value
    return None


DEFAULT_NEW_TOKENS = 20
"""What transformers' generate makes when neither ``max_new_tokens`` nor ``max_length`` is set anywhere."""


def new_token_budget(model: torch.nn.Module, width: int, options: dict[str, Any]) -> int:
    """The most tokens ``model.generate(**options)`` makes after prompts of ``width`` columns, as transformers reads
    it (:func:`generation_option`): ``max_new_tokens``, else ``max_length - width``, else 20 (at most up to the
    model's ``max_position_embeddings``)."""
    budget = generation_option(model, options, "max_new_tokens")
    if budget is None:
        total = generation_option(model, options, "max_length")
        if total is None:
            limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            total = width + DEFAULT_NEW_TOKENS if limit is None else min(width + DEFAULT_NEW_TOKENS, limit)
        budget = total - width
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(
            f"the ShardedKVCache is sized by the tokens generate will make: got {budget!r} for prompts of {width} "
            "columns (max_new_tokens, else max_length - width, of the call, its generation_config or the model's); "
            "pass max_new_tokens=N >= 1 to mesh_cp.integrations.hf.prefill or hf.generate"
        )
    return budget


def _check_left_padding(mask: Tensor) -> None:
    """Every row of ``mask`` is zeros, then ones, ending with a one (read on the host once per prefill)."""
    rows = mask.cpu()
    if not ((rows == 0) | (rows == 1)).all() or not bool((rows[:, 1:] >= rows[:, :-1]).all()) or not rows[:, -1].all():
        raise ValueError(
            "attention_mask must pad on the left only (each row zeros then ones, its last column a real token), as "
            "transformers' generation expects: tokenize with padding_side='left'"
        )


_ONE_SEQUENCE = ("num_beams", "num_return_sequences", "assistant_model", "prompt_lookup_num_tokens")
"""generate options that reorder, repeat or roll back the cache's rows (refused unless None or 1)."""


def _check_same_rng(model: torch.nn.Module, mesh: CPMesh) -> None:
    """Sampling draws the same tokens on every rank only from the same generator state: refuse otherwise."""
    device = next(model.parameters()).device
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    states: list[Any] = [None] * mesh.size
    dist.all_gather_object(states, hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest(), group=mesh.group)
    if len(set(states)) > 1:
        raise ValueError(
            "do_sample=True needs the same random generator state on every rank of the mesh (each samples the same "
            "tokens from the same logits): call torch.manual_seed(seed) with one seed on all ranks before generate"
        )


class _SyncedStop(StoppingCriteria):
    """Any rank's stopping decision for a row, on every rank (an all-reduce MAX over the mesh)."""

    def __init__(self, criteria: StoppingCriteriaList, group: dist.ProcessGroup) -> None:
        self.criteria, self.group = criteria, group

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = self.criteria(input_ids, scores, **kwargs).to(torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.group)
        return done.bool()


def generate(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    mesh: CPMesh,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: Any = None,
    **generate_kwargs: Any,
) -> Tensor:
    """:func:`prefill` (its cache sized by ``max_new_tokens`` or ``max_length``, as ``model.generate`` reads them),
    then ``model.generate`` with the sharded cache (Note [Sharded generation]). Every rank calls it with the same
    prompts and options (and seeds its RNG alike to sample); returns the same sequences on every rank. ``stopping_criteria`` may differ between ranks (rank 0's alone, say): their decisions are combined,
    so all ranks stop together. ``streamer`` is used on the mesh's rank 0 only."""
    options = {name: generation_option(model, generate_kwargs, name) for name in _ONE_SEQUENCE}
    refused = {k: v for k, v in options.items() if v not in (None, 1)}
    for name in CACHE_KEYWORDS:
        if name in generate_kwargs:
            refused[name] = type(generate_kwargs[name]).__name__
    if refused:
        raise NotImplementedError(
            f"{refused} not supported with a sharded cache: generate makes its own ShardedKVCache and decodes one "
            f"sequence per prompt (greedy or sampling; no beams, no assistant)"
        )
    if generation_option(model, generate_kwargs, "do_sample"):
        _check_same_rng(model, mesh)
    budget = new_token_budget(model, input_ids.shape[1], generate_kwargs)
    cache = prefill(model, input_ids, attention_mask, mesh=mesh, max_new_tokens=budget)
    stops = _SyncedStop(stopping_criteria or StoppingCriteriaList(), mesh.group)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **{cache_keyword(model): cache},
        stopping_criteria=StoppingCriteriaList([stops]),
        streamer=streamer if mesh.rank == 0 else None,
        **generate_kwargs,
    )
    cache.raise_if_mask_dropped()  # Note [Static shard cache]: one read, after decoding
    return out


_NOT_IN_DECODING = {
    "mesh_cp_mask": "documents of a training batch",
    "cu_seq_lens_q": "packed documents",
    "cu_seq_lens_k": "packed documents",
    "max_length_q": "packed documents",
    "max_length_k": "packed documents",
    "s_aux": "attention sinks",
    "softcap": "softcapped logits",
    "output_attentions": "attention weights, which are never formed",
}
"""Keywords of the attention call that decoding over a sharded cache does not compute: refused by name."""


def decode_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: CacheMask, scaling: float | None, kwargs
) -> tuple[Tensor, None]:
    """The attention of new tokens over this rank's :class:`ShardedKVCache` shard, combined over the mesh (Note
    [Sharded generation]): ``query (B, Hq, k, D)`` of the new tokens (the same on every rank), ``key, value (B,
    Hkv, C, D)`` this rank's preallocated shard as the cache's update returned it, its empty slots hidden (Note
    [Static shard cache]). Returns ``((B, k, Hq, D), None)``."""
    if mask.refusal is not None:
        raise NotImplementedError(mask.refusal)
    cache, index = getattr(module, "mesh_cp_cache", None), getattr(module, "layer_idx", None)
    if cache is None or index is None or key is not cache.layers[index].keys:
        raise NotImplementedError(
            "mesh_cp attention got keys from a cache other than the ShardedKVCache that "
            "mesh_cp.integrations.hf.prefill made for this model: generate with mesh_cp.integrations.hf.generate (or "
            "pass prefill's cache as cache=, or past_key_values= before transformers 5.24); other caches are not supported"
        )
    given = {name: value for name, value in kwargs.items() if value is not None and value is not False}
    refused = sorted(set(given) & set(_NOT_IN_DECODING))
    if refused:
        raise NotImplementedError(
            f"decoding over a sharded cache does not take {refused} ({_NOT_IN_DECODING[refused[0]]})"
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("is_causal") is False:
        raise NotImplementedError("decoding over a sharded cache is causal over the whole cache: no sliding window")
    layer = cache.layers[index]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"value head dim {v.shape[-1]} != query head dim {q.shape[-1]} in decoding")
    batch, new = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    if index == 0:  # what the lengths form takes for granted, this step's and later ones' (Note [Static shard cache])
        cache.check_mask(mask.padding)
    if new == 1:
        return decode_attn_func(q, k, v, mesh=cache.mesh, k_lengths=layer.lengths, softmax_scale=scale), None
    q_columns = torch.arange(layer.seen - new, layer.seen, device=q.device).expand(batch, new)
    seen = layer.columns >= 0
    if mask.padding is not None:
        seen = seen & mask.padding.to(q.device, torch.bool).gather(1, layer.columns.clamp_min(0))
    k_positions = torch.where(seen, layer.columns, -1)
    out = decode_attn_func(
        q, k, v, mesh=cache.mesh, q_positions=q_columns, k_positions=k_positions, softmax_scale=scale
    )
    return out, None
