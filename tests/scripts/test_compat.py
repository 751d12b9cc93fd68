"""``scripts/compat.py`` without installing anything: ``pyproject.toml``'s lower bounds are its ``OLDEST``,
``constraints-cpu.txt`` pins the versions installed here, and its parsing and rendering helpers (``--set``
specs, pytest's summary line, the table and the doc section between the markers).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compat.py"


def load_compat():
    spec = importlib.util.spec_from_file_location("compat_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


compat = load_compat()


def lower_bounds() -> dict[str, list[tuple[str, Version]]]:
    """``pyproject.toml``'s optional dependencies on the packages of a set: package -> [(extra, lower bound)]."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds: dict[str, list[tuple[str, Version]]] = {}
    for extra, requirements in extras.items():
        for text in requirements:
            req = Requirement(text)
            if req.name in compat.PACKAGES:
                lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
                assert len(lows) == 1, f"[{extra}] {text!r}: expected one '>=' bound"
                bounds.setdefault(req.name, []).append((extra, lows[0]))
    return bounds


def test_pyproject_lower_bounds_are_oldest() -> None:
    bounds = lower_bounds()
    assert set(bounds) == set(compat.PACKAGES) == set(compat.OLDEST)
    for package, found in bounds.items():
        for extra, low in found:
            assert low == Version(compat.OLDEST[package]), (
                f"pyproject.toml [{extra}] {package}>={low}, scripts/compat.py OLDEST {compat.OLDEST[package]}"
            )


def test_trl_extra_and_dev_install_trl() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("trl", "dev"):
        assert {Requirement(r).name for r in extras[extra]} >= set(compat.PACKAGES), extra


def constraint_pins() -> dict[str, Requirement]:
    """Package name (lower case) -> its pin in constraints-cpu.txt."""
    pins = {}
    for line in (ROOT / "constraints-cpu.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower()] = req
    return pins


def test_constraints_cpu_pins_the_installed_versions() -> None:
    pins = {name: req.specifier for name, req in constraint_pins().items()}
    for package in (*compat.PACKAGES, "torch"):
        assert package in pins, f"constraints-cpu.txt pins no {package}"
        installed = importlib.metadata.version(package)
        assert Version(installed) in pins[package], f"{package}: installed {installed}, pinned {pins[package]}"
    assert str(pins["torch"]) == compat.TORCH.removeprefix("torch")


def test_parse_set() -> None:
    assert compat.parse_set("t53=transformers==5.3.0") == ("t53", {"transformers": "5.3.0"})
    assert compat.parse_set("mix=trl==1.2.0, accelerate==1.5.0") == ("mix", {"trl": "1.2.0", "accelerate": "1.5.0"})
    assert compat.parse_set("floating=") == ("floating", {})


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("transformers==5.3.0", "NAME=PKG==VER"),
        ("bad name=trl==1.0.0", "NAME=PKG==VER"),
        ("=trl==1.0.0", "NAME=PKG==VER"),
        ("x=torch==2.13.0", "'torch==2.13.0'"),
        ("x=trl>=1.0.0", "'trl>=1.0.0'"),
        ("x=trl==", "'' is not a version"),
        ("x=trl==one", "'one' is not a version; write e.g. trl==1.2.0"),
        ("x=trl==1.0.0,trl==1.1.0", "trl is pinned twice"),
        ("oldest=trl==1.1.0", "'oldest' is a built-in set"),
    ],
)
def test_parse_set_errors_name_the_spec(spec: str, named: str) -> None:
    with pytest.raises(ValueError) as err:
        compat.parse_set(spec)
    assert repr(spec) in str(err.value) and named in str(err.value)


def test_constraints_file() -> None:
    assert compat.constraints({"trl": "1.0.0", "transformers": "5.0.0"}) == (
        f"transformers==5.0.0\ntrl==1.0.0\n{compat.TORCH}\n"
    )
    assert compat.constraints({}) == f"{compat.TORCH}\n"
    with pytest.raises(ValueError, match="numpy"):
        compat.constraints({"numpy": "2.0"})


