"""What the serial link program (`testbed.link.serial.program`) is told: its ports on the command
line (`IFNAME=RATE_BIT_S`, `PORT=CPULIST`) and its commands on stdin (`rate PORT BIT_S`, `down PORT
BIT_S`, `pair SRC DST BIT_S`, `impair PORT SEED JSON`, `impair-down PORT SEED JSON`,
`impair-pair SRC DST SEED JSON`, `medium shared|dedicated AIRTIME_US`, `stats`), parsed and
checked. Pure and stdlib only, like the program; every error is a ShapingError that names
what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.errors import ShapingError
from testbed.experiment.netem_parameters import checked
from testbed.kernel.names import IFNAME_MAX_CHARS


def parse_port(text: str) -> tuple[str, float]:
    """`IFNAME=RATE_BIT_S` -> (interface, rate)."""
    name, sep, rate_text = text.partition("=")
    if not sep or not name or len(name) > IFNAME_MAX_CHARS or "/" in name:
        raise ShapingError(f"port {text!r}: expected IFNAME=RATE_BIT_S (IFNAME <= 15 characters)")
    return name, _rate(rate_text, f"port {text!r}")


def parse_cpu_list(text: str) -> set[int]:
    """'0', '0,2', '1-3' -> the CPU numbers (the format of taskset and Docker's cpuset)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ShapingError(f"CPU list {text!r}: expected numbers and ranges like 0,2-3") from None
    if not cpus:
        raise ShapingError(f"CPU list {text!r} names no CPU")
    return cpus


def parse_port_cpus(text: str, ports: Sequence[str]) -> tuple[str, set[int]]:
    """`PORT=CPULIST` -> (port, CPUs); the port must be one of `ports`."""
    name, sep, cpus = text.partition("=")
    if not sep or name not in ports:
        raise ShapingError(f"--cpus {text!r}: expected PORT=CPULIST with PORT one of {ports}")
    return name, parse_cpu_list(cpus)


def _rate(text: str, where: str) -> float:
    try:
        rate_bit_s = float(text)
    except ValueError:
        raise ShapingError(f"{where}: rate {text!r} is not a number of bit/s") from None
    if not math.isfinite(rate_bit_s) or rate_bit_s <= 0:
        raise ShapingError(f"{where}: the rate must be a positive number of bit/s, got {text!r}")
    return rate_bit_s


@dataclass(frozen=True)
class Command:
    """One stdin command: `rate` or `down` (a port and a rate), `pair` (two ports and a
    rate; `target` is the receiving port), `impair` or `impair-down` (a port, a seed and the
    impairments of `testbed.experiment.netem_parameters`), `impair-pair` (two ports, a seed and
    impairments), or `stats`. A `down` or `pair` rate of None removes
    it."""

    name: str
    port: str | None = None
    rate_bit_s: float | None = None
    target: str | None = None
    seed: int | None = None  # impair: the seed of the port's draws
    parameters: dict[str, Any] | None = None  # impair: netem's parameters, checked
    medium: str | None = None  # medium: shared (one line for all) or dedicated (one each)
    airtime_us: float | None = None  # medium: what a frame adds on a shared one


def parse_command(line: str, ports: Iterable[str]) -> Command:
    """Parses `rate PORT BIT_S`, `down PORT BIT_S`, `pair SRC DST BIT_S` or `stats`; raises
    ShapingError naming what is wrong."""
    words, known = line.split(), list(ports)
    if words == ["stats"]:
        return Command("stats")
    if words[:1] == ["medium"]:
        return _medium(words)
    if words[:1] and words[0] in IMPAIR_COMMANDS:
        return _impair(line, known)
    named = words[1:-1]
    for port in named:
        if port not in known:
            raise ShapingError(f"{words[0]}: unknown port {port!r} (ports: {', '.join(known)})")
    if len(words) == 3 and words[0] == "rate":
        return Command("rate", words[1], _rate(words[2], f"rate {words[1]}"))
    if len(words) == 3 and words[0] == "down":
        return Command("down", words[1], _optional_rate(words[2], f"down {words[1]}"))
    if len(words) == 4 and words[0] == "pair":
        rate = _optional_rate(words[3], f"pair {words[1]} {words[2]}")
        return Command("pair", words[1], rate, words[2])
    raise ShapingError(
        f"unknown command {line.strip()!r}: expected 'rate PORT BIT_S', 'down PORT BIT_S', "
        "'pair SRC DST BIT_S', 'impair PORT SEED JSON', 'impair-down PORT SEED JSON', "
        "'impair-pair SRC DST SEED JSON', 'medium shared|dedicated AIRTIME_US' or 'stats'"
    )


MEDIA = ("dedicated", "shared")  # a line per port, or one for every port (a cell)


def _medium(words: list[str]) -> Command:
    """`medium shared AIRTIME_US` or `medium dedicated 0`."""
    usage = "medium: expected 'medium shared|dedicated AIRTIME_US'"
    if len(words) != 3 or words[1] not in MEDIA:
        raise ShapingError(usage)
    try:
        airtime_us = float(words[2])
    except ValueError:
        raise ShapingError(f"{usage}, got airtime {words[2]!r}") from None
    if not math.isfinite(airtime_us) or airtime_us < 0:
        raise ShapingError(f"medium: the airtime must be >= 0 us, got {words[2]!r}")
    if airtime_us and words[1] == "dedicated":
        raise ShapingError("medium dedicated: a frame's airtime is for a shared medium")
    return Command("medium", medium=words[1], airtime_us=airtime_us)


def _optional_rate(text: str, where: str) -> float | None:
    return None if text == "0" else _rate(text, where)


IMPAIR_COMMANDS = {"impair": 1, "impair-down": 1, "impair-pair": 2}  # -> ports named


def _impair(line: str, ports: list[str]) -> Command:
    """`impair PORT SEED {"delay_ms": 20, ...}` (what PORT's device sends), `impair-down
    PORT SEED JSON` (what it receives), `impair-pair SRC DST SEED JSON`: the JSON is checked
    here, as profiles are."""
    name = line.split()[0]
    named = IMPAIR_COMMANDS[name]
    words = line.split(maxsplit=named + 2)
    usage = f"{name} {'SRC DST' if named == 2 else 'PORT'} SEED JSON"
    if len(words) != named + 3:
        raise ShapingError(f"{name}: expected '{usage}'")
    *places, seed, text = words[1:]
    for port in places:
        if port not in ports:
            raise ShapingError(f"{name}: unknown port {port!r} (ports: {', '.join(ports)})")
    where = f"{name} {' '.join(places)}"
    if not seed.isdigit():
        raise ShapingError(f"{where}: the seed must be a whole number >= 0, got {seed!r}")
    try:
        parameters = checked(json.loads(text))
    except (ValueError, TypeError, AttributeError) as error:  # ImpairmentError is a ValueError
        raise ShapingError(f"{where}: {error}") from None
    target = places[1] if named == 2 else None
    return Command(name, places[0], target=target, seed=int(seed), parameters=parameters)
