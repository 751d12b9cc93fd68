"""An order of items in which given sets of them are consecutive (pure Python).

Note [Consecutive sets]
~~~~~~~~~~~~~~~~~~~~~~~
A layout of keys serves every call that reads a view of it only when each call's keys are one run of it. Items that
belong to the same sets (an *atom*) can stay together, so the search orders atoms: depth first, in the preferred
order of their first items, an atom may follow only when it belongs to every set already begun and not yet complete
(else that set would be cut). Items that must end a set in a given order (a causal diagonal) each come only once the
set's other items before them are placed, and those form a run too. The first order found keeps the preferred order
wherever it serves, so a preferred order in which every set is a run is returned as it is. The search stops after
``limit`` placements without an order (the caller then gives some sets sections of their own).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def consecutive_order(
    items: Sequence[Hashable], sets: Sequence[frozenset], last: dict[int, tuple] | None = None, limit: int = 20_000
) -> list | None:
    """An order of ``items`` (distinct, in preferred order) in which every set of ``sets`` (subsets of ``items``) is
    one run, set ``i`` ending in the items ``last[i]`` in that order where given, or ``None`` when the search finds none
    within ``limit`` placements (Note [Consecutive sets])."""
    sets, after = list(sets), []  # (item, set): the item only once the set is complete
    for i, suffix in (last or {}).items():
        for k, item in enumerate(suffix):
            after.append((item, len(sets)))
            sets.append(sets[i] - set(suffix[k:]))
    atoms: dict[tuple[int, ...], list] = {}
    for item in items:
        atoms.setdefault(tuple(i for i, s in enumerate(sets) if item in s), []).append(item)
    signatures = list(atoms)
    size = [sum(len(atoms[sig]) for sig in signatures if i in sig) for i in range(len(sets))]
    placed = [0] * len(sets)
    order: list[tuple[int, ...]] = []
    left = [limit]

    def search() -> bool:
        if len(order) == len(signatures):
            return True
        begun = [i for i, n in enumerate(placed) if 0 < n < size[i]]
        for sig in signatures:
            if sig in order or any(i not in sig for i in begun):
                continue
            if any(item in atoms[sig] and placed[j] < size[j] for item, j in after):
                continue
            left[0] -= 1
            if left[0] < 0:
                return False
            order.append(sig)
            for i in sig:
                placed[i] += len(atoms[sig])
            if search():
                return True
            order.pop()
            for i in sig:
                placed[i] -= len(atoms[sig])
        return False

    if not search():
        return None
    return [item for sig in order for item in atoms[sig]]
