"""The layout rules of docs/architecture.md, checked on the source: import direction, an acyclic package graph, no
module cycles, long modules that say why, one place for other libraries' private names."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

PACKAGE = Path(REPO_ROOT) / "lightning_ft"
LONG_MODULE_LINES = 600
LONG_MODULE_REASON = "Why one module:"
"""A module is as long as its one concept needs; past LONG_MODULE_LINES its docstring says why, in a paragraph that
starts with LONG_MODULE_REASON (why the concept does not split)."""

# Which package may import which (module-level or inside functions), as docs/architecture.md draws it. The top-level
# modules in SHARED are leaves shared by all; the strategy composes everything; nothing imports the strategy or the CLI.
ALLOWED = {
    "checkpoint": {"checkpoint"},
    "elastic": {"elastic", "parallel"},
    "parallel": {"parallel"},
    "monitors": {"monitors", "fault"},
    "fault": {"fault", "checkpoint"},
    "replica": {"replica", "checkpoint", "elastic"},
    "strategy": {"strategy", "checkpoint", "elastic", "parallel", "fault", "replica"},
    "cli": {"cli", "checkpoint", "monitors", "parallel", "fault"},
}
SHARED = {"_compat", "_torchft_native", "events", "batch_timer", "nvml", "stop"}

# The public API: the ``__all__`` of every package (each ``__init__.py``: a package added later is public from its first
# day) and of these modules, and nothing else, is what docs/ teaches users to import. (An ``__all__`` elsewhere lists
# what a module offers inside its own package.)
PUBLIC_MODULES = ("lightning_ft.events", "lightning_ft.pytorch_lightning")
PUBLIC_NAMESPACES = tuple(
    sorted(
        {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
        | set(PUBLIC_MODULES)
    )
)
# The seam between packages: what a package offers the packages above it (above all the strategy) beyond its public
# names. Only the packages that ALLOWED lets import the package may import its seam.
SEAM = "internal"
DOCS = sorted((Path(REPO_ROOT) / "docs").glob("*.md")) + [Path(REPO_ROOT) / "README.md"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Modules of lightning_ft that ``path`` imports (``from pkg import submodule`` counts as the submodule)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_ft")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("lightning_ft"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return found


def _is_type_checking_only(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("lightning_ft"):
                    names |= {f"{sub.module}.{a.name}" for a in sub.names} | {sub.module}
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, name, modules) - _is_type_checking_only(path)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_a_module_past_the_long_mark_says_in_its_docstring_why_it_is_one_module():
    unexplained = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > LONG_MODULE_LINES
        and LONG_MODULE_REASON not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    }
    assert not unexplained, f"modules over {LONG_MODULE_LINES} lines without {LONG_MODULE_REASON!r}: {unexplained}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _package_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports: ``checkpoint``, ``fault``, ... and each shared top-level module by name."""
    packages: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        own = _subpackage(module)
        if not own:
            continue  # lightning_ft/__init__.py: the public face imports every package lazily
        packages.setdefault(own, set()).update(o for d in deps if (o := _subpackage(d)) and o != own)
    return packages


def test_the_package_graph_is_acyclic():
    cycle = _find_cycle(_package_graph())
    assert cycle is None, f"package cycle: {' -> '.join(cycle)}"


def test_the_shared_top_level_modules_import_only_each_other():
    graph = _package_graph()
    problems = {name: graph.get(name, set()) - SHARED for name in SHARED if graph.get(name, set()) - SHARED}
    assert not problems, f"shared leaves importing packages: {problems}"


def test_there_is_no_import_cycle_between_modules():
    graph = _graph()

    # A package's __init__ re-exports its modules; edges into a package __init__ from its own modules are the
    # package's public face, not a cycle of logic, and are not followed.
    edges = {
        module: {d for d in deps if not (module.startswith(d + ".") and d != "lightning_ft")}
        for module, deps in graph.items()
        if module != "lightning_ft"
    }
    cycle = _find_cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_subpackages_import_only_what_the_layout_allows_and_no_one_s_private_module():
    problems = []
    for module, deps in _graph().items():
        own = _subpackage(module)
        for dep in deps:
            other = _subpackage(dep)
            if dep == "lightning_ft" or other in SHARED or other == own:
                continue
            if own in ALLOWED and other not in ALLOWED[own]:
                problems.append(f"{module} imports {dep}")
            if dep.rsplit(".", 1)[-1].startswith("_") and other != own:
                problems.append(f"{module} imports another subpackage's private module {dep}")
    assert not problems, "\n".join(problems)


def test_private_names_of_torch_lightning_and_torchsnapshot_are_imported_only_in_compat():
    problems = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0]
                in {
                    "torch",
                    "lightning",
                    "torchsnapshot",
                }
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(part.startswith("_") for part in node.module.split(".")):
                    problems.append(f"{path.relative_to(PACKAGE)}: from {node.module} import {private or '...'}")
    assert not problems, "\n".join(problems)


