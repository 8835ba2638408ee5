"""The layout rules of docs/architecture.md, checked on the source: sizes, import direction, no cycles, one place
for other libraries' private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

PACKAGE = Path(REPO_ROOT) / "lightning_ft"
MAX_LINES = 420

# Which subpackage may import which (module-level or inside functions). The top-level modules (_compat, events,
# batch_timer) are shared by all; the strategy composes everything; nothing imports the strategy or the CLI.
ALLOWED = {
    "checkpoint": {"checkpoint"},
    "elastic": {"elastic", "parallel"},
    "parallel": {"parallel"},
    "monitors": {"monitors", "fault"},
    "fault": {"fault", "checkpoint", "monitors"},
    "strategy": {"strategy", "checkpoint", "elastic", "parallel", "fault"},
    "cli": {"cli", "checkpoint", "monitors", "parallel", "fault"},
}
SHARED = {"_compat", "events", "batch_timer"}


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


def test_no_module_is_longer_than_the_layout_allows():
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def test_there_is_no_import_cycle_between_modules():
    graph = _graph()

    # A package's __init__ re-exports its modules; edges into a package __init__ from its own modules are the
    # package's public face, not a cycle of logic, and are not followed.
    def edges(module: str) -> set[str]:
        return {d for d in graph[module] if not (module.startswith(d + ".") and d != "lightning_ft")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in edges(module):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in graph:
        if module not in state and module != "lightning_ft":
            visit(module)


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


@pytest.mark.slow
def test_importing_the_strategy_does_not_import_the_monitors():
    code = "import sys; from lightning_ft.strategy import ElasticFT3D; print(sorted(m for m in sys.modules if m.startswith('lightning_ft.monitors')))"
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
