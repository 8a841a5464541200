"""The packages are layers too: `testbed -> devices -> tracevq`, the accuracy study above the
library (`accuracy -> tracevq`), the checks above the testbed (`checks -> testbed, devices,
tracevq`), and above them all the benchmarks and the tests, which import the libraries and
never each other. No library (tracevq, devices, testbed, accuracy, checks) imports `bench` or
`tests`, and nothing changes `sys.path` to reach one. Every folder of the repository that holds
Python is one of these packages, with its rule below.

Every module's imports are read (ast: module level, under TYPE_CHECKING and inside functions,
and `import_module("...")` with a written name); none may reach a package its own may not
import. Named exception: imports whose module name is computed at run time, which ast cannot
read: the method table's `MethodEntry.implementation_class` (the one deliberate lazy import:
each entry's class by its `implementation` string) and `tracevq`'s lazy attributes. Their
strings are checked instead.

A planted tree in tmp shows that the check fails when it should, for each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tracevq
from tracevq.method_table import METHODS

ROOT = Path(__file__).resolve().parents[2]
# what each library may import of the others (each may import itself)
LIBRARIES: dict[str, set[str]] = {
    "tracevq": set(),
    "devices": {"tracevq"},
    "testbed": {"devices", "tracevq"},
    "accuracy": {"tracevq"},
    "checks": {"testbed", "devices", "tracevq"},
}
# ... and of every package: the benchmarks and the tests import libraries, never each other
ALLOWED: dict[str, set[str]] = {
    **LIBRARIES,
    "bench": {"checks", "testbed", "devices", "tracevq"},
    "tests": set(LIBRARIES),
}
# libraries whose imports must all be written out, but for the modules of COMPUTED (not the
# testbed's: its backends import EnOSlib's providers, and look for a board's modules, by the
# names they are given)
NAMED_ONLY = set(LIBRARIES) - {"testbed"}
COMPUTED = {"tracevq.method_table", "tracevq"}
PATH_CHANGES = {"insert", "append", "extend"}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str) -> tuple[list[tuple[int, str]], list[int], list[int]]:
    """(line, module) of every import `source` (of `module`) makes (a relative one counts as
    its own package: it cannot leave it), the lines of `import_module(...)` and
    `__import__(...)` calls whose name is computed, and the lines that change `sys.path`."""
    found, computed, path_changes = [], [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, module.split(".")[0] if node.level else str(node.module)))
        elif isinstance(node, ast.Call) and _called(node.func) in ("import_module", "__import__"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
            else:
                computed.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in PATH_CHANGES and _is_sys_path(node.func.value):
                path_changes.append(node.lineno)  # sys.path.insert(0, ...)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
                path_changes.append(node.lineno)  # sys.path = ..., sys.path[:0] = ..., +=
    return found, computed, path_changes


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _is_sys_path(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def check_tree(root: Path) -> list[str]:
    """Every import against the packages' rules under `root`, every computed import of a
    NAMED_ONLY library that is not named in COMPUTED, and every change of `sys.path`, one
    line each."""
    problems = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(root, path)
            found, computed, path_changes = imports(path.read_text(), module)
            for line, name in found:
                top = name.split(".")[0]
                if top in ALLOWED and top not in {package, *allowed}:
                    problems.append(f"{module} line {line}: imports {name} ({package} -> {top})")
            if computed and package in NAMED_ONLY and module not in COMPUTED:
                problems.append(f"{module} lines {computed}: imports a module named at run time")
            if path_changes:
                problems.append(f"{module} lines {sorted(path_changes)}: changes sys.path")
    return problems


def python_folders(root: Path) -> set[str]:
    """The repository's top-level folders with Python files of their own."""
    return {
        folder.name
        for folder in root.iterdir()
        if folder.is_dir() and not folder.name.startswith(".") and any(folder.glob("*.py"))
    }


def test_every_package_imports_only_the_packages_below_it() -> None:
    assert check_tree(ROOT) == []


def test_every_folder_of_python_is_a_package_with_its_rule() -> None:
    assert python_folders(ROOT) == set(ALLOWED), "give the package its rule in ALLOWED"


def test_the_computed_imports_are_still_there() -> None:
    """A module that no longer computes an import must leave COMPUTED (it names what is true)."""
    for module in COMPUTED:
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert imports(path.read_text(), module)[1], module


