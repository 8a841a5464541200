"""The packages are layers too: `testbed -> devices -> tracevq`, and the accuracy study above
the library (`accuracy -> tracevq`). Every module's imports are read (ast: module level,
under TYPE_CHECKING and inside functions, and `import_module("...")` with a written name);
none may reach a package its own may not import. Named exception: imports whose module name
is computed at run time, which ast cannot read: the method table's
`MethodEntry.implementation_class` (the one deliberate lazy import: each entry's class by its
`implementation` string) and `tracevq`'s lazy attributes. Their strings are checked instead.

A planted import in a tmp tree shows that the check fails when it should.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tracevq
from tracevq.method_table import METHODS

ROOT = Path(__file__).resolve().parents[2]
# what each package may import of the others (each may import itself)
ALLOWED: dict[str, set[str]] = {
    "testbed": {"devices", "tracevq"},
    "devices": {"tracevq"},
    "tracevq": set(),
    "accuracy": {"tracevq"},
}
# modules of the packages below the testbed that import a module named at run time
COMPUTED = {"tracevq.method_table", "tracevq"}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str) -> tuple[list[tuple[int, str]], list[int]]:
    """(line, module) of every import `source` (of `module`) makes (a relative one counts as
    its own package: it cannot leave it), and the lines of `import_module(...)` and
    `__import__(...)` calls whose name is computed."""
    found, computed = [], []
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
    return found, computed


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def check_tree(root: Path) -> list[str]:
    """Every import against the layers under `root`, and every computed import below the
    testbed that is not named in COMPUTED, one line each."""
    problems = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(root, path)
            found, computed = imports(path.read_text(), module)
            for line, name in found:
                top = name.split(".")[0]
                if top in ALLOWED and top not in {package, *allowed}:
                    problems.append(f"{module} line {line}: imports {name} ({package} -> {top})")
            if computed and package != "testbed" and module not in COMPUTED:
                problems.append(f"{module} lines {computed}: imports a module named at run time")
    return problems


def test_every_package_imports_only_the_packages_below_it() -> None:
    assert check_tree(ROOT) == []


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
    "devices/computed.py": "import importlib\n\ndef g(name):\n    importlib.import_module(name)\n",
    "tracevq/fine.py": "from tracevq import spec\nfrom . import codec\nimport torch\n",
    "testbed/fine.py": "import devices.spec\nfrom tracevq.errors import ConfigError\n",
    "accuracy/fine.py": "from .data import Dataset\nimport tracevq\n",
}


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    for name, source in PLANTED.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(source)
    return tmp_path


def test_a_planted_import_fails_the_check(planted: Path) -> None:
    assert check_tree(planted) == [
        "testbed.planted line 2: imports accuracy.study (testbed -> accuracy)",
        "devices.computed lines [4]: imports a module named at run time",
        "devices.planted line 3: imports testbed (devices -> testbed)",
        "tracevq.planted line 2: imports accuracy.study (tracevq -> accuracy)",
        "accuracy.planted line 1: imports devices (accuracy -> devices)",
    ]
