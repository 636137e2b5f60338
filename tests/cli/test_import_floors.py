"""The package's imports point down the floors of DESIGN.md section 6 and form no circle.

Every module of superoffload_hf/ is read with `ast` (nothing is imported); every `import` and
`from ... import` counts, at module level and inside functions, absolute and relative, and
`from . import x` resolves to the module `x` where one exists.

Floors, bottom to top: (errors, metrics, yaml12, config) < (device, host, testing) < (plan, perf)
< engine < (optimizer, parallel) < integrations < train < cli. A module may import from its own
floor or below.

Exemptions (stated here, and only these):
- `superoffload_hf/__init__.py` re-exports the public names (`SuperOffloadAdamW`, `BucketPlan`,
  ...): it may import from any floor. Importing the package root from inside the package counts
  as an up-import (import the module that defines the name instead).
- Importing `a.b.c` also runs `a/__init__` and `a/b/__init__`; those implicit parent-package
  imports are not edges (each package's own `__init__` is read like any module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import superoffload_hf

PACKAGE = "superoffload_hf"
PACKAGE_DIR = Path(superoffload_hf.__file__).resolve().parent

FLOORS = [
    ("errors", "metrics", "yaml12", "config"),
    ("device", "host", "testing"),
    ("plan", "perf"),
    ("engine",),
    ("optimizer", "parallel"),
    ("integrations",),
    ("train",),
    ("cli",),
]
FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}
# The package root re-exports public names: above every floor, so nothing inside may import it.
ROOT_FLOOR = len(FLOORS)
EXEMPT_IMPORTERS = {PACKAGE}


def package_modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir` (packages by their __init__)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([package, *parts])] = path
    return modules


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` names, or its nearest enclosing package module; None outside."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported package module, line) for every import statement anywhere in `module`."""
    tree = ast.parse(modules[module].read_text(encoding="utf-8"), filename=str(modules[module]))
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from a import b`: the module a.b when it is one, else the names come from a
                target = f"{source}.{alias.name}"
                if target not in modules:
                    target = _resolve(source, modules)
                if target is not None:
                    found.append((target, node.lineno))
    return sorted({(target, line) for target, line in found if target != module}, key=lambda x: (x[1], x[0]))


def import_graph(modules: dict[str, Path]) -> dict[str, list[tuple[str, int]]]:
    return {module: imports_of(module, modules) for module in modules}


def floor_of(module: str, package: str = PACKAGE) -> int:
    """The floor of a package module: its first name below the package (a folder or a file)."""
    if module == package:
        return ROOT_FLOOR
    top = module[len(package) + 1:].split(".")[0]
    if top not in FLOOR_OF:
        raise AssertionError(
            f"{module}: {top!r} is on no floor of DESIGN.md section 6; add it to FLOORS in "
            "tests/cli/test_import_floors.py (and to the design's floor list)")
    return FLOOR_OF[top]


def up_imports(graph, package: str = PACKAGE) -> list[str]:
    """'importer:line -> imported (floor a < floor b)' for every import that points up a floor."""
    found = []
    for module, targets in graph.items():
        if module in EXEMPT_IMPORTERS or module == package:
            continue
        for target, line in targets:
            if floor_of(target, package) > floor_of(module, package):
                found.append(f"{module}:{line} -> {target} "
                             f"(floor {floor_of(module, package)} < {floor_of(target, package)})")
    return found


def import_cycles(graph) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {module: sorted({t for t, _ in targets if t in graph}) for module, targets in graph.items()}
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def module_file(module: str, modules: dict[str, Path]) -> str:
    """`superoffload_hf/engine/core.py` for `superoffload_hf.engine.core`."""
    return module.replace(".", "/") + ("/__init__.py" if _is_package(module, modules) else ".py")


def describe_cycle(cycle, modules) -> str:
    return "circle through " + ", ".join(module_file(m, modules) for m in sorted(cycle))


def test_the_package_has_no_import_circle():
    modules = package_modules(PACKAGE_DIR, PACKAGE)
    cycles = import_cycles(import_graph(modules))
    assert not cycles, "\n".join(describe_cycle(c, modules) for c in cycles)


def test_no_import_points_up_a_floor():
    modules = package_modules(PACKAGE_DIR, PACKAGE)
    found = up_imports(import_graph(modules))
    assert not found, "imports that point up a floor of DESIGN.md section 6:\n" + "\n".join(found)


def modules_on_no_floor(modules, package: str = PACKAGE) -> list[str]:
    """The modules whose first name below the package is in no floor of FLOORS."""
    return [m for m in modules if m != package and m[len(package) + 1:].split(".")[0] not in FLOOR_OF]


def test_every_module_sits_on_a_floor():
    assert modules_on_no_floor(package_modules(PACKAGE_DIR, PACKAGE)) == []


def test_the_floor_rule_sees_a_module_on_no_floor():
    modules = [PACKAGE, f"{PACKAGE}.engine.core", f"{PACKAGE}.extras.tool", f"{PACKAGE}.config"]
    assert modules_on_no_floor(modules) == [f"{PACKAGE}.extras.tool"]


def _write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for relative, text in files.items():
        path = root / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_modules(root / PACKAGE, PACKAGE)


def test_a_circle_hidden_in_a_function_level_relative_import_is_reported(tmp_path):
    modules = _write_package(tmp_path, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/a.py": "from superoffload_hf.engine import b\n",
        "engine/b.py": "def f():\n    from . import c\n",
        "engine/c.py": "def g():\n    from .a import thing\n",
        "engine/d.py": "from . import a\n",
    })
    cycles = import_cycles(import_graph(modules))
    assert cycles == [frozenset({"superoffload_hf.engine.a", "superoffload_hf.engine.b",
                                 "superoffload_hf.engine.c"})]
    assert describe_cycle(cycles[0], modules).endswith(
        "superoffload_hf/engine/a.py, superoffload_hf/engine/b.py, superoffload_hf/engine/c.py")


def test_an_up_import_inside_a_function_is_reported(tmp_path):
    modules = _write_package(tmp_path, {
        "__init__.py": "from superoffload_hf.cli import main\n",
        "cli.py": "from superoffload_hf.plan import layout\n",
        "plan/__init__.py": "",
        "plan/layout.py": "def f():\n    from ..engine.core import Engine\n    import superoffload_hf.config\n",
        "engine/__init__.py": "",
        "engine/core.py": "from superoffload_hf import SuperOffloadAdamW\n",
        "config.py": "",
    })
    found = up_imports(import_graph(modules))
    assert found == [
        "superoffload_hf.engine.core:1 -> superoffload_hf (floor 3 < 8)",
        "superoffload_hf.plan.layout:2 -> superoffload_hf.engine.core (floor 2 < 3)",
    ]


# plan/ decides: no threads, no device runtime (the seam's runtimes, the simulator), no process
# pool. Its own imports are read, at any level.
PLAN_FORBIDDEN = ("threading", "concurrent", "multiprocessing", "superoffload_hf.device.cpu",
                  "superoffload_hf.device.accelerator", "superoffload_hf.device.transfer.Transfer",
                  "superoffload_hf.testing", "torch.cuda", "torch.accelerator")


def all_imported_names(path: Path) -> list[tuple[str, int]]:
    """Every dotted name an import statement of `path` names (`from a import b`: a.b)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return names


def impure_imports(modules: dict[str, Path]) -> list[str]:
    return [f"{module}:{line} imports {name}" for module, path in modules.items()
            if module.startswith(f"{PACKAGE}.plan") for name, line in all_imported_names(path)
            if any(name == f or name.startswith(f + ".") for f in PLAN_FORBIDDEN)]


def test_plan_imports_no_threads_and_no_device_runtime():
    assert impure_imports(package_modules(PACKAGE_DIR, PACKAGE)) == []


def test_a_thread_in_plan_is_reported(tmp_path):
    modules = _write_package(tmp_path, {"__init__.py": "", "plan/__init__.py": "",
                                        "plan/layout.py": "def f():\n    import threading\n"})
    assert impure_imports(modules) == ["superoffload_hf.plan.layout:2 imports threading"]


MAX_MODULES_PER_FOLDER = 12
# integrations/ stays flat (DESIGN.md section 6): grouping it would make imports point up a floor.
FOLDER_ALLOWANCE = {"integrations": 14}


def crowded_folders(package_dir: Path) -> list[str]:
    """Folders of the package holding more modules (.py files, `__init__` not counted) than allowed."""
    found = []
    for folder in sorted({p.parent for p in package_dir.rglob("*.py")}):
        name = folder.relative_to(package_dir).as_posix()
        count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if count > FOLDER_ALLOWANCE.get(name, MAX_MODULES_PER_FOLDER):
            found.append(f"{name or '.'}: {count} modules")
    return found


def test_no_folder_of_the_package_holds_more_than_twelve_modules():
    assert crowded_folders(PACKAGE_DIR) == []


def test_the_folder_rule_sees_a_crowded_folder(tmp_path):
    for k in range(13):
        (tmp_path / "engine" / f"m{k}.py").parent.mkdir(exist_ok=True)
        (tmp_path / "engine" / f"m{k}.py").write_text("")
    (tmp_path / "engine" / "__init__.py").write_text("")
    assert crowded_folders(tmp_path) == ["engine: 13 modules"]
