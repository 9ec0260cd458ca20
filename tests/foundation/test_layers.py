"""The package layering, checked by static analysis of every import (module- and function-level).

proto ← services/runtime ← services/lib ← services/tasks ← each service (trainer, rollout, judge,
sandbox, weightsync, echo, tracker, teacher) ← services/launcher. A layer imports only from itself and the layers to
its left; services do not import one another; there are no cycles between packages, nor between the
modules of the packages in ``NO_MODULE_CYCLES``.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("trainer", "rollout", "judge", "sandbox", "weightsync", "echo", "tracker", "teacher")
LAYERS = ("proto", "runtime", "lib", "tasks")
NODES = (*LAYERS, *SERVICES, "launcher")
NO_MODULE_CYCLES = ("services/trainer",)  # packages whose modules import one another without a cycle

# what each node may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "proto": set(),
    "runtime": {"proto"},
    "lib": {"proto", "runtime"},
    "tasks": {"proto", "runtime", "lib"},
    **{s: {"proto", "runtime", "lib", "tasks"} for s in SERVICES},
    "launcher": set(NODES),
}


def node_of_module(module: str) -> str | None:
    """The package node a dotted module name belongs to (None: outside proto/ and services/)."""
    parts = module.split(".")
    if parts[0] == "proto":
        return "proto"
    if parts[0] == "services":
        if len(parts) == 1:
            return "services"  # the bare namespace: belongs to no layer
        return parts[1]
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth (functions included),
    plus ``importlib.import_module("...")`` with a literal name."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            # `from services import trainer` imports the package services.trainer
            found += [(node.lineno, f"{mod}.{alias.name}" if mod in ("services", "proto") else mod)
                      for alias in node.names]
        elif isinstance(node, ast.Call) and _called_name(node) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``from <module> import ...`` reads from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")  # relative: resolve against this file's package
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_imports(path: Path, source: str | None = None) -> set[str]:
    """The modules the file imports, at any depth; unlike :func:`imported_modules` (which names the package),
    ``from services.trainer import checkpoint`` counts as importing ``services.trainer.checkpoint``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = {mod for _, mod in imported_modules(path, source)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            found |= {f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")}
    return found


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else None


def source_files() -> list[Path]:
    files = sorted((REPO / "proto").rglob("*.py")) + sorted((REPO / "services").rglob("*.py"))
    return [p for p in files if "__pycache__" not in p.parts]


def import_edges() -> list[tuple[str, str, str]]:
    """(importing node, imported node, "file:line") for every import between proto/services packages."""
    edges = []
    for path in source_files():
        src = node_of_module(module_name(path))
        for line, mod in imported_modules(path):
            dst = node_of_module(mod)
            if dst is not None:
                edges.append((src, dst, f"{path.relative_to(REPO)}:{line} imports {mod}"))
    return edges


def test_every_file_belongs_to_a_known_layer():
    unknown = sorted({f"{src} ({where})" for src, dst, where in import_edges() for n in (src, dst)
                      if n not in NODES and n != "services"})
    assert not unknown, ("a package outside the layering (add it to NODES/ALLOWED in this test): "
                         + "; ".join(unknown))
    files = {node_of_module(module_name(p)) for p in source_files()}
    assert files <= {*NODES, "services"}, files - {*NODES, "services"}
    assert {"proto", "runtime", "lib", "tasks", "launcher", *SERVICES} <= files


def test_imports_respect_the_layers():
    violations = [f"{where}  ({src} may import only {sorted(ALLOWED[src]) or 'nothing'})"
                  for src, dst, where in import_edges()
                  if src in ALLOWED and dst != src and dst not in ALLOWED[src]]
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_the_checker_sees_function_level_relative_and_dynamic_imports():
    src = ("def f():\n    from services.trainer import loss\n"
           "    import importlib\n    importlib.import_module('services.judge.service')\n"
           "from . import graders\nfrom services import rollout\n")
    got = imported_modules(REPO / "services" / "tasks" / "probe.py", src)
    assert {(2, "services.trainer"), (4, "services.judge.service"), (5, "services.tasks"),
            (6, "services.rollout")} <= set(got), got


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (its first node repeated at the end), found by a depth-first search; None: none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_no_cycles_between_packages():
    graph: dict[str, set[str]] = {n: set() for n in NODES}
    where: dict[tuple[str, str], str] = {}
    for src, dst, loc in import_edges():
        if src in graph and dst in graph and src != dst:
            graph[src].add(dst)
            where.setdefault((src, dst), loc)
    if cycle := find_cycle(graph):  # reported with one import site per edge
        sites = [where[(a, b)] for a, b in itertools.pairwise(cycle)]
        pytest.fail("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(sites))


@pytest.mark.parametrize("package", NO_MODULE_CYCLES)
def test_no_cycles_between_the_modules_of(package):
    """Counting every import (function-level and ``TYPE_CHECKING`` ones too): a module that needs another's
    type only must not close a circle with it either."""
    files = sorted(p for p in (REPO / package).glob("*.py"))
    modules = {module_name(p): p for p in files}
    graph = {m: {d for d in module_imports(p) if d in modules and d != m} for m, p in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between the modules of {package}: " + " -> ".join(cycle)


def test_the_module_checker_sees_a_module_imported_from_its_package():
    src = "def f():\n    from services.trainer import checkpoint, learner\nfrom . import loss\n"
    got = module_imports(REPO / "services" / "trainer" / "probe.py", src)
    assert {"services.trainer.checkpoint", "services.trainer.learner", "services.trainer.loss"} <= got, got
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_importing_tasks_loads_no_service_module():
    code = ("import sys; import services.tasks, services.tasks.graders, services.tasks.grader_specs, "
            "services.tasks.tools, services.tasks.models; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[:2] in "
            f"[['services', s] for s in {[*SERVICES, 'launcher']!r}]); print('\\n'.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", "importing services.tasks loaded service modules:\n" + r.stdout
