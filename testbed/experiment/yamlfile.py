"""Reading the YAML files a user hands the testbed (experiments, link profiles, inventories).

A YAML file is read as small UTF-8 text and parsed by a safe loader that refuses duplicate
keys (PyYAML keeps the last one silently). Every problem (missing, a directory, binary,
too large, a syntax error, a duplicate key) is a `ConfigError` of one line naming the file,
the line and column when known, and what is wrong. Aliases are kept as shared references
(nothing is expanded here); the experiment schema bounds what they could multiply.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import ConfigError

MAX_FILE_BYTES = 1_000_000  # experiments, profiles and inventories are a few kB


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping. Keys brought in by a
    merge (`<<: *defaults`) may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first_line.get(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if earlier is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first given on line {earlier})",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def describe_yaml_error(error: yaml.YAMLError) -> str:
    """A YAML error in one line: `line L, column C: problem (context)`."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    text = " ".join(f"{problem} ({context})".split() if context else str(problem).split())
    if mark is None:
        return text
    return f"line {mark.line + 1}, column {mark.column + 1}: {text}"


def read_text(path: Path, what: str) -> str:
    """The file's text; `what` names it in errors ("experiment file", "link profile" ...)."""
    if not path.exists():
        raise ConfigError(f"{what} not found: {path}")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give the {what} itself")
    if not path.is_file():
        raise ConfigError(f"{path}: not a regular file; give the {what} itself")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{path}: {size:,} bytes is too large for a {what} (at most {MAX_FILE_BYTES:,})"
            )
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the {what} ({error.strerror})") from None
    if b"\0" in data:
        raise ConfigError(f"{path}: a binary file (NUL bytes), not a YAML {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start}), not a YAML {what}"
        ) from None


def load_yaml(path: str | Path, what: str) -> Any:
    """The parsed content of a YAML file; every problem a one-line `ConfigError`."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {describe_yaml_error(error)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply (over Python's recursion limit)") from None


def names_in(directory: Path) -> list[str]:
    """The names of the YAML files in `directory` (without `.yaml`), sorted."""
    return sorted(path.stem for path in Path(directory).glob("*.yaml"))


def named_file(name_or_path: str | Path, directory: Path, what: str) -> Path:
    """A file given by name (`directory/<name>.yaml`) or by path (a `/` or a `.yaml` or
    `.yml` suffix says which). Raises ConfigError naming `what`: a missing file, or an unknown
    name with the nearest one and every available name."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"{path}: {what} file not found")
        return path
    path = directory / f"{text}.yaml"
    if path.is_file():
        return path
    names = names_in(directory)
    matches = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    hint = f" (did you mean '{matches[0]}'?)" if matches else ""
    listed = ", ".join(names) or "none"
    raise ConfigError(f"unknown {what} '{text}'{hint}; available in {directory}: {listed}")
