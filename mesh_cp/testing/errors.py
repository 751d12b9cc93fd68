"""Record whether a call raised the error a test expects, inside a spawned rank (where ``pytest.raises``
cannot report back)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def expect_error(results: dict, name: str, exc: type[Exception], pattern: str, fn: Callable[[], Any]) -> None:
    """Record in ``results[name]`` whether ``fn()`` raised ``exc`` with a message matching ``pattern``
    (``True``), or what happened instead (a string: the wrong message, another exception, or no raise)."""
    try:
        fn()
    except exc as err:
        results[name] = bool(re.search(pattern, str(err))) or f"wrong message: {err}"
        return
    except Exception as err:  # noqa: BLE001 - any other exception is a failure to report
        results[name] = f"raised {type(err).__name__}: {err}"
        return
    results[name] = "did not raise"
