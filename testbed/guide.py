"""`python -m testbed.guide > docs/experiment-file.md`: the experiment file, every field of it.

The page is made from what the code reads, as results/README.md is made from the columns: the
schema's fields with their types, defaults, bounds and descriptions (`testbed.experiment`),
the methods and their parameters (`tracevq.method_table`, `tracevq.spec.MethodSpec`), the
backends and emulators of their tables with what each can do, and the shipped link profiles.
A test keeps docs/experiment-file.md equal to it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from testbed.backends.enoslib.provider_section import BoardDefaults, Provider
from testbed.backends.ssh.inventory import Board, Inventory
from testbed.backends.table import AUTO, BACKENDS
from testbed.experiment.profiles import (
    GeModel,
    LinkProfile,
    StateModel,
    available_profiles,
    load_profile,
)
from testbed.experiment.schema import Experiment, experiment_model
from testbed.link.emulators import EMULATORS
from testbed.source import EXPERIMENTS_DIR
from tracevq.method_table import METHODS
from tracevq.spec import MethodSpec

EXAMPLE = EXPERIMENTS_DIR / "sweep-bandwidth.yaml"
BOUNDS = ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<"))


def type_name(annotation: Any) -> str:
    """A field's type as the file writes it: `number`, `list of whole numbers`, ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in kept)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping {type_name(args[0])} -> {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping (below)"
    names = {str: "text", int: "whole number", float: "number", bool: "true or false"}
    return names.get(annotation, "any")


