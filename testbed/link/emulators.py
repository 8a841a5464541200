"""The link emulators, one entry each, and which one a run uses.

An experiment names its emulator in `link.emulator`; where it names none, its backend's
`default_emulator` is used (serial on this host, tbf on ssh boards). Adding an emulator is its
module (a `testbed.link.emulator.Emulator`) and one entry here.
"""

from __future__ import annotations

import difflib

from testbed.backends.base import Backend
from testbed.errors import ConfigError
from testbed.link.emulator import EMULATORS, Emulator
from testbed.link.serial.emulator import SerialEmulator
from testbed.link.token_bucket import TokenBucket

# the table lives beside the base class, whose refusal names the emulators able to do more
EMULATORS.update({emulator.name: emulator for emulator in (SerialEmulator, TokenBucket)})


def emulator_class(requested: str | None, backend: type[Backend]) -> type[Emulator]:
    """The emulator a run uses: the experiment's, else its backend's default. Raises
    ConfigError naming link.emulator for a name that is not in the table."""
    name = requested or backend.default_emulator
    if name not in EMULATORS:
        hint = difflib.get_close_matches(name, EMULATORS, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"link.emulator: unknown emulator {name!r}{suggestion}; known: {', '.join(EMULATORS)}"
        )
    return EMULATORS[name]
