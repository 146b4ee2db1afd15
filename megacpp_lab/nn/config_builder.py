"""How configs are built (from a model config object plus overrides) and turned into command-line options.
How they fail closed is megacpp_lab/checks.py (config_error)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["Option", "build_config", "option", "options"]

C = TypeVar("C")


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


def option(default: Any = None, help: str = "", *, shown: str | None = None, factory: Any = None) -> Any:
    """A dataclass field that is also a command-line option: `help` says what it does, `shown` how its default
    reads in the help when the value alone would not say it (a None that means "the preset's")."""
    metadata = {"help": help, "shown": shown}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option generated from a config field: `--name` of `kind` (str, int or float), or for
    a bool an on/off switch (`--name` / `--no-name`), with its help ending in the field's default."""

    name: str
    kind: type
    help: str


_KINDS = {"str": str, "int": int, "float": float, "bool": bool}


def options(cls: type, *, skip: tuple[str, ...] = ()) -> list[Option]:
    """The command-line options of a frozen config dataclass: one per field made with `option()`, in field
    order, but those in `skip`. The kind comes from the annotation (`int | None` is int), the help from the
    field, and its default from the dataclass, so no option restates a field's type or default."""
    found = []
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if "help" not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name} has no help: declare it with option(default, help)")
        annotation = str(field.type).replace(" ", "").removesuffix("|None")
        if annotation not in _KINDS:
            raise TypeError(f"{cls.__name__}.{field.name}: no command-line option for a field of type {field.type}")
        kind = _KINDS[annotation]
        default = field.default
        shown = field.metadata["shown"] or ("on" if default is True else "off" if default is False else str(default))
        found.append(Option(field.name, kind, f"{field.metadata['help']} (default: {shown})"))
    return found
