"""The option names of an attention call, one ``Literal`` and one tuple each, checked in one place.

::

    layout    how the global sequence is laid out over the CP ranks   "zigzag" | "contiguous"
    schedule  how the plan is executed                                 "overlap" | "collective"
    backward  what backward gathers again                              "regather" | "reuse"
"""

from __future__ import annotations

from typing import Literal, get_args

Layout = Literal["contiguous", "zigzag"]
Schedule = Literal["overlap", "collective"]
Backward = Literal["regather", "reuse"]
Phase = Literal["forward", "backward"]

LAYOUTS: tuple[str, ...] = get_args(Layout)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
BACKWARD_MODES: tuple[str, ...] = get_args(Backward)
PHASES: tuple[str, ...] = get_args(Phase)

_ALLOWED = {"layout": LAYOUTS, "schedule": SCHEDULES, "backward": BACKWARD_MODES, "phase": PHASES}


def check_option(name: str, value: object) -> str:
    """Return ``value`` when it is one of the values of option ``name`` (``"layout"``, ``"schedule"``,
    ``"backward"``, ``"phase"``); otherwise raise ``ValueError`` naming it and the allowed values."""
    allowed = _ALLOWED[name]
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not supported; choose one of {sorted(allowed)}")
    return value


def check_layout(layout: object) -> str:
    """``check_option("layout", layout)``."""
    return check_option("layout", layout)
