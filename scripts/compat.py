"""Compatibility run: the Hugging Face tests on the oldest supported and the newest released transformers, accelerate
and trl; the Megatron tests on the newest megatron-core under Python 3.12.

For each version set: a fresh virtualenv under ``--root`` (``/tmp/mesh_cp_compat/<set>``), ``pip install -e
<repo>[dev]`` with the set's versions forced by a generated constraints file (torch stays at the CPU wheel's
:data:`TORCH` pin, every other package floats), the versions actually installed (``importlib.metadata`` in that
virtualenv), then ``python -m pytest -q <HF subset>`` from the repository root. Prints a markdown table (set,
versions, result, seconds) and, with ``--write``, replaces the section of a doc between :data:`MARK_START` and
:data:`MARK_END` with it. Exit status 1 if any set fails (install or tests), 2 for a usage error.

``oldest`` is :data:`OLDEST`, the lower bounds of ``pyproject.toml``'s extras (a test keeps the two equal);
``newest`` pins none of the three, so pip resolves the newest releases of the day. ``--set NAME=PKG==VER,...``
adds a set of one's own (bisecting a lower bound)::

    .venv/bin/python scripts/compat.py --sets oldest,newest --write docs/compat.md
    .venv/bin/python scripts/compat.py --set t515=transformers==5.15.1 --sets t515 --tests "-x tests/integrations/hf"

The Megatron sets (:data:`MEGATRON_SETS`: ``megatron-newest`` pins nothing, so pip takes the newest megatron-core
release; ``megatron-oldest`` the oldest supported, 0.16.1; ``megatron-0.18`` the first release whose
``get_batch_on_this_cp_rank`` takes ``is_hybrid_cp``; a ``--set`` pinning
``megatron-core`` is one too) are made from a Python 3.12 interpreter (megatron-core 0.17 and later need it; ``torch``
is then PyPI's CUDA build, which runs on the CPU), install ``repo[megatron]`` with pytest and numpy, run
``tests/integrations/megatron`` and fill their own table (between :data:`MEGATRON.marks`)::

    .venv/bin/python scripts/compat.py --sets megatron-oldest,megatron-0.18,megatron-newest --write docs/compat.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]

PACKAGES: tuple[str, ...] = ("transformers", "accelerate", "trl")
"""The packages whose versions a set fixes (the others float)."""

OLDEST: dict[str, str] = {"transformers": "5.16.0", "accelerate": "1.12.0", "trl": "1.16.0"}
"""The oldest supported versions: ``pyproject.toml``'s lower bounds (``transformers>=``, ``accelerate>=``,
``trl>=``) must equal these (tests/scripts/test_compat.py)."""

SETS: dict[str, dict[str, str]] = {"oldest": OLDEST, "newest": {}}
"""Named version sets: package -> exact version; a package left out takes the newest release pip resolves."""

TORCH = "torch==2.13.0"
"""Every set's torch: the CPU wheel of constraints-cpu.txt (a looser pin resolves to a multi-GB CUDA build)."""

MEGATRON_PACKAGE = "megatron-core"


@dataclass(frozen=True, kw_only=True)
class Family:
    """What the sets of one family share: the packages they pin, how they install, which tests and table."""

    packages: tuple[str, ...]
    """The packages a set of the family may pin (each a column of the table)."""
    requirements: tuple[str, ...]
    """What ``pip install`` is given beside ``-e``: ``{repo}`` is the repository."""
    tests: tuple[str, ...]
    """The default pytest arguments (a folder that does not exist is left out)."""
    marks: tuple[str, str]
    """The lines of the doc between which ``--write`` puts the family's table."""
    python: str | None = None
    """The interpreter version of its virtualenvs (``"3.12"``, found by :func:`find_python`); ``None``: ``--python``."""


MEGATRON = Family(
    packages=(MEGATRON_PACKAGE,),
    requirements=("{repo}[megatron]", "pytest>=8", "numpy"),
    tests=("tests/integrations/megatron",),
    marks=(
        "<!-- compat-megatron-table:start (written by scripts/compat.py --write) -->",
        "<!-- compat-megatron-table:end -->",
    ),
    python="3.12",
)
"""megatron-core 0.17 and later need Python 3.12 (``Requires-Python >=3.12``)."""

MEGATRON_SETS: dict[str, dict[str, str]] = {
    "megatron-oldest": {MEGATRON_PACKAGE: "0.16.1"},
    "megatron-0.18": {MEGATRON_PACKAGE: "0.18.2"},
    "megatron-newest": {},
}
"""The Megatron sets: the oldest supported release (CI's, there on Python 3.11), 0.18 (the first with
``is_hybrid_cp``) and the newest release."""

