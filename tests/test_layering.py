"""The import arrows of docs/design.md, read from the source: a layer that reaches upward fails here by name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megacpp_lab"

# package -> the megacpp_lab subpackages / modules it may import (besides itself)
ALLOWED = {
    "kernels": {"varlen"},
    "testing": {"varlen"},
    "data": {"varlen", "checks"},
    "nn": {"kernels", "store", "varlen", "checks"},
    "store": {"nn", "checks"},  # backends implement nn.table_store's TableBackend; nn imports no store module (checked below)
    # profiling: the saved-tensor count, no imports of ours; source_key: the source digest in model_fingerprint
    "model": {"nn", "kernels", "store", "data", "varlen", "profiling", "checks", "source_key"},
    # the regression packs reproduce bugs against the lab's own layers, as a benchmark does; nothing imports them
    # but the CLI. receipts: the commit stamped on a recorded lowering run
    "tripwires": {"model", "nn", "kernels", "varlen", "profiling", "receipts"},
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


def test_source_key_imports_nothing_of_ours() -> None:
    """The package's __init__ imports it to tag torch's compile caches: it must pull in no layer."""
    assert _imports(PACKAGE / "source_key.py") == set()


def test_checks_imports_nothing_of_ours() -> None:
    """The typed-field checks sit below every layer that validates a config (data, nn, store, model)."""
    assert _imports(PACKAGE / "checks.py") == set()


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


def _package_graph() -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its files import (top-level modules count as their own node)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        node = rel[0] if len(rel) > 1 else path.stem
        graph.setdefault(node, set()).update(m.split(".")[0] for m in _imports(path) if m and m.split(".")[0] != node)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_between_packages() -> None:
    """ALLOWED lets nn import store and store import nn; only one direction may exist (store -> nn today)."""
    cycle = _cycle(_package_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert "nn" in _package_graph()["store"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def test_nn_never_imports_model() -> None:
    """model/ may import nn/, never the other way round (a layer knows no model)."""
    assert "model" not in ALLOWED["nn"]
    bad = [f"{p.relative_to(PACKAGE.parent)} imports megacpp_lab.{m}" for p in sorted((PACKAGE / "nn").glob("*.py"))
           for m in _imports(p) if m == "model" or m.startswith("model.")]  # fmt: skip
    assert not bad, "\n".join(bad)


PUBLIC_API_PACKAGES = ("nn", "kernels", "model", "store")


def _api_modules() -> list[str]:
    return [f"megacpp_lab.{pkg}" + ("" if path.stem == "__init__" else f".{path.stem}")
            for pkg in PUBLIC_API_PACKAGES for path in sorted((PACKAGE / pkg).glob("*.py"))]  # fmt: skip


def test_the_api_census_sees_every_module() -> None:
    modules = _api_modules()
    assert {"megacpp_lab.nn", "megacpp_lab.nn.engram", "megacpp_lab.kernels.m2rnn", "megacpp_lab.model.config"} <= set(modules)


def test_every_module_of_nn_kernels_and_model_declares_its_public_api() -> None:
    """Each module defines __all__; every name in it exists, is public and is listed once."""
    problems = []
    for name in _api_modules():
        module = importlib.import_module(name)
        api = getattr(module, "__all__", None)
        if api is None:
            problems.append(f"{name} defines no __all__")
            continue
        if not isinstance(api, (list, tuple)) or not all(isinstance(n, str) for n in api):
            problems.append(f"{name}.__all__ must be a list of names, got {api!r}")
            continue
        problems += [f"{name}.__all__ names {n!r}, which the module does not define" for n in api if not hasattr(module, n)]
        problems += [f"{name}.__all__ names the private {n!r}" for n in api if n.startswith("_")]
        problems += [f"{name}.__all__ lists {n!r} twice" for n in sorted(set(api)) if api.count(n) > 1]
    assert not problems, "\n".join(problems)


def test_the_api_check_can_fail(monkeypatch) -> None:
    """The check above must catch a missing name and a private one."""
    import megacpp_lab.nn.engram as engram

    monkeypatch.setattr(engram, "__all__", [*engram.__all__, "no_such_name", "_fail"])
    with pytest.raises(AssertionError) as caught:
        test_every_module_of_nn_kernels_and_model_declares_its_public_api()
    assert "'no_such_name', which the module does not define" in str(caught.value)
    assert "the private '_fail'" in str(caught.value)
    monkeypatch.delattr(engram, "__all__")
    with pytest.raises(AssertionError, match="megacpp_lab.nn.engram defines no __all__"):
        test_every_module_of_nn_kernels_and_model_declares_its_public_api()
