"""The shape of the code base: no import circle, configs that lead to the code in one hop."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import yaml

from helpers import CONFIGS, ROOT

PACKAGE = ROOT / "src" / "vitrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """The vitrain modules a module imports when it is imported (function-level imports run later)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vitrain")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vitrain"):
            found.add(node.module)
            # `from vitrain.x import y` where y is a module
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_import_circle():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in top_level_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    # a package's __init__ is imported before any of its modules
    for name in modules:
        parent = name.rpartition(".")[0]
        while parent:
            graph[name].add(parent)
            parent = parent.rpartition(".")[0]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle = [*path[path.index(dep) :], dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_report_cli_needs_neither_torch_nor_lightning():
    code = (
        "import sys, vitrain.reporting.__main__;"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def targets(node: object):
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield node["_target_"]
        for value in node.values():
            yield from targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from targets(value)


def test_every_target_leads_to_the_code_in_one_hop():
    """A vitrain `_target_` names the module that defines the class or function, not a re-export."""
    seen = set()
    for path in sorted(CONFIGS.rglob("*.yaml")):
        for target in targets(yaml.safe_load(path.read_text())):
            if not target.startswith("vitrain.") or target in seen:
                continue
            seen.add(target)
            module, _, attr = target.rpartition(".")
            obj = getattr(importlib.import_module(module), attr)
            assert obj.__module__ == module, (
                f"{path.relative_to(ROOT)}: {target} is defined in {obj.__module__}"
            )
    assert "vitrain.reporting.run_stats.RunStats" in seen
