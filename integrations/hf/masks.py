"""transformers' mask interface for ``attn_implementation="mesh_cp"``: every mask transformers composes is
checked and none is built (the mesh applies causality over global positions itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

MASK_KEYWORDS: frozenset[str] = frozenset(
    {"allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype", "config", "use_vmap", "device", "local_size"}
)
"""Keywords :func:`mesh_cp_mask` accepts beyond its named parameters: hints for building the mask tensor
transformers would build, and mesh_cp builds none (``local_size`` repeats the sliding window, which is
checked through the mask function)."""


# Leaf mask functions of transformers' masking_utils that mask nothing beyond causal or full attention, which the
# attention itself applies over global positions: causal, full (config.is_causal=False, which transformers also
# passes to every layer as is_causal=False), and the packed-sequence mask that a zig-zag shard's jumping positions
# make transformers add (packing itself is refused by the position check).
_PLAIN_MASKS = frozenset(
    {"causal_mask_function", "bidirectional_mask_function", "packed_sequence_mask_function.<locals>.inner_mask"}
)

# Leaf mask functions of transformers' masking_utils that mesh_cp refuses, and the feature each is.
_REFUSED_MASKS = {
    "chunked_overlay.<locals>.inner_mask": "chunked attention (config.attention_chunk_size)",
    "blockwise_overlay.<locals>.inner_mask": "block-wise bidirectional attention (block_sequence_ids)",
    "or_masks.<locals>.or_mask": "an or_mask_function overlay (tokens that attend outside the causal mask)",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": "a bidirectional sliding window",
    "padding_mask_function.<locals>.inner_mask": "a padding mask function",
}


def _mask_parts(fn: Callable) -> list[tuple[str, dict[str, Any]]]:
    """The leaf mask functions transformers composed into ``fn`` (``and_masks`` and the packed-sequence
    position remap opened), each as its qualified name and its closure variables."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    code = getattr(fn, "__code__", None)
    cells = (
        {}
        if code is None
        else dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    )
    if name == "and_masks.<locals>.and_mask":
        return [part for f in cells["mask_functions"] for part in _mask_parts(f)]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _mask_parts(cells["mask_function"])
    return [(name, cells)]


class _MaskNote:
    """What :func:`mesh_cp_mask` returns in place of a mask that is not plain causal: nothing is built; the
    attention layers given it check it against their own sequence (:meth:`check`), so a mask that no layer
    uses (a model may build a sliding-window mask its layers never read) costs nothing. Any other use of it
    by model code raises the refusal."""

    __slots__ = ("window", "refusal")

    def __init__(self, *, window: int | None = None, refusal: str | None = None):
        self.window, self.refusal = window, refusal

    def check(self) -> None:
        """Raise the refusal of an overlay mesh_cp does not compute (a window it computes)."""
        if self.refusal is not None:
            raise NotImplementedError(self.refusal)

    def __getattr__(self, name: str):
        raise NotImplementedError(
            self.refusal or f"mesh_cp builds no sliding-window mask (window {self.window}), and model code read .{name}"
        )

    def __getitem__(self, index):
        return self.__getattr__("__getitem__")


class CacheMask:
    """What :func:`mesh_cp_mask` returns for queries over a cache: the batch's 2-D padding mask (``None``: none),
    for the decode attention of a :class:`~mesh_cp.integrations.hf.shard_cache.ShardedKVCache` (Note [Sharded
    generation]), or the reason it cannot be used (any other cache, a mask beyond causal and padding)."""

    __slots__ = ("padding", "refusal")

    def __init__(self, padding: Tensor | None, refusal: str | None):
        self.padding, self.refusal = padding, refusal


def _cache_mask(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask) -> CacheMask:
    """The mask of a call over a cache: causal over the columns of the batch (queries at ``q_offset``, keys from
    0), with the 2-D padding mask; anything else is a refusal carried to the attention layers."""
    refusal = None
    if isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor) or kv_offset or q_offset + q_length != kv_length:
        refusal = f"{q_length} queries at offset {q_offset} over {kv_length} keys at offset {kv_offset}"
    for name, _ in _mask_parts(mask_function) if mask_function is not None else ():
        if name != "causal_mask_function":
            refusal = _REFUSED_MASKS.get(name, f"the mask function {name}")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_length):
        refusal = (
            f"an attention mask of shape {tuple(attention_mask.shape)} (2-D over the {kv_length} columns expected)"
        )
    if refusal is not None:
        refusal = f"mesh_cp decodes with a cache causally over the batch's columns with padding only; got {refusal}"
    return CacheMask(attention_mask, refusal)


def mesh_cp_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> _MaskNote | CacheMask | None:
    """transformers mask function: checks the mask transformers would build and builds none (the mesh
    applies causality over global positions itself).

    Returns None for the causal or the full mask (the attention applies either, from ``is_causal``, as
    transformers' sdpa path does), possibly with the packed-sequence wrapper transformers adds for
    position_ids that jump (a zig-zag shard always does; packing itself is refused by the position
    check). A sliding window, or an overlay mesh_cp refuses (chunked, bidirectional, block-wise,
    or-masks), gives a :class:`_MaskNote` that every attention layer using it checks: a window must span
    the whole sequence, a refused overlay raises ``NotImplementedError`` naming it. Offsets or
    ``kv_length != q_length`` (a cache) give a :class:`CacheMask`, which only the decode attention of a
    ``ShardedKVCache`` takes; other keywords must be in :data:`MASK_KEYWORDS`.

    ``attention_mask`` (this rank's 2-D padding mask, given to the model) must be all ones. It is checked
    by value only on the CPU, where reading it costs no device synchronisation; a mask on an accelerator
    is refused (checking it there would stop the device every step, and it carries nothing mesh_cp can
    use): give the padding mask to :func:`shard_batch` or :class:`ShardingCollator` instead.
    """
    unknown = kwargs.keys() - MASK_KEYWORDS
    if unknown:
        raise NotImplementedError(
            f"mesh_cp mask got keyword(s) {sorted(unknown)} it does not handle; it accepts {sorted(MASK_KEYWORDS)}"
        )
    if isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor) or q_offset or kv_offset or kv_length != q_length:
        return _cache_mask(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    if attention_mask is not None:
        if attention_mask.device.type != "cpu":
            raise NotImplementedError(
                f"mesh_cp does not take attention_mask in the model call (got one on {attention_mask.device}): pass "
                f"it to mesh_cp.integrations.hf.shard_batch / ShardingCollator (right padding becomes ignored labels) "
                f"and call the model without it"
            )
        if not bool(attention_mask.all()):
            raise ValueError(
                "mesh_cp attention does not take padding masks: right-pad the batch and pass attention_mask to "
                "mesh_cp.integrations.hf.shard_batch (padded tokens then get no label), not to the model"
            )
    windows = []
    for name, cells in _mask_parts(mask_function) if mask_function is not None else ():
        if name in _PLAIN_MASKS:
            continue
        if name == "sliding_window_overlay.<locals>.inner_mask":
            windows.append(cells["sliding_window"])
            continue
        return _MaskNote(
            refusal=f"mesh_cp does not support {_REFUSED_MASKS.get(name, f'the mask function {name}')}: it computes "
            f"causal (or full) attention over the whole sequence only"
        )
    return _MaskNote(window=min(windows)) if windows else None