DEFAULT_ROOT = Path("/tmp/mesh_cp_compat")
DEFAULT_TESTS: tuple[str, ...] = ("tests/integrations/hf", "tests/integrations/accelerate", "tests/integrations/trl")
"""The Hugging Face subset (a folder that does not exist is left out)."""

TEST_TIMEOUT_S = 3600
"""The pytest run of one set is stopped after this many seconds (``--timeout``)."""

MARK_START = "<!-- compat-table:start (written by scripts/compat.py --write) -->"
MARK_END = "<!-- compat-table:end -->"

HF = Family(
    packages=PACKAGES, requirements=("{repo}[dev]",), tests=DEFAULT_TESTS, marks=(MARK_START, MARK_END), python=None
)
"""The Hugging Face sets (:data:`SETS`)."""


def family_of(pins: Mapping[str, str], name: str = "") -> Family:
    """:data:`MEGATRON` for a Megatron set (built-in, or pinning megatron-core), else :data:`HF`."""
    return MEGATRON if name in MEGATRON_SETS or MEGATRON_PACKAGE in pins else HF


def find_python(version: str) -> str:
    """An interpreter of ``version`` (``"3.12"``): ``python3.12`` where it runs, else pyenv's newest ``3.12.x``."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(pyenv.glob(f"{version}.*"), key=lambda p: Version(p.name), reverse=True) if pyenv.is_dir() else []
    for candidate in [f"python{version}", *(str(p / "bin" / f"python{version}") for p in found)]:
        path = shutil.which(candidate)
        if path and subprocess.run([path, "-c", "pass"], capture_output=True).returncode == 0:
            return path
    raise ValueError(f"no Python {version} found (python{version} on PATH or pyenv's {pyenv}/{version}.*); install one")


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")


@dataclass
class Result:
    """One set's run: versions installed, pytest's counts, seconds, and why it failed (``None``: it passed)."""

    name: str
    versions: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    install_s: float = 0.0
    tests_s: float = 0.0
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def constraints(pins: Mapping[str, str], packages: Sequence[str] = PACKAGES) -> str:
    """The pip constraints file of a set: its exact versions and :data:`TORCH`."""
    unknown = sorted(set(pins) - set(packages))
    if unknown:
        raise ValueError(f"a set pins {unknown}; only {list(packages)} are fixed per set (the rest floats)")
    lines = [f"{name}=={pins[name]}" for name in packages if name in pins]
    return "\n".join([*lines, TORCH]) + "\n"


def parse_set(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME=PKG==VER[,PKG==VER...]`` (``--set``) -> ``(NAME, {PKG: VER})``; a package left out floats."""
    name, sep, body = spec.partition("=")
    if not sep or body.startswith("=") or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"--set {spec!r}: expected NAME=PKG==VER[,PKG==VER...], e.g. t515=transformers==5.15.1")
    if name in SETS or name in MEGATRON_SETS:
        builtin = ", ".join([*SETS, *MEGATRON_SETS])
        raise ValueError(f"--set {spec!r}: {name!r} is a built-in set ({builtin}); give the set another name")
    pins: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        package, eq, version = item.partition("==")
        if not eq or package not in (*PACKAGES, MEGATRON_PACKAGE):
            raise ValueError(
                f"--set {spec!r}: {item!r} is not PKG==VER with PKG one of {[*PACKAGES, MEGATRON_PACKAGE]}"
            )
        try:
            Version(version)
        except InvalidVersion:
            raise ValueError(f"--set {spec!r}: {version!r} is not a version; write e.g. {package}==1.2.0") from None
        if package in pins:
            raise ValueError(f"--set {spec!r}: {package} is pinned twice; keep one {package}==VER")
        pins[package] = version
    if MEGATRON_PACKAGE in pins and len(pins) > 1:
        raise ValueError(f"--set {spec!r}: a set pins {MEGATRON_PACKAGE} alone (its tests need none of {PACKAGES})")
    return name, pins


