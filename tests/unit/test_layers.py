"""The folder tree is the layer diagram: every testbed module imports only from its own layer
or the layers below it, in the order `testbed.LAYERS` writes down (imports under
TYPE_CHECKING and inside functions count too: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testbed import LAYERS

PACKAGE = Path(__file__).resolve().parents[2] / "testbed"


def layer_of(module: str) -> int:
    """The index in LAYERS of `testbed.<top>...` (0 is the top)."""
    top = module.split(".")[1]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: testbed.{top} is in no layer of testbed.LAYERS")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every testbed module `path` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from testbed.link import emulators`: the module is testbed.link.emulators
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("testbed.")]


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_top_level_name_has_a_layer() -> None:
    names = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()}
    names -= {"__init__", "__pycache__"}
    layered = {name for layer in LAYERS for name in layer}
    assert names - layered == set(), "add them to testbed.LAYERS"
    assert layered - names == set(), "testbed.LAYERS names what does not exist"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_run_down_the_layers(path: Path) -> None:
    own = layer_of(module_name(path))
    upward = [
        f"line {line}: {name} (layer {layer_of(name)}: {', '.join(LAYERS[layer_of(name)])})"
        for line, name in imported(path)
        if name.split(".")[1] in {n for layer in LAYERS for n in layer} and layer_of(name) < own
    ]
    assert not upward, f"{module_name(path)} (layer {own}) imports from above: {upward}"
