"""Checks and arithmetic shared by every place that takes a parallel size: one wording for one mistake.

``ElasticFT3D``, :class:`~lightning_ft.parallel.ParallelConfig` and :class:`~lightning_ft.parallel.ClusterShape` check
their sizes with :func:`check_positive_int`, so the same mistake raises the same exception with the same message
wherever it is made: ``TypeError`` for a value of the wrong type, ``ValueError`` for a value out of range, each
starting with the call as the user typed it (``ElasticFT3D(tensor_parallel_size='4'): expected ...``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_positive_int", "divisors", "render_call"]


def render_call(owner: str | None, **options: Any) -> str:
    """Options the way the user typed them: ``ElasticFT3D(tensor_parallel_size=3)``; without an owner,
    ``tensor_parallel_size=3``."""
    rendered = ", ".join(f"{name}={value!r}" for name, value in options.items())
    return f"{owner}({rendered})" if owner else rendered


def check_positive_int(owner: str | None, name: str, value: Any, *, allow_auto: bool = False) -> None:
    """Refuse ``value`` unless it is an int of at least 1 (or ``"auto"`` when ``allow_auto``).

    Args:
        owner: what the user called, e.g. ``"ElasticFT3D"``; prefixes the message. None: the option alone.
        name: the option's name as the user types it.
        value: the value given.
        allow_auto: also accept the string ``"auto"``.

    Raises:
        TypeError: ``value`` is not an int (a bool is not an int here), or is a string other than ``"auto"``:
            ``ElasticFT3D(pipeline_parallel_size='auto'): expected a positive int, got str``.
        ValueError: ``value`` is an int below 1: ``ElasticFT3D(data_parallel_size=0): must be at least 1``.
    """
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        expected = 'a positive int or "auto"' if allow_auto else "a positive int"
        raise TypeError(f"{render_call(owner, **{name: value})}: expected {expected}, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{render_call(owner, **{name: value})}: must be at least 1")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending: ``divisors(12) == [1, 2, 3, 4, 6, 12]``. O(sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