def default_tests(repo: Path, family: Family = HF) -> list[str]:
    """The folders of the family's tests (:data:`DEFAULT_TESTS` for :data:`HF`) that exist in ``repo``."""
    return [path for path in family.tests if (repo / path).is_dir()]


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's final counts (``passed``, ``failed``, ``skipped``, ``errors``, ...) from its output; ``{}`` if it
    printed no summary line."""
    for line in reversed(output.splitlines()):
        found = _COUNT.findall(line)
        if found and re.search(r"\bin [\d.]+s\b", line):
            counts: dict[str, int] = {}
            for n, kind in found:
                kind = "errors" if kind.startswith("error") else kind
                counts[kind] = counts.get(kind, 0) + int(n)
            return counts
    return {}


def result_text(result: Result) -> str:
    """``pass: N passed, M failed, K skipped`` (errors and x-results only when there are some), or ``FAIL: ...``
    with the counts, if pytest printed them, and the reason."""
    c = result.counts
    shown = f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped"
    extra = [f"{c[k]} {k}" for k in ("errors", "xfailed", "xpassed") if c.get(k)]
    shown = ", ".join([shown, *extra])
    if result.ok:
        return f"pass: {shown}"
    return f"FAIL: {shown} ({result.failure})" if c else f"FAIL: {result.failure}"


def render_table(results: Sequence[Result], family: Family = HF) -> str:
    """The markdown table of ``results`` (a Megatron table has a ``python`` column: its interpreter differs)."""
    shown = (*family.packages, "python", "torch") if family.python else (*family.packages, "torch")
    head = ["set", *shown, "result", "install s", "tests s"]
    rows = [
        [
            r.name,
            *(r.versions.get(p, "-") for p in shown),
            result_text(r),
            f"{r.install_s:.0f}",
            f"{r.tests_s:.0f}",
        ]
        for r in results
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def section(
    results: Sequence[Result], tests: Sequence[str], when: datetime.date | None = None, family: Family = HF
) -> str:
    """What ``--write`` puts between the family's markers: the table and how it was made."""
    when = when or datetime.date.today()
    python = family.python or ".".join(platform.python_version_tuple()[:2])
    return (
        render_table(results, family)
        + f"\nRun {when.isoformat()} on Python {python}, {platform.system()} {platform.machine()}, CPU only: "
        + f"`python -m pytest -q {' '.join(tests)}` in each set's virtualenv.\n"
    )


def replace_section(doc: str, body: str, path: str = "the doc", marks: tuple[str, str] = (MARK_START, MARK_END)) -> str:
    """``doc`` with the text between ``marks`` (default :data:`MARK_START` and :data:`MARK_END`) replaced by
    ``body``."""
    mark_start, mark_end = marks
    start, end = doc.find(mark_start), doc.find(mark_end)
    if start < 0 or end < 0 or end < start or doc.count(mark_start) != 1 or doc.count(mark_end) != 1:
        raise ValueError(
            f"{path} must hold one {mark_start!r} line followed by one {mark_end!r} line around the table; add them"
        )
    return doc[: start + len(mark_start)] + "\n" + body.strip("\n") + "\n" + doc[end:]


def _log(name: str, message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] [{name}] {message}", flush=True)


