"""How layer configs are built (from a model config object plus overrides) and how they fail closed."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["build_config", "config_error"]

C = TypeVar("C")


def config_error(config_name: str, field_name: str, allowed: str, got: object) -> ValueError:
    """The fail-closed message every layer config uses: it names the config, the field and the value."""
    return ValueError(f"{config_name}.{field_name} must be {allowed}, got {got!r}")


def build_config(cls: type[C], source: Any, overrides: dict[str, Any], *, prefix: str,
                 aliases: dict[str, tuple[str, ...]], required: tuple[str, ...]) -> C:  # fmt: skip
    """Fields of the frozen dataclass `cls` from `source` (for each field, the first attribute found among
    its aliases, else `<prefix>_<field>` or `<field>`), then `overrides`, else the defaults. Unknown or
    missing required fields fail closed, naming them."""
    fields = dict(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    values: dict[str, Any] = {}
    if source is not None:
        for name in fields:
            for attr in aliases.get(name, (f"{prefix}_{name}", name)):
                if hasattr(source, attr):
                    values[name] = getattr(source, attr)
                    break
    values.update(overrides)
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    missing = [n for n in required if n not in values]
    if missing:
        raise ValueError(f"{cls.__name__}.build needs {missing} (from the source config or as keywords)")
    return cls(**values)