@pytest.mark.parametrize(
    ("output", "counts"),
    [
        ("....\n21 passed in 301.52s (0:05:01)\n", {"passed": 21}),
        (
            "F.s\nFAILED tests/a.py::test_x - 3 passed\n1 failed, 19 passed, 1 skipped, 2 errors in 12.00s\n",
            {"failed": 1, "passed": 19, "skipped": 1, "errors": 2},
        ),
        ("= 1 error in 0.50s =\n", {"errors": 1}),
        ("2 passed, 1 xfailed, 1 warning in 3.1s\n", {"passed": 2, "xfailed": 1}),
        ("ImportError while loading conftest\n", {}),
    ],
)
def test_pytest_counts(output: str, counts: dict[str, int]) -> None:
    assert compat.pytest_counts(output) == counts


def test_render_table() -> None:
    versions = {"transformers": "5.0.0", "accelerate": "1.4.0", "trl": "1.0.0", "torch": "2.13.0+cpu"}
    passed = compat.Result("oldest", versions, {"passed": 20, "skipped": 1}, install_s=80.4, tests_s=301.6)
    broken = compat.Result("t53", failure="install failed (exit 1)", install_s=12)
    failed = compat.Result("newest", versions, {"passed": 19, "failed": 2}, 1, 2, failure="pytest exit 1")
    lines = compat.render_table([passed, broken, failed]).splitlines()
    assert lines[0] == "| set | transformers | accelerate | trl | torch | result | install s | tests s |"
    assert lines[1] == "|---|---|---|---|---|---|---|---|"
    assert (
        lines[2] == "| oldest | 5.0.0 | 1.4.0 | 1.0.0 | 2.13.0+cpu | pass: 20 passed, 0 failed, 1 skipped | 80 | 302 |"
    )
    assert lines[3] == "| t53 | - | - | - | - | FAIL: install failed (exit 1) | 12 | 0 |"
    assert lines[4].startswith("| newest |") and "| FAIL: 19 passed, 2 failed, 0 skipped (pytest exit 1) |" in lines[4]
    assert len(lines) == 5


def test_replace_section() -> None:
    doc = f"# Title\n\ntext\n{compat.MARK_START}\nold table\n{compat.MARK_END}\nafter\n"
    new = compat.replace_section(doc, "\n| new |\n\n")
    assert new == f"# Title\n\ntext\n{compat.MARK_START}\n| new |\n{compat.MARK_END}\nafter\n"
    assert compat.replace_section(new, "| new |") == new


def test_section_says_how_it_was_made() -> None:
    body = compat.section([compat.Result("newest")], ["tests/integrations/hf"], datetime.date(2026, 1, 2))
    assert body.startswith("| set |")
    assert "Run 2026-01-02 on Python" in body and "`python -m pytest -q tests/integrations/hf`" in body


@pytest.mark.parametrize(
    "doc",
    [
        "# no markers\n",
        f"{compat.MARK_START}\nonly the start\n",
        f"{compat.MARK_END}\nend before start\n{compat.MARK_START}\n",
        f"{compat.MARK_START}\n{compat.MARK_END}\n{compat.MARK_START}\n{compat.MARK_END}\n",
    ],
)
def test_replace_section_without_markers_is_a_clear_error(doc: str) -> None:
    with pytest.raises(ValueError, match="docs/x.md must hold one .*compat-table:start.*; add them"):
        compat.replace_section(doc, "| new |", "docs/x.md")


