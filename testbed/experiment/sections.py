"""A backend's own section of the experiment: `inventory:` (the ssh backend's boards),
`provider:` (the enoslib backend's), or a plug-in backend's.

The schema knows no backend. A section is a strict model that names its top-level key
(`Section.section`) and registers itself in `SECTIONS` where it is defined; the schema gives
the experiment a field for every section registered (`testbed.experiment.schema`), and a
backend names the one it reads by its key (`testbed.backends.base.Backend.settings`). What a
backend asks of its section beyond its shape (files that exist, enough boards) is its
`refusal`, which the preflight asks. Every backend's section, built-in or plug-in, is defined
in the backend's folder (`testbed.backends.ssh.inventory`,
`testbed.backends.enoslib.provider_section`) and registered when its module is imported: the
backend table imports every backend, and the commands that read an experiment (`testbed.run`,
`testbed.reproduce`, `testbed.guide`) import the table first. The schema asks `SECTIONS` each
time it validates, so a section registered after the schema was imported is known.
"""

from __future__ import annotations

from typing import Any, ClassVar

from testbed.experiment.strict import Strict

SECTIONS: dict[str, type[Section]] = {}  # by key, in the order they were defined


class Section(Strict):
    """A backend's section. A subclass that sets `section` registers itself under it."""

    section: ClassVar[str] = ""  # its top-level key in the experiment
    about: ClassVar[str] = ""  # what the schema says of the key
    needed: ClassVar[str] = ""  # what a backend that reads it needs where it is missing

    @classmethod
    def given(cls, value: Any) -> Any:
        """What the experiment's key holds, made into what the model validates (a file's path
        into the file's mapping, say). Here: the value as it is."""
        return value

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.section:
            SECTIONS[cls.section] = cls
