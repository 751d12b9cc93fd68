"""What differs between the supported transformers versions, in one place (the versions are in ``pyproject.toml``;
``scripts/compat.py`` runs the Hugging Face tests on the oldest supported and the newest released ones).

- The cache keyword of a model's forward and of ``generate``: ``past_key_values`` until transformers 5.23,
  ``cache`` from 5.24 (which still takes ``past_key_values`` with a deprecation warning until 5.40 / 6.0). Read from
  the model's own signature, never from a version number: a model's forward says which name it takes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

CACHE_KEYWORDS: tuple[str, ...] = ("cache", "past_key_values")
"""The names a transformers model call has given its cache, newest first."""


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``model``'s forward (and so its ``generate``) takes its cache by: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"``."""
    forward = getattr(type(model), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def given_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache a model call or ``generate`` call was given under either name (``None``: none). Both names at once
    are refused: transformers would take one and drop the other."""
    given = {name: kwargs[name] for name in CACHE_KEYWORDS if kwargs.get(name) is not None}
    if len(given) > 1:
        raise ValueError(f"a cache was given as both {' and '.join(given)}: pass one (cache= on transformers >= 5.24)")
    return next(iter(given.values()), None)


def output_cache(output: Any) -> Any:
    """The cache a model output carries (``output.cache`` from transformers 5.24, ``output.past_key_values``
    before)."""
    for name in CACHE_KEYWORDS:
        if isinstance(output, Mapping) and output.get(name) is not None:
            return output[name]
        if not isinstance(output, Mapping) and getattr(output, name, None) is not None:
            return getattr(output, name)
    return None
