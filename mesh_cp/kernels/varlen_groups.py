"""How the sequences of a tile are grouped into varlen calls: one bottom-right causal group where one-row sequences
allow it, and sequences without queries between a call's sequences so that it reads the keys in place."""

from __future__ import annotations


def one_causal_group(groups: dict) -> dict:
    """The sequences of one query row (canonical window ``(-1, -1)``) in the group of bottom-right causal ones
    (``(-1, 0)``), where a right bound of 0 cuts nothing either: one call instead of two."""
    if set(groups) == {(-1, -1), (-1, 0)} and all(s[1] - s[0] == 1 for _, s in groups[(-1, -1)]):
        merged = sorted(groups[(-1, 0)] + groups[(-1, -1)], key=lambda m: (m[0], m[1][0]))
        return {(-1, 0): merged}
    return groups


def with_fillers(groups: dict, batch: int, sk: int) -> dict:
    """One call's plain sequences with a sequence of no queries over every run of keys between them (and before and
    after them, in every batch row): the keys are then read in place, in order, without a gather.

    Note [Sequences without queries]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    flash-attn 2 and PyTorch's copy take a varlen sequence of no queries: the forward's blocks of it return at once
    (``flash_fwd_kernel.h``: ``if (m_block * kBlockM >= binfo.actual_seqlen_q) return;``) and the backward writes 0
    to its keys' ``dK``, ``dV`` ("This also covers the case where actual_seqlen_q == 0", ``flash_bwd_kernel.h``,
    under ``!Is_even_MN``, which varlen always is), in 2.6.3, 2.7.4.post1 and 2.8.3 alike. Filling the rows between
    a call's sequences with such sequences makes its keys every row of the tile in order, so the call reads ``k, v``
    themselves where it would gather the rows its sequences read (a chunk call's row groups, whose keys leave rows
    between them: Note [Keys in global order] in :mod:`mesh_cp.core.key_layout`)."""
    if len(groups) != 1 or not all(len(s) == 6 for members in groups.values() for _, s in members):
        return groups
    ((window, members),) = groups.items()
    out, at = [], {}
    for b, seg in members:
        start = at.get(b, 0)
        if seg[2] > start:
            out.append((b, (seg[0], seg[0], start, seg[2], -1, -1)))
        out.append((b, seg))
        at[b] = seg[3]
    filled = []
    for b in range(batch):
        row = [m for m in out if m[0] == b]
        end = at.get(b, 0)
        q_end = row[-1][1][1] if row else 0
        filled += row + ([(b, (q_end, q_end, end, sk, -1, -1))] if end < sk else [])
    return {window: filled}
