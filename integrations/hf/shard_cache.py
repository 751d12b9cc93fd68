"""This rank's shard of a transformers K/V cache for generation over a CP mesh (Note [Sharded generation] in
:mod:`mesh_cp.integrations.hf.generation`).

Note [Static shard cache]
~~~~~~~~~~~~~~~~~~~~~~~~~
Each layer's shard is allocated once, at the prefill, with a fixed capacity: the prompt's slots, then
``ceil(max_new_tokens / P)`` slots for new columns (the rank that takes the first new column takes the most),
rounded up to a multiple of 256 (a page of the flash decode kernel, Note [Flash decode] in
:mod:`mesh_cp.runtime.decode`). Every row keeps its entries first: the prefill writes the prompt entries the row
sees (not the mesh's padding, not the row's own left padding) to its first slots, and decoding writes the columns
a rank owns to each row's next slots in place (a scatter at the row's length, a device tensor; how many is known on
the host), so each row's cache is its first ``lengths[b]`` slots, the lengths form of
:func:`mesh_cp.decode_attn_func`. One new token per step (what ``generate`` feeds) is decoded in that form, by
the flash decode kernel where it runs; several are decoded in the positions form, from each slot's column. No shape
grows from token to token, no tensor is reallocated and no value is read back from the device in a step, so the
step's shapes are static (what CUDA graphs need). A column beyond the capacity raises on every rank at the same
step, naming the capacity and the fix.

The lengths form holds when the steps' padding mask is the prompt's, then ones: ``generate`` extends the mask
with ones. The first one-token step reads the mask once (one read per ``generate``) and compares it with the
prefill's; every step compares its whole mask on the device and keeps the verdict, which
:func:`~mesh_cp.integrations.hf.generation.generate` reads once when decoding ends, raising instead of returning
the sequences (after ``model.generate`` with :func:`~mesh_cp.integrations.hf.generation.prefill`'s cache, call
:meth:`ShardedKVCache.raise_if_mask_dropped`); a mask that differs from the prompt's raises at the first step,
naming the fix.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from mesh_cp.runtime.decode import cache_slots
from mesh_cp.runtime.mesh import CPMesh


class ShardedLayer(CacheLayerMixin):
    """This rank's shard of one layer's K/V cache, preallocated (Note [Static shard cache]): ``keys, values (B, Hkv,
    C, D)`` of a fixed capacity ``C`` and the batch column of each slot, ``columns (B, C)`` (``-1``: a slot nobody
    sees); row ``b``'s entries are its first ``lengths[b]`` slots (``lengths (B,)`` int32)."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.columns: Tensor | None = None
        self.seen = 0
        """Columns of the batch processed so far, by all ranks together."""
        self.length = 0
        """Slots of this rank's prompt shard plus the new columns it took (host-side: the most any row fills)."""
        self.lengths: Tensor | None = None
        self.prefill_columns: Tensor | None = None
        """Set by :func:`prefill` for its forward: the columns of this rank's shard."""
        self.prefill_seen: Tensor | None = None
        """Set by :func:`prefill`: ``(B, S)``, which entries of the shard each row sees."""
        self.prefill_length = 0
        self.max_new_tokens = 0
        """Set by :func:`prefill`: the columns decoding may feed, which sizes the slots left after the prompt's."""

    @property
    def capacity(self) -> int:
        """Slots of the shard: the prompt's, then ``ceil(max_new_tokens / world)`` for new columns (0 before the
        prefill)."""
        return 0 if self.columns is None else self.columns.shape[1]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        if self.prefill_columns is None:
            raise ValueError("the prefill of a ShardedKVCache must be its first update, with the shard's columns")
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        slots = cache_slots(self.prefill_columns.numel() + -(-self.max_new_tokens // self.world))
        # Zeros, not empty: an unfilled slot's value is multiplied by its probability 0, which must not make a nan.
        self.keys = key_states.new_zeros(batch, heads, slots, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, value_states.shape[1], slots, value_states.shape[-1])
        self.columns = torch.full((batch, slots), -1, dtype=torch.long, device=key_states.device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Prefill: keep this rank's shard and return it (the mesh attends the shards). Decode: write the new
        columns this rank owns into the next slots, and return the whole preallocated shard."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.prefill_columns is not None:
            columns, self.prefill_columns = self.prefill_columns, None
            if self.seen or columns.numel() != key_states.shape[2]:
                raise ValueError("the prefill of a ShardedKVCache must be its first update, with the shard's columns")
            self._write_prompt(key_states, value_states, columns, self.prefill_seen.to(columns.device))
            self.seen = self.prefill_length
            return key_states, value_states
        new = key_states.shape[2]
        self._check_room(new)
        # Column c goes to rank (c - prefill_length) % world: the owned new columns are a strided slice and a range
        # made on the device (how many is known on the host), so nothing is copied from the host or read back.
        first = (self.rank - (self.seen - self.prefill_length)) % self.world
        if first < new:
            index = torch.arange(self.seen + first, self.seen + new, self.world, device=self.columns.device)
            self._write(key_states[:, :, first :: self.world], value_states[:, :, first :: self.world], index)
        self.seen += new
        return self.keys, self.values

    def _write_prompt(self, keys: Tensor, values: Tensor, columns: Tensor, seen: Tensor) -> None:
        """The prompt's entries, each row's seen ones first (a stable sort of the shard by ``~seen``)."""
        order = torch.sort((~seen).to(torch.uint8), dim=1, stable=True).indices  # (B, S)
        width = keys.shape[2]
        for store, entries in ((self.keys, keys), (self.values, values)):
            store[:, :, :width] = entries.gather(2, order[:, None, :, None].expand_as(entries))
        self.columns[:, :width] = torch.where(seen.gather(1, order), columns[order], -1)
        self.lengths.copy_(seen.sum(1))
        self.length = width

    def _write(self, keys: Tensor, values: Tensor, columns: Tensor) -> None:
        """Write new entries to each row's next slots (at its length), in place."""
        count = keys.shape[2]
        slots = self.lengths[:, None].long() + torch.arange(count, device=self.lengths.device)  # (B, count)
        for store, entries in ((self.keys, keys), (self.values, values)):
            store.scatter_(2, slots[:, None, :, None].expand_as(entries), entries)
        self.columns.scatter_(1, slots, columns.expand_as(slots))
        self.lengths += count
        self.length += count

    def _check_room(self, new: int) -> None:
        """Refuse ``new`` columns that would overflow the slots of any rank (the first rank takes the most: every
        rank checks the same arithmetic, so all raise at the same step, none left waiting in a collective)."""
        fed = self.seen + new - self.prefill_length
        room = -(-self.max_new_tokens // self.world)
        if -(-fed // self.world) > room:
            raise ValueError(
                f"the ShardedKVCache is full: it holds {room} new columns per rank (max_new_tokens="
                f"{self.max_new_tokens} over {self.world} ranks) beside the prompt's, and decoding has fed {fed} "
                "columns; prefill with a larger max_new_tokens "
                "(mesh_cp.integrations.hf.prefill(..., max_new_tokens=N), or pass max_new_tokens to hf.generate)"
            )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class ShardedKVCache(Cache):
    """A transformers ``Cache`` holding this rank's shard of every layer's K/V (Note [Sharded generation]). Build it
    with :func:`prefill`; give it to ``model.generate(cache=...)`` (``past_key_values=`` before transformers 5.24) (or use :func:`generate`)."""

    def __init__(self, mesh: CPMesh, num_layers: int, prompt_mask: Tensor | None = None) -> None:
        super().__init__(layers=[ShardedLayer(mesh.rank, mesh.size) for _ in range(num_layers)])
        self.mesh = mesh
        self.prompt_mask = prompt_mask
        """``(B, T - 1)`` bool: the prompt columns each row keeps (the prefill's mask; ``None``: all)."""
        self.mask_checked = False
        """The first one-token step compared the steps' mask with :attr:`prompt_mask` (Note [Static shard cache])."""
        self.mask_kept: Tensor | None = None
        """A device bool: every new column checked so far was kept by the mask."""

    def check_mask(self, padding: Tensor | None) -> None:
        """Refuse a step whose padding mask the lengths form would not apply (Note [Static shard cache]): at the first
        one-token step, one read comparing it with the prompt's; at every step, the whole mask on the device, read once
        after decoding by :func:`~mesh_cp.integrations.hf.generation.generate` (:meth:`raise_if_mask_dropped`)."""
        fix = "prefill and generate with the same attention_mask"
        if padding is None:
            if not self.mask_checked and self.prompt_mask is not None and not bool(self.prompt_mask.all()):
                raise ValueError(
                    f"a decoding step without an attention mask, but prefill's masks padding (its {tuple(self.prompt_mask.shape)} "
                    f"mask has zeros): {fix}"
                )
            self.mask_checked = True
            return
        padding = padding.to(torch.bool)
        kept = self._kept(padding)  # every step: the whole mask, on the device
        if not self.mask_checked:
            if not bool(kept):
                prompt = self.prompt_mask
                raise ValueError(
                    "the attention mask of a decoding step must be the prompt's mask that prefill was given, then "
                    f"ones (what generate passes); got {padding.shape[1]} columns that differ from prefill's "
                    f"{None if prompt is None else tuple(prompt.shape)} mask: {fix}"
                )
            self.mask_checked = True
        self.mask_kept = kept if self.mask_kept is None else self.mask_kept & kept

    def _kept(self, padding: Tensor) -> Tensor:
        """A device bool: ``padding`` is :attr:`prompt_mask` (none: every prompt column kept), then ones."""
        prompt = self.prompt_mask
        width = 0 if prompt is None else prompt.shape[1]
        if prompt is not None and (padding.shape[0] != prompt.shape[0] or padding.shape[1] < width):
            return torch.zeros((), dtype=torch.bool, device=padding.device)  # cannot be the prompt's mask
        kept = padding[:, width:].all()
        if prompt is not None:
            kept = kept & (padding[:, :width] == prompt.to(padding.device)).all()
        return kept

    def raise_if_mask_dropped(self) -> None:
        """Raise if a decoding step's mask differed from the prompt's mask followed by ones (one read). ``hf.generate``
        calls it after decoding; after ``model.generate(cache=...)`` with :func:`prefill`'s cache, call it yourself."""
        if self.mask_kept is not None and not bool(self.mask_kept):
            raise ValueError(
                "a decoding step's attention mask dropped a generated column or changed the prompt's; a ShardedKVCache "
                "decodes with the prompt's padding, then every generated column kept (what generate passes)"
            )

    @property
    def decoding(self) -> bool:
        """The prompt is in: model calls now feed new tokens to every rank alike."""
        return all(layer.seen > 0 for layer in self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "beam search reorders the cache's rows; a ShardedKVCache supports greedy and sampling"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a ShardedKVCache cannot be cropped (assisted decoding rolls the cache back)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            f"num_return_sequences / num_beams {repeats} repeat the cache's rows; prefill the repeated prompts instead"
        )