def _run_logged(cmd: Sequence[str], log: Path, *, cwd: Path, env: Mapping[str, str], echo: bool, timeout: float) -> int:
    """Run ``cmd`` with its output in ``log`` (and on stdout as it comes if ``echo``); its exit status, 124 when it
    ran past ``timeout`` seconds (then its whole process group is killed)."""
    with log.open("wb") as out:
        out.write(("$ " + shlex.join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            assert proc.stdout is not None
            while chunk := os.read(proc.stdout.fileno(), 65536):
                out.write(chunk)
                out.flush()
                if echo:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
            status = proc.wait()
        finally:
            timer.cancel()
        if expired.is_set():
            out.write(f"\nstopped after {timeout:.0f}s\n".encode())
            return 124
    return status


def _tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def run_set(
    name: str,
    pins: Mapping[str, str],
    *,
    root: Path,
    repo: Path,
    tests: Sequence[str],
    python: str,
    reuse: bool,
    timeout: float,
    family: Family = HF,
) -> Result:
    """Install the family's requirements (``repo[dev]`` for :data:`HF`) with ``pins`` in ``root/name`` and run
    ``tests`` there."""
    result = Result(name)
    venv = root / name
    vpy = venv / "bin" / "python"
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    # A set of one's own may go below the floors: mesh_cp then warns instead of refusing (integrations/versions.py).
    if name not in SETS and name not in MEGATRON_SETS:
        env["MESH_CP_ALLOW_UNSUPPORTED"] = "1"
    started = time.monotonic()
    if not (reuse and vpy.exists()):
        _log(name, f"creating the virtualenv {venv}")
        subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    cons = venv / "constraints.txt"
    cons.write_text(constraints(pins, family.packages))
    install_log = venv / "install.log"
    editable, *others = (r.format(repo=repo) for r in family.requirements)
    # The pinned packages named as well: --upgrade moves a reused virtualenv's copies to the set's versions (or the
    # newest).
    cmd = [str(vpy), "-m", "pip", "install", "-c", str(cons), "-e", editable, *others, "--upgrade", *family.packages]
    _log(name, f"pip install ({', '.join(cons.read_text().split())}), log {install_log}")
    status = _run_logged(cmd, install_log, cwd=repo, env=env, echo=False, timeout=timeout)
    result.install_s = time.monotonic() - started
    if status != 0:
        _log(name, f"pip install failed (exit {status}) after {result.install_s:.0f}s:\n{_tail(install_log)}")
        result.failure = f"install failed (exit {status})"
        return result
    probe = (
        "import importlib.metadata as m, json, platform, sys; "
        "print(json.dumps({'python': platform.python_version(), **{p: m.version(p) for p in sys.argv[1:]}}))"
    )
    shown = subprocess.run(
        [str(vpy), "-c", probe, *family.packages, "torch"], capture_output=True, text=True, check=True
    )
    result.versions = json.loads(shown.stdout)
    _log(name, f"installed in {result.install_s:.0f}s: " + ", ".join(f"{k} {v}" for k, v in result.versions.items()))
    wrong = {p: (v, result.versions[p]) for p, v in pins.items() if result.versions[p] != v}
    if wrong:
        result.failure = f"pip installed {wrong} (wanted, got)"
        return result
    test_log = venv / "pytest.log"
    cmd = [str(vpy), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    _log(name, f"{shlex.join(cmd[1:])} (log {test_log})")
    started = time.monotonic()
    status = _run_logged(cmd, test_log, cwd=repo, env=env, echo=True, timeout=timeout)
    result.tests_s = time.monotonic() - started
    result.counts = pytest_counts(test_log.read_text(errors="replace"))
    if status == 124:
        result.failure = f"tests stopped after {timeout:.0f}s"
    elif status != 0:
        result.failure = f"pytest exit {status}"
    _log(name, f"{result_text(result)} in {result.tests_s:.0f}s")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="oldest,newest", help="comma-separated set names (default oldest,newest)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=PKG==VER,...", help="define a set")
    parser.add_argument("--tests", help="pytest arguments in place of each family's subset (one string, shell-quoted)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"virtualenvs' folder (default {DEFAULT_ROOT})")
    parser.add_argument("--write", type=Path, help="rewrite the table sections of this markdown file")
    parser.add_argument("--python", default=sys.executable, help="interpreter the HF virtualenvs are made from")
    parser.add_argument(
        "--megatron-python",
        help=f"interpreter the Megatron virtualenvs are made from (default: Python {MEGATRON.python})",
    )
    parser.add_argument("--reuse", action="store_true", help="keep an existing virtualenv (pip still runs)")
    parser.add_argument("--timeout", type=float, default=TEST_TIMEOUT_S, help="seconds for one set's install or tests")
    parser.add_argument(
        "--dry-run", action="store_true", help="print each set's constraints and the tests, run nothing"
    )
    args = parser.parse_args(argv)
    try:
        sets = {name: dict(pins) for name, pins in (SETS | MEGATRON_SETS).items()}
        sets.update(parse_set(spec) for spec in args.set)
        names = [n.strip() for n in args.sets.split(",") if n.strip()]
        missing = [n for n in names if n not in sets]
        if missing or not names:
            problem = f"unknown set(s) {missing}" if missing else "no set named"
            raise ValueError(f"--sets {args.sets!r}: {problem}; known: {sorted(sets)} (define one with --set)")
        families: dict[Family, list[str]] = {}
        for name in names:
            families.setdefault(family_of(sets[name], name), []).append(name)
        if args.write is not None:
            if not args.write.is_file():
                raise ValueError(
                    f"--write {args.write}: no such file; create it with the lines {MARK_START} and {MARK_END}"
                )
            for family in families:  # the markers are there before any run
                replace_section(args.write.read_text(), "", str(args.write), family.marks)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    failed = []
    for family, members in families.items():
        tests = shlex.split(args.tests) if args.tests is not None else default_tests(ROOT, family)
        if args.dry_run:
            python = f"Python {family.python}" if family.python else args.python
            for name in members:
                print(f"[{name}] {python}, constraints:\n{constraints(sets[name], family.packages)}", end="")
            print(f"tests: {shlex.join(tests)}")
            continue
        python = args.python if family.python is None else (args.megatron_python or find_python(family.python))
        args.root.mkdir(parents=True, exist_ok=True)
        results = [
            run_set(
                name,
                sets[name],
                root=args.root,
                repo=ROOT,
                tests=tests,
                python=python,
                reuse=args.reuse,
                timeout=args.timeout,
                family=family,
            )
            for name in members
        ]
        print("\n" + render_table(results, family), end="")
        if args.write is not None:
            body = section(results, tests, family=family)
            args.write.write_text(replace_section(args.write.read_text(), body, str(args.write), family.marks))
            print(f"wrote the table to {args.write}")
        failed += [r.name for r in results if not r.ok]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