def test_usage_errors_exit_2_before_any_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "venvs"
    for argv, message in [
        (["--sets", "oldest,nope"], "unknown set(s) ['nope']"),
        (
            ["--sets", " , "],
            "no set named; known: ['megatron-0.18', 'megatron-newest', 'megatron-oldest', 'newest', 'oldest']",
        ),
        (["--set", "x=numpy==2.0"], "'numpy==2.0' is not PKG==VER"),
        (["--write", str(tmp_path / "missing.md")], "missing.md: no such file; create it with the lines"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            compat.main([*argv, "--root", str(root)])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    (tmp_path / "plain.md").write_text("# no markers\n")
    with pytest.raises(SystemExit):
        compat.main(["--write", str(tmp_path / "plain.md"), "--root", str(root)])
    assert "must hold one" in capsys.readouterr().err
    assert not root.exists()


def test_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert compat.main(["--sets", "oldest,t53", "--set", "t53=transformers==5.3.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    oldest = "".join(f"{p}=={compat.OLDEST[p]}\n" for p in compat.PACKAGES)
    assert f"[oldest] {sys.executable}, constraints:\n{oldest}{compat.TORCH}\n" in out
    assert f"[t53] {sys.executable}, constraints:\ntransformers==5.3.0\n{compat.TORCH}\n" in out
    assert "tests: tests/integrations/hf" in out


def test_megatron_sets_run_the_megatron_tests_under_python_312(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sets", "megatron-newest,m18", "--set", "m18=megatron-core==0.18.2", "--dry-run"]
    assert compat.main(argv) == 0
    out = capsys.readouterr().out
    assert f"[megatron-newest] Python 3.12, constraints:\n{compat.TORCH}\n" in out
    assert f"[m18] Python 3.12, constraints:\nmegatron-core==0.18.2\n{compat.TORCH}\n" in out
    assert out.rstrip().endswith("tests: tests/integrations/megatron")
    assert compat.MEGATRON.requirements[0] == "{repo}[megatron]"
    with pytest.raises(ValueError, match="pins megatron-core alone"):
        compat.parse_set("mix=megatron-core==0.19.2,trl==1.16.0")


def test_megatron_table_has_its_own_markers_and_a_python_column() -> None:
    versions = {"megatron-core": "0.19.2", "python": "3.12.1", "torch": "2.13.0"}
    result = compat.Result("megatron-newest", versions, {"passed": 12})
    lines = compat.render_table([result], compat.MEGATRON).splitlines()
    assert lines[0] == "| set | megatron-core | python | torch | result | install s | tests s |"
    assert lines[2] == "| megatron-newest | 0.19.2 | 3.12.1 | 2.13.0 | pass: 12 passed, 0 failed, 0 skipped | 0 | 0 |"
    hf_start, hf_end = compat.MARK_START, compat.MARK_END
    start, end = compat.MEGATRON.marks
    doc = f"{hf_start}\nHF\n{hf_end}\n{start}\nold\n{end}\n"
    body = compat.section([result], ["tests/integrations/megatron"], datetime.date(2026, 1, 2), compat.MEGATRON)
    new = compat.replace_section(doc, body, marks=compat.MEGATRON.marks)
    assert new.startswith(f"{hf_start}\nHF\n{hf_end}\n") and "Run 2026-01-02 on Python 3.12" in new


def test_own_sets_run_with_unsupported_versions_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set of one's own (bisecting below a floor) runs its tests with MESH_CP_ALLOW_UNSUPPORTED=1, so that importing
    the adapters warns instead of refusing; the built-in sets run as a user's install does."""
    from mesh_cp.integrations.versions import ALLOW_UNSUPPORTED

    seen = {}

    def run_logged(cmd, log: Path, *, cwd, env, echo, timeout) -> int:
        seen[log.parent.name] = env.get(ALLOW_UNSUPPORTED)
        log.write_text("")
        return 1  # the install "fails": nothing more runs

    monkeypatch.setattr(compat, "_run_logged", run_logged)
    monkeypatch.delenv(ALLOW_UNSUPPORTED, raising=False)
    for name, pins in (("oldest", compat.OLDEST), ("t515", {"transformers": "5.15.1"})):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin" / "python").touch()
        result = compat.run_set(
            name, pins, root=tmp_path, repo=ROOT, tests=[], python=sys.executable, reuse=True, timeout=1
        )
        assert result.failure == "install failed (exit 1)"
    assert seen == {"oldest": None, "t515": "1"}
