"""hf_upipe settings as users write them: the `UPIPE_<FIELD>` environment fallbacks and the parsing of values.

Entry points:
- `env_setting(name)`: the stripped value of `UPIPE_<NAME>`, or None when unset or blank.
- `parse_bool(name, value)`, `parse_positive_int(name, value, allow_none=False, minimum=1)`: a setting's value
  from a Python value or its text, or a ValueError naming the setting and the values it takes.
- `parse_with(parse, name, value)`: `parse(value)`, its ValueError prefixed with `name=value`.
"""

from __future__ import annotations

import os

__all__ = ["env_setting", "parse_bool", "parse_positive_int", "parse_with"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_setting(name: str) -> str | None:
    """The value of `UPIPE_<NAME>` (stripped), or None when it is unset or blank."""
    value = os.environ.get(f"UPIPE_{name.upper()}")
    return None if value is None or value.strip() == "" else value.strip()


def parse_bool(name: str, value) -> bool:
    """A bool, or its text (1/true/yes/on, 0/false/no/off, any case); else a ValueError naming `name`."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}={value!r} is not a boolean: use one of {_TRUE + _FALSE}.")


def parse_with(parse, name: str, value):
    """`parse(value)`, a ValueError it raises prefixed with `name=value`."""
    try:
        return parse(value)
    except ValueError as err:
        raise ValueError(f"{name}={value!r}: {err}") from None


def parse_positive_int(name: str, value, allow_none: bool = False, minimum: int = 1):
    """An integer >= `minimum` (or None when `allow_none`), from an int, a whole float or its text; else a
    ValueError naming `name`."""
    if value is None and allow_none:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum or (isinstance(value, float) and value != number):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        got = "" if isinstance(value, (int, str)) else f" is a {type(value).__name__}:"
        raise ValueError(f"{name}={value!r}{got} must be {kind}.")
    return number
