"""The typed-field checks every config and entry point shares, written once: an int is never a bool, and a
value that fails says which config and field, what was allowed and what came.

    check_ints("SSDConfig", config, ("d_model", "n_heads"))        # each an int >= 1
    check_int("TrainConfig", "seed", 3, low=0)
    if not is_int(top_k): ...
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["check_int", "check_ints", "config_error", "is_int"]


def config_error(config_name: str, field_name: str, allowed: str, got: object) -> ValueError:
    """The fail-closed message every config uses: it names the config, the field, what was allowed and the value."""
    return ValueError(f"{config_name}.{field_name} must be {allowed}, got {got!r}")


def is_int(value: object) -> bool:
    """An integer (a Python or numpy one) that is not a bool: True passes isinstance(value, int), and no count,
    size or index is ever a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(where: str, name: str, value: object, *, low: int | None = None, high: int | None = None,
              optional: bool = False) -> None:  # fmt: skip
    """Raise config_error('<where>.<name> must be an int >= low (or in [low, high]), got <value>') unless
    `value` is such an int (or None, when optional)."""
    if optional and value is None:
        return
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):  # type: ignore[operator]
        return
    if low is not None and high is not None:
        bound = f" in [{low}, {high}]"
    elif low is not None:
        bound = f" >= {low}"
    elif high is not None:
        bound = f" <= {high}"
    else:
        bound = ""
    raise config_error(where, name, f"an int{bound}{' or None' if optional else ''}", value)


def check_ints(where: str, config: Any, names: Iterable[str], *, low: int | None = 1) -> None:
    """check_int for several fields of one config object, read by name."""
    for name in names:
        check_int(where, name, getattr(config, name), low=low)