def _public_names(namespace: str) -> set[str]:
    path = PACKAGE.parent.joinpath(*namespace.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:  # computed from another namespace's list (lightning_ft.pytorch_lightning)
                return set(importlib.import_module(namespace).__all__)
    return set()


def test_across_packages_a_module_imports_only_public_names_or_the_package_s_internal_seam():
    problems = []
    for path in PACKAGE.rglob("*.py"):
        # The package root is the public API: it may reach every package (lazily, or to register the strategy's name).
        own = (
            ""
            if path == PACKAGE / "__init__.py"
            else _subpackage(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        )
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_ft."):
                targets = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names if a.name.startswith("lightning_ft.")]
            else:
                continue
            for module, names in targets:
                other = _subpackage(module)
                if other in (own, "") or other in SHARED or own == "":
                    continue
                where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
                if module == f"lightning_ft.{other}.{SEAM}":
                    continue  # who may import the package at all is the layout rule's business
                if module in PUBLIC_NAMESPACES and names:
                    hidden = sorted(set(names) - _public_names(module))
                    if hidden:
                        problems.append(f"{where}: {hidden} are not public in {module}: use {module}.{SEAM}")
                    continue
                problems.append(f"{where}: imports {module}: use {'.'.join(module.split('.')[:2])} or its {SEAM}")
    assert not problems, "\n".join(problems)


_REFERENCE = re.compile(r"\blightning_ft(?:\.[A-Za-z_]\w*)+")
_FROM_IMPORT = re.compile(r"^\s*from (lightning_ft(?:\.\w+)*) import (?:\(([^)]*)\)|([\w, ]+)$)", re.MULTILINE)


def _documented() -> tuple[set[str], set[str], list[str]]:
    """What docs/ tells users to use: qualified names (``lightning_ft.parallel.ClusterShape``, ``from lightning_ft.fault
    import FaultInjector``), the modules it names (``import lightning_ft.strategy``), and where each was found."""
    from lightning_ft.checkpoint.internal import COMMIT_MARKER, IN_PROGRESS_RECORD

    files = {COMMIT_MARKER, IN_PROGRESS_RECORD}  # names of files in a checkpoint folder, not of Python objects
    names, modules, seen = set(), set(), []
    for doc in DOCS:
        text = doc.read_text()
        for match in _FROM_IMPORT.finditer(text):
            for name in re.split(r"[,\s]+", (match.group(2) or match.group(3)).strip()):
                if name:
                    names.add(f"{match.group(1)}.{name}")
                    seen.append(f"{doc.name}: from {match.group(1)} import {name}")
        for match in _REFERENCE.finditer(_FROM_IMPORT.sub("", text)):
            reference = match.group(0)
            if reference in files:
                continue
            seen.append(f"{doc.name}: {reference}")
            (modules if _is_module(reference) else names).add(reference)
    return names, modules, seen


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False


def _split(reference: str) -> tuple[str, str]:
    module, _, name = reference.rpartition(".")
    return module, name


def _taught_at(namespace: str, name: str) -> list[str]:
    """Where docs/ may teach ``namespace.name``: there, at the top level when ``lightning_ft`` exports the name (its
    ``pytorch_lightning`` build too), or in an enclosing public namespace that re-exports the same object
    (``lightning_ft.parallel.planner.ClusterSpec`` is taught as ``lightning_ft.parallel.ClusterSpec``)."""
    places = [f"{namespace}.{name}"]
    if name in _public_names("lightning_ft"):
        places.append(f"lightning_ft.{name}")
    value = getattr(importlib.import_module(namespace), name)
    parts = namespace.split(".")
    for i in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:i])
        if name in _public_names(outer) and getattr(importlib.import_module(outer), name) is value:
            places.append(f"{outer}.{name}")
    return places


def test_the_public_namespaces_are_every_package_and_the_named_modules():
    packages = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert {"lightning_ft.cli", "lightning_ft.parallel.planner", "lightning_ft.monitors"} <= packages
    assert set(PUBLIC_NAMESPACES) == packages | set(PUBLIC_MODULES)


def test_every_public_name_is_taught_by_the_docs_with_the_namespace_it_is_imported_from():
    names, _, _ = _documented()
    undocumented = []
    for namespace in PUBLIC_NAMESPACES:
        for name in sorted(_public_names(namespace)):
            # A name a package re-exports from an enclosing one is taught there (``from lightning_ft import ...``).
            if not any(place in names for place in _taught_at(namespace, name)):
                undocumented.append(f"{namespace}.{name}")
    assert not undocumented, (
        f"public but not taught by docs/ (document them, or take them out of __all__): {undocumented}"
    )


def test_every_name_the_docs_tell_users_to_import_is_public():
    # A module docs/ names (a logger, ``import lightning_ft.strategy``, where to read more) is not a name to import.
    names, _, _ = _documented()
    problems = []
    for reference in sorted(names):
        module, name = _split(reference)
        while module and not _is_module(module):  # ``lightning_ft.ElasticFT3D.strategy_name``
            module, name = _split(module)
        if module not in PUBLIC_NAMESPACES or name not in _public_names(module):
            problems.append(reference)
    assert not problems, f"docs/ tells users to use names that are not public: {problems}"


@pytest.mark.slow
def test_importing_the_strategy_does_not_import_the_monitors():
    code = "import sys; from lightning_ft.strategy import ElasticFT3D; print(sorted(m for m in sys.modules if m.startswith('lightning_ft.monitors')))"
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
