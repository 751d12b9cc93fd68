"""The version check of the adapters (mesh_cp.integrations.versions): the ranges equal pyproject.toml's and cover
constraints-cpu.txt's pins; below the floor refused by message, above the newest tested one warning per process and
package, in range nothing; and each place a framework is used calls the check."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from mesh_cp.integrations import versions
from mesh_cp.integrations.versions import ALLOW_UNSUPPORTED, SUPPORTED, UntestedVersionWarning, require
from tests.scripts.test_compat import constraint_pins

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]

BELOW = {
    "transformers": "5.15.1",
    "accelerate": "1.11.0",
    "trl": "1.14.2",
    "deepspeed": "0.18.9",
    "megatron-core": "0.15.3",
}
ABOVE = {
    "transformers": "5.25.0",
    "accelerate": "1.16.0",
    "trl": "1.17.0",
    "deepspeed": "0.19.9",
    "megatron-core": "0.21.0",
}


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """``installed(package=version)``: importlib.metadata reports those versions (``None``: not installed), the
    escape variable is unset and the once-per-process memory is empty (before and after the test)."""
    real = importlib.metadata.version
    fake: dict[str, str | None] = {}

    def version(name: str) -> str:
        if name not in fake:
            return real(name)
        if fake[name] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return fake[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delenv(ALLOW_UNSUPPORTED, raising=False)
    versions._check.cache_clear()
    yield lambda **given: fake.update({name.replace("_", "-"): v for name, v in given.items()})
    versions._check.cache_clear()


def test_floors_are_pyprojects_lower_bounds() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    seen = set()
    for extra, requirements in extras.items():
        for req in map(Requirement, requirements):
            if req.name in SUPPORTED:
                lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
                assert lows == [Version(SUPPORTED[req.name].floor)], (extra, str(req), SUPPORTED[req.name].floor)
                seen.add(req.name)
    assert seen == set(SUPPORTED)
    for package, supported in SUPPORTED.items():
        assert package in [Requirement(r).name for r in extras[supported.extra]], (package, supported.extra)


def test_newest_tested_covers_the_pins_of_constraints_cpu() -> None:
    pins = {name: Version(next(iter(req.specifier)).version) for name, req in constraint_pins().items()}
    for package, supported in SUPPORTED.items():
        assert pins[package] >= Version(supported.floor), (package, pins[package])
        newest = Version(supported.newest).release
        assert pins[package].release[: len(newest)] <= newest, (package, pins[package], supported.newest)


@pytest.mark.parametrize("package", sorted(SUPPORTED))
def test_below_the_floor_is_refused_with_the_range_and_the_fix(installed, package: str) -> None:
    installed(**{package: BELOW[package]})
    floor, extra = SUPPORTED[package].floor, SUPPORTED[package].extra
    with pytest.raises(ImportError) as err:
        require(package)
    message = str(err.value)
    for part in (
        f"{package} {BELOW[package]} is installed",
        f"mesh_cp supports {package}>={floor}, tested up to {SUPPORTED[package].newest}",
        f'pip install "{package}>={floor}"',
        f'pip install -e ".[{extra}]"',
        f"{ALLOW_UNSUPPORTED}=1",
    ):
        assert part in message, (part, message)
    with pytest.raises(ImportError):  # refused every time, not once
        require(package)


@pytest.mark.parametrize("package", sorted(SUPPORTED))
def test_above_the_newest_tested_warns_once_per_process(installed, package: str) -> None:
    installed(**{package: ABOVE[package]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            require(package)
    assert [w.category for w in caught] == [UntestedVersionWarning]
    message = str(caught[0].message)
    assert f"{package} {ABOVE[package]} is newer than the newest release mesh_cp was tested with" in message
    assert f"({SUPPORTED[package].newest})" in message and "untested" in message


def test_each_package_warns_once(installed) -> None:
    installed(transformers="5.30.0", deepspeed="0.20.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for package in ("transformers", "deepspeed", "transformers", "deepspeed"):
            require(package)
    assert [str(w.message).split(" ")[0] for w in caught] == ["transformers", "deepspeed"]


@pytest.mark.parametrize(
    "given",
    [
        {name: s.floor for name, s in SUPPORTED.items()},
        {name: s.newest for name, s in SUPPORTED.items()},
        {"transformers": "5.20.0", "megatron_core": "0.20.7", "deepspeed": "0.19.8+cu130", "trl": "1.16.0.post1"},
        {name: None for name in SUPPORTED},  # not installed: its own import fails where it is used
    ],
    ids=["floor", "newest", "between", "not-installed"],
)
def test_in_range_or_not_installed_says_nothing(installed, monkeypatch: pytest.MonkeyPatch, given: dict) -> None:
    installed(**given)
    for supported in SUPPORTED.values():  # no module to read __version__ from when metadata is missing
        monkeypatch.setitem(sys.modules, supported.module, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for package in SUPPORTED:
            require(package)


def test_escape_variable_turns_the_refusal_into_a_warning(installed, monkeypatch: pytest.MonkeyPatch) -> None:
    installed(transformers="5.15.1")
    monkeypatch.setenv(ALLOW_UNSUPPORTED, "1")
    with pytest.warns(UntestedVersionWarning, match=rf"transformers 5.15.1 is installed.*{ALLOW_UNSUPPORTED}=1"):
        require("transformers")


def test_source_checkout_without_metadata_reads_the_modules_version(installed, monkeypatch) -> None:
    installed(megatron_core=None)
    monkeypatch.setitem(sys.modules, "megatron.core", types.SimpleNamespace(__version__="0.15.0"))
    with pytest.raises(ImportError, match=r"megatron-core 0.15.0 is installed"):
        require("megatron-core")


def test_unknown_package_and_unreadable_version(installed) -> None:
    with pytest.raises(ValueError, match=r"no supported versions are known for 'torch'; known: \['accelerate'"):
        require("torch")
    installed(trl="main")
    with pytest.warns(UntestedVersionWarning, match="trl reports the version 'main', which is not a version number"):
        require("trl")


def test_trainer_and_accelerate_paths_check_what_they_use(installed) -> None:
    """accelerate and TRL are checked where they are used, and only there: a TRL below the floor does not stop a
    plain Trainer (or the import of the adapter), it stops a trainer class made from TRL's."""
    from mesh_cp.integrations import hf
    from mesh_cp.integrations.hf.trainer import _parallel_from_deepspeed_args

    installed(trl="1.14.2")
    sft = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})
    with pytest.raises(ImportError, match=r"trl 1.14.2 is installed, and mesh_cp supports trl>=1.16.0"):
        hf.mesh_cp_trainer_class(sft)
    versions.require_for_trainer(type("Trainer", (), {"__module__": "transformers.trainer"}))  # TRL not used
    installed(accelerate="1.11.0")
    for call in (
        lambda: hf.mesh_cp_trainer_class(type("Trainer", (), {"__module__": "transformers.trainer"})),
        hf.accelerator_parallelism_config,
        lambda: hf.parallel_from_accelerate(types.SimpleNamespace(**dict.fromkeys(hf.accelerate_config._SIZES, 1))),
    ):
        with pytest.raises(ImportError, match=r"accelerate 1.11.0 is installed"):
            call()
    installed(deepspeed="0.18.9")
    args = types.SimpleNamespace(
        hf_deepspeed_config=types.SimpleNamespace(
            config={"mesh_attention": {"enabled": True, "cp_size": 2, "tile": "1x2"}}
        )
    )
    with pytest.raises(ImportError, match=r"deepspeed 0.18.9 is installed"):
        _parallel_from_deepspeed_args(args, None)


IMPORTS = """
import importlib.metadata as m, json
real = m.version
below = {"transformers": "5.15.1", "deepspeed": "0.18.9", "megatron-core": "0.15.3"}
m.version = lambda name: below.get(name) or real(name)
refused = {}
for adapter in ("hf", "deepspeed", "megatron"):
    try:
        __import__(f"mesh_cp.integrations.{adapter}")
    except ImportError as err:
        refused[adapter] = str(err)
print(json.dumps(refused))
"""


def test_importing_an_adapter_refuses_its_framework_below_the_floor() -> None:
    """In a fresh interpreter: each adapter's import checks its framework first (transformers 5.15.1 is what
    ``pip install -e .`` without extras left installed)."""
    run = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    refused = json.loads(run.stdout.strip().splitlines()[-1])
    assert refused.keys() == {"hf", "deepspeed", "megatron"}, refused
    assert "transformers 5.15.1 is installed, and mesh_cp supports transformers>=5.16.0" in refused["hf"]
    assert 'pip install "transformers>=5.16.0"' in refused["hf"]
    assert "deepspeed 0.18.9 is installed" in refused["deepspeed"]
    assert "megatron-core 0.15.3 is installed" in refused["megatron"]
