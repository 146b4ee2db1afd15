"""The import arrows of docs/design.md, read from the source: a layer that reaches upward fails here by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megacpp_lab"

# package -> the megacpp_lab subpackages / modules it may import (besides itself)
ALLOWED = {
    "kernels": {"varlen"},
    "testing": {"varlen"},
    "data": {"varlen"},
    "nn": {"kernels", "store", "varlen"},
}


def _imports(path: Path, package: tuple[str, ...] | None = None) -> set[str]:
    """megacpp_lab.* modules a file imports, relative to the package ("varlen", "nn.mla", ...)."""
    found = set()
    if package is None:
        package = path.parent.relative_to(PACKAGE).parts  # e.g. ("nn",), or () for a top-level module
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against this file's package
            base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else ()
            found.add(".".join([*base, *(node.module.split(".") if node.module else [])]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megacpp_lab"):
            found.add(node.module.removeprefix("megacpp_lab").lstrip("."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("megacpp_lab.") for a in node.names if a.name.startswith("megacpp_lab.")}
    return found


def test_relative_imports_are_resolved_too(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from ..bench import loss\nfrom . import mla\n")
    assert _imports(probe, package=("nn",)) == {"bench", "nn"}


def test_varlen_imports_nothing_of_ours() -> None:
    """Below kernels/: importing it must not fix TRITON_INTERPRET (kernels/__init__ reads it once)."""
    assert _imports(PACKAGE / "varlen.py") == set()


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_design_allows(package: str) -> None:
    bad = []
    for path in sorted((PACKAGE / package).glob("*.py")):
        for module in _imports(path):
            if module == package or module.startswith(f"{package}."):
                continue
            if not any(module == ok or module.startswith(f"{ok}.") for ok in ALLOWED[package]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports megacpp_lab.{module}")
    assert not bad, "\n".join(bad)