def test_what_the_computed_imports_name_stays_in_the_library() -> None:
    for entry in METHODS.values():
        module = entry.implementation.partition(":")[0]
        assert module.split(".")[0] == "tracevq", entry.name
        assert isinstance(entry.implementation_class(), type)
    assert all(module.split(".")[0] == "tracevq" for module in tracevq._LAZY.values())


PLANTED = {
    "tracevq/planted.py": "def f():\n    from accuracy.study import plan\n",
    "devices/planted.py": "import typing\nif typing.TYPE_CHECKING:\n    import testbed\n",
    "testbed/planted.py": "import importlib\nstudy = importlib.import_module('accuracy.study')\n",
    "accuracy/planted.py": "from devices import spec\n",
    "checks/planted.py": "from accuracy.study import plan\n",
    "devices/computed.py": "import importlib\n\ndef g(name):\n    importlib.import_module(name)\n",
    # no library imports the benchmarks or the tests, in any way of writing it
    "tracevq/uses_tests.py": "from tests.integration.conftest import SUBNET\n",
    "devices/uses_bench.py": "def f():\n    import bench.soak\n",
    "testbed/uses_tests.py": "import importlib\nimportlib.import_module('tests.conftest')\n",
    "accuracy/uses_bench.py": "from bench import compute\n",
    "checks/uses_both.py": "import bench.cell\nfrom tests.conftest import stolen_s\n",
    # nor do the benchmarks and the tests import each other, or reach them through sys.path
    "bench/uses_tests.py": "from tests.integration import stalls\n",
    "tests/uses_bench.py": "def test_it():\n    from bench.cell import main\n",
    "bench/path_hack.py": "import sys\nsys.path.insert(0, '.')\nsys.path[:0] = ['tests']\n",
    "tests/path_hack.py": "import sys\n\nsys.path = ['.', *sys.path]\nsys.path += ['..']\n",
    # what each may import
    "tracevq/fine.py": "from tracevq import spec\nfrom . import codec\nimport torch\n",
    "testbed/fine.py": "import devices.spec\nfrom tracevq.errors import ConfigError\n",
    "accuracy/fine.py": "from .data import Dataset\nimport tracevq\n",
    "checks/fine.py": "from testbed.link.serial.switch import SerialSwitch\nimport devices.clock\n",
    "bench/fine.py": "from checks.cell import cell_of\nfrom bench.compute import compare\n",
    "tests/fine.py": "from checks import boards\nfrom accuracy.study import plan\nimport tests\n",
}


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    for name, source in PLANTED.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(source)
    return tmp_path


def test_a_planted_import_fails_the_check(planted: Path) -> None:
    assert sorted(check_tree(planted)) == sorted(
        [
            "tracevq.planted line 2: imports accuracy.study (tracevq -> accuracy)",
            "devices.planted line 3: imports testbed (devices -> testbed)",
            "testbed.planted line 2: imports accuracy.study (testbed -> accuracy)",
            "accuracy.planted line 1: imports devices (accuracy -> devices)",
            "checks.planted line 1: imports accuracy.study (checks -> accuracy)",
            "devices.computed lines [4]: imports a module named at run time",
            "tracevq.uses_tests line 1: imports tests.integration.conftest (tracevq -> tests)",
            "devices.uses_bench line 2: imports bench.soak (devices -> bench)",
            "testbed.uses_tests line 2: imports tests.conftest (testbed -> tests)",
            "accuracy.uses_bench line 1: imports bench (accuracy -> bench)",
            "checks.uses_both line 1: imports bench.cell (checks -> bench)",
            "checks.uses_both line 2: imports tests.conftest (checks -> tests)",
            "bench.uses_tests line 1: imports tests.integration (bench -> tests)",
            "tests.uses_bench line 2: imports bench.cell (tests -> bench)",
            "bench.path_hack lines [2, 3]: changes sys.path",
            "tests.path_hack lines [3, 4]: changes sys.path",
        ]
    )


def test_a_planted_folder_of_python_needs_a_rule(planted: Path) -> None:
    (planted / "tools").mkdir()
    (planted / "tools" / "helper.py").write_text("import bench\n")
    (planted / "notes").mkdir()  # no Python: not a package
    assert python_folders(planted) == set(ALLOWED) | {"tools"}
