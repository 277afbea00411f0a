"""Units of measure shared by every front end: one duration grammar, one way to name a choice.

A duration is a non-negative number of seconds, written either as a number (``0.1``, from a
TOML file or code) or as text: a decimal number with an optional exponent and an optional unit,
``us``/``µs``/``μs`` (microseconds), ``ms``, ``s`` or ``m`` (minutes), spaces allowed around
the number and unit. Examples: ``"2ms"``, ``"0.5 s"``, ``"250us"``, ``"1e-3"``, ``"10m"``.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import TypeVar

E = TypeVar("E", bound=StrEnum)

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|µs|μs|ms|s|m)?\s*$")
_SECONDS_PER_UNIT = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "m": 60.0}
_HELP = "a number of seconds with an optional unit us, ms, s or m, e.g. 2ms, 0.5s, 0.1"


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``"2ms"``, ``"0.5s"``, ``"250us"``, ``"1m"`` or a plain number of seconds.

    Raises ValueError for anything else: a negative or NaN value, an unknown unit, a boolean.
    """
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"not a duration: {text!r} ({_HELP})")
    if isinstance(text, str):
        m = _DURATION.match(text)
        if m is None:
            raise ValueError(f"not a duration: {text!r} ({_HELP})")
        value = float(m.group(1)) * _SECONDS_PER_UNIT[m.group(2)]
    else:
        value = float(text)
    if math.isnan(value) or value < 0:
        raise ValueError(f"duration must be a number >= 0: {text!r} ({_HELP})")
    return value


def parse_optional_duration(text: str | float | int | None) -> float | None:
    """A duration (:func:`parse_duration`), or None from ``"off"`` / ``"none"`` (the feature
    the duration paces is disabled)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("off", "none")):
        return None
    return parse_duration(text)


def parse_choice(choices: type[E], text: str, what: str) -> E:
    """The member of ``choices`` named ``text`` (case and surrounding spaces ignored); a
    ValueError naming ``what`` and every choice for anything else."""
    try:
        return choices(text.strip().lower())
    except ValueError:
        names = ", ".join(m.value for m in choices)
        raise ValueError(f"unknown {what} {text!r} (choose from {names})") from None
