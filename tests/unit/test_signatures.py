"""No function of the libraries takes more than MAX_PARAMETERS parameters (positional and
keyword-only, `self` and `cls` not counted): parameters that travel together are one object
(a session is a `Session`, a veth pair a `Veth`, how a bundle is fitted `FitSettings`).

Every function of `testbed`, `devices` and `tracevq` is read (ast: module level, methods,
nested functions and lambdas). A planted tree in tmp shows that the check fails when it
should.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("testbed", "devices", "tracevq")
MAX_PARAMETERS = 7
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[str]:
    """A function's positional and keyword-only parameters, less a leading `self` or `cls`."""
    arguments = node.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def too_many(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """'path:line name: n parameters' of every function of `packages` (folders under `root`)
    with more than MAX_PARAMETERS."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            functions = [node for node in ast.walk(tree) if isinstance(node, FUNCTIONS)]
            for node in sorted(functions, key=lambda node: node.lineno):
                if len(parameters(node)) > MAX_PARAMETERS:
                    name = getattr(node, "name", "<lambda>")
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(f"{where} {name}: {len(parameters(node))} parameters")
    return found


def test_no_library_function_takes_more_than_seven_parameters() -> None:
    assert too_many(ROOT) == []


def test_a_planted_function_with_eight_parameters_fails_the_check(tmp_path: Path) -> None:
    """Eight parameters fail, wherever the function is (module level, a method, nested, a
    lambda) and of whichever kind (keyword-only count); seven pass, and so does a method of
    seven beside `self` or `cls`, or a function whose extra arguments are *args/**kwargs."""
    package = tmp_path / "testbed" / "sub"
    package.mkdir(parents=True)
    (package / "ok.py").write_text(
        "def seven(a, b, c, d, e, f, g): ...\n"
        "def starred(a, b, c, d, e, f, g, *args, **kwargs): ...\n"
        "class K:\n"
        "    def method(self, a, b, c, d, e, f, g): ...\n"
        "    @classmethod\n"
        "    def made(cls, a, b, c, d, e, f, g): ...\n"
    )
    (package / "planted.py").write_text(
        "def eight(a, b, c, d, e, f, g, h): ...\n"
        "def keywords(a, b, c, d, *, e, f, g, h=1): ...\n"
        "class K:\n"
        "    def method(self, a, b, c, d, e, f, g, h): ...\n"
        "def outer():\n"
        "    def inner(a, b, c, d, e, f, g, h): ...\n"
        "    return lambda a, b, c, d, e, f, g, h: 0\n"
    )
    planted = "testbed/sub/planted.py"
    assert too_many(tmp_path, ("testbed",)) == [
        f"{planted}:1 eight: 8 parameters",
        f"{planted}:2 keywords: 8 parameters",
        f"{planted}:4 method: 8 parameters",
        f"{planted}:6 inner: 8 parameters",
        f"{planted}:7 <lambda>: 8 parameters",
    ]
