"""Dependency pins against what was measured: the CPU tests run the Triton kernels under the Triton
interpreter (TRITON_INTERPRET=1), and some triton/numpy pairs break it. A resolve that lands on one
is named here, instead of surfacing as dozens of kernel-test failures."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent

# (triton below, numpy from): numpy 2.4 made the conversion of an ndim > 0 array to a Python scalar
# (deprecated since 1.25) a TypeError, and the interpreter of triton < 3.7 does exactly that in
# tensor.__index__ ("only 0-dimensional arrays can be converted to Python scalars").
KNOWN_BROKEN = [(Version("3.7"), Version("2.4"))]

# Measured on torch 2.13.0+cpu, TRITON_INTERPRET=1: tests/test_rope.py for every pair, plus
# tests/test_dsa_indexer.py and tests/test_linear_cross_entropy.py where a third column is given.
MEASURED_WORKING = [
    ("3.6.0", "2.0.2"),
    ("3.6.0", "2.3.5"),  # also dsa + flce: 39 passed
    ("3.7.0", "2.4.6"),
    ("3.7.1", "2.4.6"),
    ("3.8.0", "2.4.6"),
    ("3.9.0", "2.0.2"),
    ("3.9.0", "2.3.5"),  # also dsa + flce: 39 passed
    ("3.9.0", "2.4.6"),
]
MEASURED_BROKEN = [("3.6.0", "2.4.6")]  # rope: 9 of 21 failed; dsa + flce: 19 of 39 failed


def interpreter_breakage(triton_version: str, numpy_version: str) -> str | None:
    """Why this triton/numpy pair breaks the Triton interpreter, or None if it is not known to."""
    tv, nv = Version(triton_version), Version(numpy_version)
    for triton_below, numpy_from in KNOWN_BROKEN:
        # Compare releases only, so local builds (3.6.0+git...) and pre-releases (2.4.0rc1) count too.
        if tv.release < triton_below.release and nv.release >= numpy_from.release:
            return (
                f"triton {triton_version} with numpy {numpy_version} breaks the Triton interpreter the CPU "
                f"tests use (triton < {triton_below} with numpy >= {numpy_from}: 'only 0-dimensional arrays "
                f"can be converted to Python scalars'); install triton >= {triton_below} or numpy < {numpy_from}"
            )
    return None


def _pins(requirements: list[str]) -> dict[str, SpecifierSet]:
    reqs = [Requirement(r) for r in requirements]
    return {r.name: r.specifier for r in reqs if r.name in ("triton", "numpy")}


def _pyproject_pins() -> dict[str, SpecifierSet]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return _pins(project["dependencies"])


def _environment_yml_pins() -> dict[str, SpecifierSet]:
    # environment.yml lists pip requirements as "      - name<spec>" lines; no YAML parser needed for those.
    lines = re.findall(r"^\s*-\s+((?:triton|numpy)\b\S*)\s*$", (REPO / "environment.yml").read_text(), re.M)
    return _pins(lines)


# Beyond the measured pair: a newer numpy, and a local triton build next to a numpy pre-release.
@pytest.mark.parametrize(
    ("triton_version", "numpy_version"), MEASURED_BROKEN + [("3.6.0", "2.5.0"), ("3.6.0+git1", "2.4.0rc1")]
)
def test_known_broken_pairs_are_named(triton_version: str, numpy_version: str) -> None:
    why = interpreter_breakage(triton_version, numpy_version)
    assert why is not None and f"triton {triton_version} with numpy {numpy_version}" in why


@pytest.mark.parametrize(("triton_version", "numpy_version"), MEASURED_WORKING)
def test_measured_working_pairs_pass(triton_version: str, numpy_version: str) -> None:
    assert interpreter_breakage(triton_version, numpy_version) is None


# Release lines a resolve could land on, wider than any sensible pin, to probe the pins with.
TRITON_PROBES = [f"3.{m}.0" for m in range(0, 13)] + ["4.0.0"]
NUMPY_PROBES = ["1.26.4"] + [f"2.{m}.0" for m in range(0, 10)] + ["3.0.0"]


def _line(version: str) -> tuple[int, ...]:
    return Version(version).release[:2]


@pytest.mark.parametrize("pins", [_pyproject_pins, _environment_yml_pins], ids=["pyproject", "environment.yml"])
def test_pins_admit_only_measured_ranges_and_no_broken_pair(pins: Callable[[], dict[str, SpecifierSet]]) -> None:
    spec = pins()
    assert spec.keys() == {"triton", "numpy"}, f"triton and numpy must both be pinned, found {dict(spec)}"
    assert spec == _pyproject_pins(), "environment.yml must pin triton and numpy as pyproject.toml does"
    triton_ok = [t for t in TRITON_PROBES if t in spec["triton"]]
    numpy_ok = [n for n in NUMPY_PROBES if n in spec["numpy"]]
    for t in triton_ok:
        for n in numpy_ok:
            assert interpreter_breakage(t, n) is None, f"the pins admit a broken pair: {interpreter_breakage(t, n)}"
    # Floors and caps are releases that were run: the oldest and newest admitted lines are measured ones.
    for name, admitted, measured in (
        ("triton", triton_ok, {_line(t) for t, _ in MEASURED_WORKING}),
        ("numpy", numpy_ok, {_line(n) for _, n in MEASURED_WORKING}),
    ):
        lines = sorted({_line(v) for v in admitted})
        assert lines, f"the {name} pin {spec[name]} admits no release"
        unmeasured = {lines[0], lines[-1]} - measured
        assert not unmeasured, f"the {name} pin {spec[name]} admits unmeasured release lines at its ends: {unmeasured}"


def test_installed_triton_numpy_pair_is_not_a_known_broken_one() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        # On a GPU the kernels are compiled; e.g. torch 2.11's triton 3.6 next to numpy 2.5 is fine there.
        pytest.skip("the Triton interpreter is not in use (TRITON_INTERPRET is not 1)")
    import numpy
    import triton

    why = interpreter_breakage(triton.__version__, numpy.__version__)
    assert why is None, why
