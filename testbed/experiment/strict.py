"""Strict pydantic models for the files a user writes (experiments, inventories, link
profiles), and their validation errors as one line per problem that names the field.

A strict model coerces nothing (`true` is not 1, `"3"` is not 3), takes no NaN or infinity
and refuses unknown keys, with a "did you mean" from the model that owns the key.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tracevq.fields import field_path, model_at


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def describe(error: ValidationError, root: type[BaseModel]) -> str:
    """The problems joined by "; ", each `field.path: message`: an unknown key with the nearest
    known one, a wrong type with the value given (and a note when YAML read a number as text)."""
    return "; ".join(_line(problem, root) for problem in error.errors())


def _line(problem: Any, root: type[BaseModel]) -> str:
    location = tuple(part for part in problem["loc"] if part != "function-after")
    path = field_path(location)
    if problem["type"] == "extra_forbidden":
        owner = model_at(root, location[:-1])
        known = list(owner.model_fields) if owner else []
        hint = difflib.get_close_matches(str(location[-1]), known, n=1)
        return f"{path}: unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    message = problem["msg"].removeprefix("Value error, ")
    given = _short_repr(problem.get("input"))
    if problem["type"] not in ("value_error", "missing") and given:
        as_text = isinstance(problem["input"], str) and problem["type"] in (
            "float_type",
            "int_type",
        )
        message += f" (got {given}{', which YAML reads as text' if as_text else ''})"
    named = message.startswith((f"{path}[", f"{path}.", f"{path}:"))  # names its own field
    return f"{path}: {message}" if path and not named else message


def _short_repr(value: Any) -> str | None:
    if isinstance(value, dict | list | BaseModel):
        return None
    text = repr(value)
    return text if len(text) <= 60 else None


def as_list(value: Any) -> Any:
    """A value where a list is expected: itself if it is one, else a list of it."""
    return value if isinstance(value, list) else [value]


def distinct(values: list[Any], what: str) -> list[Any]:
    """`values`, or ValueError naming the first repeated one (two trials would share an id)."""
    seen = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} is listed twice; each trial must be distinct")
        seen.add(value)
    return values


def as_list_or_none(value: Any) -> Any:
    return None if value is None else as_list(value)