def shown_type(field: Any) -> str:
    """A field's `shown_as` (a type its own validator checks) or its annotation's name."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return str(extra.get("shown_as") or type_name(field.annotation))


def default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    if value is PydanticUndefined or value is None or value == {} or value == "":
        return "-"
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def bounds_text(field: Any) -> str:
    parts = []
    for item in field.metadata:
        for kind, name, sign in BOUNDS:
            if isinstance(item, kind):
                bound = getattr(item, name)
                parts.append(f"{sign} {bound:,}" if isinstance(bound, int) else f"{sign} {bound:g}")
        if isinstance(item, MinLen) and item.min_length > 1:
            parts.append(f"at least {item.min_length}")
        if isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length} characters")
        if getattr(item, "pattern", None):
            parts.append(f"`{item.pattern}`")
    return ", ".join(parts)


def summary(thing: object) -> str:
    """The first paragraph of a module's or class's docstring, as one table cell."""
    return cell((inspect.getdoc(thing) or "").split("\n\n")[0])


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def fields_table(fields: Mapping[str, FieldInfo], prefix: str) -> list[str]:
    lines = ["| field | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, field in fields.items():
        lines.append(
            f"| `{prefix}{name}` | {shown_type(field)} | {default_text(field)} | "
            f"{bounds_text(field)} | {cell(field.description or '')} |"
        )
    return lines


def section(
    title: str, model: type[BaseModel], prefix: str, fields: Mapping[str, FieldInfo] | None = None
) -> list[str]:
    about = summary(model)
    intro = [about, ""] if about else []
    table = fields_table(model.model_fields if fields is None else fields, prefix)
    return [f"## {title}", "", *intro, *table, ""]


def top_level() -> dict[str, FieldInfo]:
    """The experiment's fields, with the sections of the table's backends after `backend`."""
    sections = experiment_model().model_fields
    fields = {}
    for name, field in Experiment.model_fields.items():
        fields[name] = field
        if name == "backend":
            keys = dict.fromkeys(b.settings for b in BACKENDS.values() if b.settings)
            fields.update({key: sections[key] for key in keys})
    return fields


def attribute_docs(cls: type) -> dict[str, str]:
    """`Attributes:` of a Google-style class docstring, by name."""
    text = (inspect.getdoc(cls) or "").split("Attributes:", 1)[-1]
    found: dict[str, str] = {}
    for match in re.finditer(r"^\s{4}(\w+): (.*?)(?=^\s{4}\w+: |\Z)", text, re.M | re.S):
        found[match.group(1)] = cell(match.group(2))
    return found


def methods() -> list[str]:
    docs = attribute_docs(MethodSpec)
    defaults = {f.name: f.default for f in dataclasses.fields(MethodSpec)}
    lines = [
        "## Methods",
        "",
        "Each entry of `methods` names one of these (`tracevq.method_table`) with any of its "
        "parameters; a list as a parameter's value makes one variant per value.",
        "",
        "| method | parameters (default) |",
        "|---|---|",
    ]
    for name, entry in METHODS.items():
        params = ", ".join(f"`{p}` ({_value(defaults[p])})" for p in entry.accepts) or "none"
        lines.append(f"| `{name}` | {params} |")
    lines += ["", "| parameter | meaning |", "|---|---|"]
    used = dict.fromkeys(p for entry in METHODS.values() for p in entry.accepts)
    lines += [f"| `{p}` | {docs.get(p, '')} |" for p in used]
    lines.append(
        "| `level_min_accuracy` | trace-b, trace-nb, a parameter of the testbed (no default): "
        "a top-1 percentage; before the run, for each device count, the coarsest level whose "
        "top-1 in `report.level_accuracy` (the accuracy study's table) is at least this "
        "becomes `level_min_k` under `level_k: auto`, or `level_k` without one; refused when "
        "no level reaches it |"
    )
    return [*lines, ""]


def _value(value: object) -> str:
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else str(value)


def backends() -> list[str]:
    lines = [
        "## Backends",
        "",
        f"`backend` names one of these (`testbed.backends.table`), or `{AUTO}`: the first "
        "that auto may take and that is available here.",
        "",
        "| backend | what it is | devices on this host | default emulator | downlink and pair "
        "rates | its boards | auto may take it |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, backend in BACKENDS.items():
        about = summary(sys.modules[backend.__module__])
        flags = [
            backend.on_this_host,
            backend.default_emulator,
            backend.shapes_downlinks,
            f"`{backend.settings}`" if backend.settings else "-",
            backend.in_auto,
        ]
        shown = [f if isinstance(f, str) else ("yes" if f else "no") for f in flags]
        lines.append(f"| `{name}` | {about} | {' | '.join(shown)} |")
    return [*lines, ""]


def emulators() -> list[str]:
    lines = [
        "## Emulators",
        "",
        "`link.emulator` names one of these (`testbed.link.emulators`).",
        "",
        "| emulator | what it is |",
        "|---|---|",
    ]
    for name, emulator in EMULATORS.items():
        lines.append(f"| `{name}` | {cell(emulator.description())} |")
    return [*lines, ""]


def profiles() -> list[str]:
    lines = section("Link profiles", LinkProfile, "")
    lines += section("`loss_gemodel`", GeModel, "loss_gemodel.")
    lines += section("`loss_state`", StateModel, "loss_state.")
    lines += [
        "Shipped in netem_profiles/ (`link.profile` names them):",
        "",
        "| profile | rate | delay | jitter | loss | description |",
        "|---|---|---|---|---|---|",
    ]
    for name in available_profiles():
        p = load_profile(name)
        rate = "-" if p.rate_mbit is None else f"{p.rate_mbit:g} Mbit/s"
        lines.append(
            f"| `{name}` | {rate} | {p.delay_ms:g} ms | {p.jitter_ms:g} ms | {p.loss_pct:g}% | "
            f"{cell(p.description)} |"
        )
    return [*lines, ""]


def page() -> str:
    lines = [
        "# The experiment file",
        "",
        "Made by `python -m testbed.guide > docs/experiment-file.md` from the schema and the "
        "plug-in tables; a test keeps this page equal to what the code reads. A file is "
        "refused, before anything is written or started, in one line naming the field; "
        "`python -m testbed.run FILE --dry-run` checks it. Example (`experiments/"
        f"{EXAMPLE.name}`):",
        "",
        "```yaml",
        EXAMPLE.read_text().rstrip(),
        "```",
        "",
        *section("Top level", Experiment, "", top_level()),
    ]
    for name, field in Experiment.model_fields.items():
        model = _model_of(field.annotation)
        if model is not None:
            lines += section(f"`{name}`", model, f"{name}.")
    lines += methods() + backends() + emulators() + profiles()
    lines += section("Inventory", Inventory, "inventory.")
    lines += section("A board", Board, "inventory.boards[].")
    lines += section("Provider", Provider, "provider.")
    lines += section("A provider's boards", BoardDefaults, "provider.boards.")
    return "\n".join(lines).rstrip() + "\n"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


if __name__ == "__main__":
    sys.stdout.write(page())
