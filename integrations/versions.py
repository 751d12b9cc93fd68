"""The versions of the frameworks mesh_cp's adapters are tested with, checked when an adapter uses one.

Each framework has a floor (the oldest supported release: ``pyproject.toml``'s lower bound, kept equal by
``tests/integrations/test_versions.py``) and a newest tested release (the newest the tests passed on; docs/compat.md).
:func:`require` is called where a framework is first used: importing ``mesh_cp.integrations.hf`` checks transformers,
``mesh_cp.integrations.deepspeed`` DeepSpeed, ``mesh_cp.integrations.megatron`` megatron-core; accelerate when a
trainer class is made or accelerate's parallelism config is read; TRL when a trainer class is made from one of its
trainers; DeepSpeed again when the Hugging Face ``Trainer`` reads a DeepSpeed config. A framework that is not
installed is not checked (its own import fails where it is used).

- Below the floor: ``ImportError`` naming the package, the version installed, the supported range and the ``pip``
  command that fixes it. The results there are known to differ (docs/compat.md says how), with no error of their own.
- Above the newest tested: one :class:`UntestedVersionWarning` per package and process.
- ``MESH_CP_ALLOW_UNSUPPORTED=1`` in the environment turns the error into that warning (``scripts/compat.py`` sets it
  to run the tests on the older releases it bisects); the results may then be silently wrong.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
import os
import warnings
from dataclasses import dataclass

ALLOW_UNSUPPORTED = "MESH_CP_ALLOW_UNSUPPORTED"
"""The environment variable that, set to ``1``, turns the refusal of a version below the floor into a warning."""


class UntestedVersionWarning(UserWarning):
    """A framework's installed version is outside the versions mesh_cp was tested with."""


@dataclass(frozen=True, kw_only=True)
class Supported:
    """The versions of one framework that mesh_cp supports."""

    module: str
    """The module it is imported as (``megatron.core``); read for ``__version__`` when no package metadata exists
    (a source checkout on ``PYTHONPATH``)."""
    extra: str
    """The extra of ``mesh-cp`` that installs it (``pip install -e ".[hf]"``)."""
    floor: str
    """The oldest supported release: ``pyproject.toml``'s ``>=`` bound of it in every extra."""
    newest: str
    """The newest release tested. Its number of parts says what it covers: ``"5.24.0"`` that release, ``"0.20"`` every
    ``0.20.x``."""


SUPPORTED: dict[str, Supported] = {
    "transformers": Supported(module="transformers", extra="hf", floor="5.16.0", newest="5.24.0"),
    "accelerate": Supported(module="accelerate", extra="accelerate", floor="1.12.0", newest="1.15.0"),
    "trl": Supported(module="trl", extra="trl", floor="1.16.0", newest="1.16.0"),
    "deepspeed": Supported(module="deepspeed", extra="deepspeed", floor="0.19", newest="0.19.8"),
    "megatron-core": Supported(module="megatron.core", extra="megatron", floor="0.16", newest="0.20"),
}
"""Package (its distribution name, as ``pip`` spells it) -> its supported versions."""


def installed_version(package: str) -> str | None:
    """The version of ``package`` installed: its package metadata, else its module's ``__version__``; ``None`` when
    it is not installed (neither exists, or the module cannot be imported)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module(SUPPORTED[package].module)
    except ImportError:
        return None
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else None


def require(package: str) -> None:
    """Check the installed ``package`` (a key of :data:`SUPPORTED`) against its supported versions: refuse one below
    the floor (``ImportError``), warn once per process about one above the newest tested
    (:class:`UntestedVersionWarning`). Nothing when it is not installed."""
    if package not in SUPPORTED:
        raise ValueError(f"no supported versions are known for {package!r}; known: {sorted(SUPPORTED)}")
    _check(package, installed_version(package))


def require_for_trainer(base: type) -> None:
    """The checks of a trainer class made from ``base``: accelerate (every ``transformers.Trainer`` runs on it), and
    each framework whose module defines one of ``base``'s classes (TRL for ``trl.SFTTrainer``)."""
    roots = {cls.__module__.split(".")[0] for cls in getattr(base, "__mro__", ())}
    used = {"accelerate"} | {package for package, s in SUPPORTED.items() if s.module.split(".")[0] in roots}
    for package in sorted(used):
        require(package)


@functools.cache
def _check(package: str, version: str | None) -> None:
    """:func:`require` for one installed ``version``; cached, so each warning is given once per process (a refusal
    raises every time: an exception is not cached)."""
    if version is None:
        return
    from packaging.version import InvalidVersion, Version  # every framework checked depends on packaging; mesh_cp not

    supported = SUPPORTED[package]
    tested = f"{package}>={supported.floor}, tested up to {supported.newest}"
    try:
        got = Version(version)
    except InvalidVersion:
        _warn(f"{package} reports the version {version!r}, which is not a version number; mesh_cp supports {tested}")
        return
    if got < Version(supported.floor):
        problem = (
            f"{package} {version} is installed, and mesh_cp supports {tested}: with older releases its results can "
            f"differ from the framework's own without an error (docs/compat.md, Supported ranges)"
        )
        if os.environ.get(ALLOW_UNSUPPORTED) == "1":
            _warn(f"{problem}; {ALLOW_UNSUPPORTED}=1 lets it run, and the results may be silently wrong")
            return
        raise ImportError(
            f'{problem}. Upgrade it: pip install "{package}>={supported.floor}" (or install mesh-cp\'s extra: '
            f'pip install -e ".[{supported.extra}]"); {ALLOW_UNSUPPORTED}=1 runs it anyway, with a warning'
        )
    newest = Version(supported.newest).release
    if got.release[: len(newest)] > newest:
        _warn(
            f"{package} {version} is newer than the newest release mesh_cp was tested with ({supported.newest}): "
            f"its results are untested there (mesh_cp supports {tested}; scripts/compat.py runs the tests on the "
            f"installed releases)"
        )


def _warn(message: str) -> None:
    warnings.warn(message, UntestedVersionWarning, stacklevel=4)


__all__ = ["ALLOW_UNSUPPORTED", "SUPPORTED", "Supported", "UntestedVersionWarning", "installed_version", "require"]
