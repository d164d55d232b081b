"""Words for numbers in messages: counts with their noun, byte sizes."""

from __future__ import annotations

IRREGULAR = {"is": "are", "was": "were", "process": "processes", "has": "have"}


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 step', '2 steps', '0 steps'; ``many`` gives an irregular plural
    (IRREGULAR knows a few: 'is' -> 'are')."""
    if n == 1:
        return f"{n:,} {word}"
    return f"{n:,} {many or IRREGULAR.get(word) or word + 's'}"


def verb(n: int, singular: str) -> str:
    """The verb agreeing with a count: verb(1, 'is') 'is', verb(3, 'is') 'are'."""
    return singular if n == 1 else IRREGULAR.get(singular, singular)


def format_bytes(n: float) -> str:
    """A byte count in the largest binary unit under 1024 of it: '4.7 GiB', '512 B'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
