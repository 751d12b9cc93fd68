"""The option names of an attention call, one ``Literal`` and one tuple each, checked in one place.

::

    layout    how the global sequence is laid out over the CP ranks   "zigzag" | "contiguous"
    schedule  how the plan is executed                                 "overlap" | "collective"
    backward  what backward gathers again                              "regather" | "reuse"
    partials  the dtype the collective schedule sends row partials in  "accumulator" | "input"
"""

from __future__ import annotations

from typing import Literal, get_args

Layout = Literal["contiguous", "zigzag"]
Schedule = Literal["overlap", "collective"]
Backward = Literal["regather", "reuse"]
Phase = Literal["forward", "backward"]
Partials = Literal["accumulator", "input"]

LAYOUTS: tuple[str, ...] = get_args(Layout)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
BACKWARD_MODES: tuple[str, ...] = get_args(Backward)
PHASES: tuple[str, ...] = get_args(Phase)
PARTIALS: tuple[str, ...] = get_args(Partials)

_ALLOWED = {"layout": LAYOUTS, "schedule": SCHEDULES, "backward": BACKWARD_MODES, "phase": PHASES, "partials": PARTIALS}


def check_option(name: str, value: object) -> str:
    """Return ``value`` when it is one of the values of option ``name`` (``"layout"``, ``"schedule"``,
    ``"backward"``, ``"phase"``, ``"partials"``); otherwise raise ``ValueError`` naming it and the allowed values."""
    allowed = _ALLOWED[name]
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not supported; choose one of {sorted(allowed)}")
    return value


def check_layout(layout: object) -> str:
    """``check_option("layout", layout)``."""
    return check_option("layout", layout)


def positive_int(name: str, value: object, *, what: str = "") -> int:
    """Return ``value`` when it is an ``int`` (not a ``bool``) of at least 1; otherwise raise ``ValueError`` naming
    ``name``, the value and, when given, ``what`` it counts (``"ranks of the CP group"``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        counts = f" ({what})" if what else ""
        raise ValueError(f"{name} must be a positive int{counts}, got {value!r}")
    return value


def positive_or_none(name: str, value: object, *, unit: str = "") -> object:
    """Return ``value`` when it is ``None`` or a positive number (``unit`` says of what, such as ``"bytes"``);
    otherwise raise ``ValueError`` naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        of = f" of {unit}" if unit else ""
        raise ValueError(f"{name} must be a positive number{of} or None, got {value!r}")
    return value


RENAMED: dict[str, str] = {"heads": "head_parallel"}
"""Former spellings of options and what they are called now (refused by :func:`refuse_renamed`)."""


def refuse_renamed(options: dict, *, where: str) -> None:
    """Raise ``ValueError`` when ``options`` (keyword arguments or a config block) uses a former spelling of
    :data:`RENAMED`, naming the new one; ``where`` names the function or block that was called."""
    old = [name for name in RENAMED if name in options]
    if old:
        name = old[0]
        raise ValueError(
            f"{where}: {name!r} was renamed {RENAMED[name]!r} (the head-parallel degree u; 'heads' counts query "
            f"heads only); pass {RENAMED[name]}={options[name]!r}"
        )


def refuse_keywords(keywords: dict, *, where: str) -> None:
    """Refuse the keywords a function with a ``**keywords`` catch-all did not take: a former spelling by name
    (:func:`refuse_renamed`), any other as Python does (``TypeError``, ``where`` naming the function)."""
    refuse_renamed(keywords, where=where)
    if keywords:
        raise TypeError(f"{where}() got an unexpected keyword argument {next(iter(keywords))!r}")
