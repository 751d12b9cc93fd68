"""The shape of the code: what may import what, and how long a file or function may grow.

The package reads top-down — ``core`` (the plan, as data) -> ``kernels`` -> ``runtime`` (executors over
process groups) -> ``integrations`` (framework adapters) — with ``sim`` (the cost model) beside the runtime,
never under it. The rules are checked on the source (every ``import``, module-level or inside a function)
and, for what is loaded at import time, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("hf", "deepspeed", "megatron")

# Package -> the mesh_cp packages its modules may import at module level (its own always allowed).
MODULE_LEVEL = {
    "mesh_cp.core": set(),
    "mesh_cp.kernels": {"mesh_cp.core"},
    "mesh_cp.runtime": {"mesh_cp.core", "mesh_cp.kernels"},
    "mesh_cp.sim": {"mesh_cp.core"},
    "mesh_cp.config": {"mesh_cp.core"},
    "mesh_cp.auto": {"mesh_cp.core", "mesh_cp.sim", "mesh_cp.runtime"},
    "mesh_cp.debug": set(),
    "mesh_cp.cli": {"mesh_cp.core", "mesh_cp.sim"},
    "mesh_cp.testing": set(),
    "mesh_cp.integrations": {"mesh_cp.core", "mesh_cp.runtime", "mesh_cp.config"},
    **{
        f"mesh_cp.integrations.{name}": {"mesh_cp", "mesh_cp.core", "mesh_cp.runtime", "mesh_cp.config", "mesh_cp.sim"}
        | {"mesh_cp.integrations"}
        for name in ADAPTERS
    },
}
# What a function may import lazily beyond that (the one place each is needed).
LAZY = {
    "mesh_cp.config": {"mesh_cp.sim"},  # a topology preset name is checked
    "mesh_cp.testing": {"mesh_cp.kernels"},  # the bytes counter leaves the block kernels and fused passes uncounted
    # switch_attention of a transformers model; a config block's topology goes through the cost model
    "mesh_cp.integrations": {"mesh_cp.integrations.hf", "mesh_cp.auto"},
    **{f"mesh_cp.integrations.{name}": {"mesh_cp.auto"} for name in ADAPTERS},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "integrations":
        parts = ["mesh_cp", *parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[tuple[str, Path]]:
    for folder in ("mesh_cp", "integrations"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield module_name(path), path


def imports(path: Path) -> Iterator[tuple[str, bool]]:
    """Every ``mesh_cp`` name imported by ``path`` (module, or ``module.name`` for ``from module import name``),
    and whether at module level. ``if TYPE_CHECKING:`` blocks are left out: they never run."""
    tree = ast.parse(path.read_text())
    in_function: set[int] = set()
    never_run: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            never_run |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in never_run:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "mesh_cp" or name.startswith("mesh_cp."):
                yield name, id(node) not in in_function


def package_of(module: str) -> str:
    """The layer a module belongs to: ``mesh_cp.<sub>`` or ``mesh_cp.integrations[.<adapter>]``."""
    parts = module.split(".")
    if parts[:2] == ["mesh_cp", "integrations"]:
        return ".".join(parts[:3]) if len(parts) > 2 and parts[2] in ADAPTERS else "mesh_cp.integrations"
    return ".".join(parts[:2])


def known(name: str, modules: set[str]) -> str | None:
    """The module ``name`` refers to (``from pkg import sub`` names a module; ``from mod import fn`` does not)."""
    return name if name in modules else None


def test_every_import_follows_the_layers() -> None:
    modules = {name for name, _ in sources()} | {"mesh_cp"}
    wrong = []
    for name, path in sources():
        own = package_of(name)
        if own == "mesh_cp":
            continue  # the package root loads public names lazily by module path
        allowed = MODULE_LEVEL[own] | {own}
        for target, module_level in imports(path):
            target = known(target, modules)
            if target is None:
                continue
            layer = package_of(target) if target != "mesh_cp" else "mesh_cp"
            if layer in allowed or (not module_level and (layer in LAZY.get(own, ()) or target in LAZY.get(own, ()))):
                continue
            wrong.append(f"{path.relative_to(ROOT)}: {'module-level ' if module_level else ''}import of {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_adapter_imports_another() -> None:
    wrong = []
    for name, path in sources():
        own = package_of(name)
        if own.removeprefix("mesh_cp.integrations.") not in ADAPTERS:
            continue
        for target, _ in imports(path):
            other = package_of(target)
            if other.removeprefix("mesh_cp.integrations.") in ADAPTERS and other != own:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, at module level or inside a function (``from package import name``
    counts as importing ``package``, whose ``__init__`` runs)."""
    modules = {name for name, _ in sources()}

    def module_of(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    return {name: {module_of(t) for t, _ in imports(path)} - {None, name} for name, path in sources()}


def test_no_import_cycles() -> None:
    """No module reaches itself through imports, lazy ones (inside functions) included: a lazy import that closes a
    circle is a back-arrow, whatever the import order hides."""
    graph = import_graph()
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(node) :], node]))
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, [*stack, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_runtime_never_imports_the_cost_model() -> None:
    """The runtime runs plans; the cost model chooses them (mesh_cp.auto is the one door between the two)."""
    graph = import_graph()
    wrong = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if package_of(name) == "mesh_cp.runtime"
        for target in targets
        if package_of(target) in ("mesh_cp.sim", "mesh_cp.auto")
    ]
    assert not wrong, "\n".join(wrong)


def test_what_each_layer_loads_at_import_time() -> None:
    """In a fresh interpreter: the plan and the cost model load no torch.distributed (the cost model no torch at
    all), and the runtime loads neither the cost model nor the test helpers."""
    checks = {
        "mesh_cp.core, mesh_cp.sim, mesh_cp.cli": "m.startswith('torch.distributed')",
        "mesh_cp.sim, mesh_cp.config": "m == 'torch'",
        "mesh_cp.runtime, mesh_cp.kernels": "m.startswith(('mesh_cp.sim', 'mesh_cp.testing', 'mesh_cp.integrations'))",
    }
    for modules, forbidden in checks.items():
        code = f"import sys, {modules}; bad = sorted(m for m in sys.modules if {forbidden}); assert not bad, bad"
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, f"importing {modules} loaded: {run.stderr.strip().splitlines()[-1]}"


def _too_long(path: Path, most: int) -> Iterator[str]:
    """Functions of ``path`` whose code (the docstring, which is their spec, aside) is over ``most`` lines."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines -= first.end_lineno - first.lineno + 1
            if lines > most:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {lines} lines of code"


def test_files_and_functions_stay_small() -> None:
    """No file over 400 lines in the library or the adapters; no function over 60 lines of code in them."""
    paths = [path for _, path in sources()]
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in paths if (n := len(p.read_text().splitlines())) > 400]
    long_functions = [line for p in paths for line in _too_long(p, 60)]
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)
