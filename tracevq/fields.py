"""Naming a field of a nested pydantic model in an error: its path as text, and the model
that owns the fields at a path (for a "did you mean" among its keys). Shared by the study
settings (`accuracy.settings`) and the testbed's files (`testbed.experiment.strict`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def field_path(location: tuple[Any, ...]) -> str:
    """('boards', 0, 'port') -> 'boards[0].port'."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def model_at(root: type[BaseModel], location: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose fields are at `location` below `root` (list items and optional
    fields followed through their annotations), or None."""
    model: type[BaseModel] | None = root
    for part in location:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model
