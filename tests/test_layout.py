"""The shape of the code base: no import circle and no upward import (function-level imports included),
every Lightning callback under callbacks/, a short walk of train(cfg), configs that lead to the code in one hop."""

import ast
import contextlib
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


def vitrain_imports(path: Path) -> set[str]:
    """The vitrain modules a module imports: at the top, inside functions and classes alike (a function-level
    import is still a dependency, only a later one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vitrain")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vitrain"):
            found.add(node.module)
            # `from vitrain.x import y` where y is a module
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in vitrain_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_import_circle():
    graph = import_graph()
    # a package's __init__ is imported before any of its modules
    for name in list(graph):
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


# The layers of vitrain, bottom to top. A module may import from its own layer and the layers below it.
# An import is UPWARD (as issue 32 defines it) when a module imports one of a higher layer: a sub-package
# reaching up to the package root's run-level modules (where training, tuning and resume used to live: they
# are vitrain.tasks now, the top) or to a sibling sub-package ranked above it (callbacks -> models and
# loggers -> reporting were such). The root keeps only foundation modules (errors, compat, checkpoints) and
# loggers, each placed in a layer below tasks. Every module belongs to exactly one layer: a new root module or
# sub-package must be placed here.
LAYERS = [
    # foundation: errors, private framework names, small helpers (atomic writes, config, secrets, the run
    # dir's file names, measuring a process)
    ("vitrain.errors", "vitrain.compat", "vitrain.utils"),
    # services: checkpoint IO, S3, strategies and the ordered parallelize step, reading a run dir
    ("vitrain.checkpoints", "vitrain.s3", "vitrain.distributed", "vitrain.reporting"),
    # what is trained on, and what is trained
    ("vitrain.data", "vitrain.models"),
    # what watches a run: Lightning callbacks and loggers
    ("vitrain.callbacks", "vitrain.loggers"),
    # the life of a run: build, train, evaluate, tune, run dirs and resume, the entry points' harness
    ("vitrain.tasks",),
]


def layer_of(module: str) -> int:
    if module == "vitrain":
        return 0
    for index, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py's LAYERS: place it")


def test_no_upward_import():
    upward = [
        f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"
        for name, deps in sorted(import_graph().items())
        for dep in sorted(deps)
        if layer_of(dep) > layer_of(name)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_every_lightning_callback_lives_under_callbacks():
    from lightning.pytorch.callbacks import Callback

    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        # compat.py's shims of Lightning's own callbacks (private names live there) are its to keep
        if name.startswith("vitrain.callbacks") or name.endswith("__main__") or name == "vitrain.compat":
            continue
        module = importlib.import_module(name)
        elsewhere += [
            f"{name}.{cls.__name__}"
            for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, Callback) and cls.__module__ == name
        ]
    assert not elsewhere, f"Lightning callbacks outside vitrain/callbacks/: {elsewhere}"


def _module_of(module: str, name: str) -> str:
    """`from module import name`: the module `name` is, or `module`."""
    full = f"{module}.{name}"
    path = PACKAGE.parent / full.replace(".", "/")
    return full if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else module


def test_the_walk_of_train_enters_no_module_more_than_twice():
    """`train(cfg)` read as the modules its phases call, in order (a phase of tasks/training.py is followed
    into): leaving a module and coming back is a second entry; a third is a knot to untie."""
    tree = ast.parse((PACKAGE / "tasks" / "training.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    origin = {
        alias.asname or alias.name: _module_of(node.module, alias.name)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vitrain")
        for alias in node.names
    }

    def walk(function: ast.FunctionDef, seen: tuple[str, ...]) -> list[str]:
        rooms: list[str] = []
        calls = sorted(
            (n for n in ast.walk(function) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)
        )
        for call in calls:
            head = ast.unparse(call.func).split(".")[0]
            if head in functions and head not in seen:
                rooms += ["vitrain.tasks.training", *walk(functions[head], (*seen, head))]
            elif head in origin:
                rooms.append(origin[head])
        return rooms

    rooms = walk(functions["train"], ("train",))
    entries: dict[str, int] = {}
    for i, room in enumerate(rooms):
        if i == 0 or rooms[i - 1] != room:
            entries[room] = entries.get(room, 0) + 1
    assert len(entries) > 5, rooms  # the walk saw the phases
    entries.pop("vitrain.tasks.training")  # the list of phases itself
    assert max(entries.values()) <= 2, f"entered more than twice: {entries}\n{rooms}"


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
    assert "vitrain.callbacks.run_stats.RunStats" in seen


FRAMEWORKS = ("lightning", "torch", "litdata", "hydra", "omegaconf", "timm", "torchmetrics", "torchvision")
# names whose private attributes are Lightning's: `trainer._logger_connector`, `module._trainer`, ...
FRAMEWORK_OBJECTS = {"trainer", "pl_module", "strategy", "fit_loop", "epoch_loop", "precision_plugin"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def private_framework_uses(path: Path) -> list[str]:
    """Private framework names a module imports, reads through an imported name or a trainer, or by string."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()  # names bound to framework modules and objects in this module
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _framework(alias.name):
                    aliases.add((alias.asname or alias.name).split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _framework(node.module):
            aliases |= {alias.asname or alias.name for alias in node.names}
            private = [a.name for a in node.names if _private(a.name)]
            if private or any(_private(part) for part in node.module.split(".")):
                found.append(
                    f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}"
                )
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = ast.unparse(node.value).split(".")
            if chain[0] in aliases or FRAMEWORK_OBJECTS & {part.strip("_") for part in chain}:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        # getattr(module, "_name"): a private name reached by string (our own markers are `_vitrain_*`)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not node.args[1].value.startswith("_vitrain")
            and ast.unparse(node.args[0]) != "self"
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def inherited_private_uses(path: Path) -> list[str]:
    """`self._name` (or a `_name` override) in a class where `_name` belongs to a framework base class."""
    import inspect
    import re

    module = importlib.import_module(module_name(path))
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not inspect.isclass(cls):
            continue
        theirs: set[str] = set()
        for base in cls.__mro__[1:]:
            if _framework(base.__module__):
                theirs |= {name for name in vars(base) if _private(name)}
                with contextlib.suppress(OSError, TypeError):  # a base without Python source
                    theirs |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(base)))
        ours = {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        } | {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        found += [f"{node.name}.{name}" for name in sorted(ours & theirs) if _private(name)]
    return found


def test_private_framework_names_live_in_compat_only():
    """Every private Lightning/torch/litdata/Hydra name vitrain uses goes through vitrain/compat.py (one
    test each in tests/test_compat.py), so an upgrade breaks in one known place. bench/ imports them from
    there too."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        uses = private_framework_uses(path) + inherited_private_uses(path)
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    for path in sorted((ROOT / "bench").glob("*.py")):  # scripts: what they import and read
        if uses := private_framework_uses(path):
            offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, f"private framework names outside vitrain/compat.py (add a shim there): {offenders}"
