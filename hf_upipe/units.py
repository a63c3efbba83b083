"""Sizes and lengths as people write them, read one way everywhere (CLI flags, `UPIPE_*`, Python arguments).

Entry points:
- `parse_size(value)`: bytes from "80GiB", "80GB", "75.5 GiB", "512MiB", "85899345920B"; a Python int is bytes.
  A bare number in text ("80") is refused: its unit is ambiguous (80 bytes? 80 GiB?), and the message says how to
  write it. Units: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024); case-insensitive.
- `parse_tokens(value)`: a sequence length from "1M", "512K", "1.5M", "1048576"; K = 2**10 and M = 2**20 tokens,
  as `hf-upipe plan` prints lengths. A length that is not a whole number of tokens is refused.
- `format_tokens(n)`: the short form `parse_tokens` reads back ("7M", "4.62M", "131072" -> "128K").
- `argument_type(parse)`: an argparse `type=` from one of the parsers above: a bad value is a usage error (exit 2)
  with the reason.

This module imports only the standard library.
"""

from __future__ import annotations

__all__ = ["argument_type", "format_tokens", "parse_size", "parse_tokens"]

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20}


def _split(text: str) -> tuple[str, str]:
    text = text.strip().lower().replace(" ", "").replace("_", "").replace(",", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    return number, text[len(number) :]


def parse_size(value) -> int:
    """Bytes (see the module docstring). Raises ValueError naming the value and how to write it."""
    if isinstance(value, bool):
        raise ValueError(f"cannot read {value!r} as a size")
    if isinstance(value, int):
        return value
    number, unit = _split(str(value))
    try:
        amount = float(number)
    except ValueError:
        amount = None
    if amount is None or amount < 0:
        raise ValueError(f"cannot read {value!r} as a size: write e.g. 80GiB, 80GB or 512MiB")
    if unit == "":
        raise ValueError(
            f"{value!r} has no unit: write 80GiB (2**30 bytes each) or 80GB (10**9), or {value}B for "
            "bytes"
        )
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"{value!r}: unknown unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(amount * _SIZE_UNITS[unit])


def parse_tokens(value) -> int:
    """A positive number of tokens (see the module docstring). Raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"cannot read {value!r} as a number of tokens")
    if isinstance(value, int):
        tokens = value
    else:
        number, unit = _split(str(value))
        try:
            amount = float(number)
        except ValueError:
            amount = None
        if amount is None or unit not in _TOKEN_UNITS:
            raise ValueError(
                f"cannot read {value!r} as a number of tokens: write e.g. 1048576, 1024K or 1M "
                "(K = 1024 tokens, M = 1048576)"
            )
        tokens = amount * _TOKEN_UNITS[unit]
        if tokens != int(tokens):
            raise ValueError(f"{value!r} is {tokens} tokens, not a whole number")
        tokens = int(tokens)
    if tokens < 1:
        raise ValueError(f"{value!r}: a length must be at least 1 token")
    return tokens


def format_tokens(n: int) -> str:
    """`n` tokens in the short form `parse_tokens` reads ("7M", "4.62M", "128K"), or the plain number."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % (size // 8) == 0:
            return f"{n / size:g}{unit}"
    return f"{n:,}"


def argument_type(parse):
    """An argparse type from a parser of this module: a bad value is a usage error (exit 2) with the reason."""
    import argparse

    def convert(text):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert
