"""megacpp_lab/checks.py: the typed-field checks every config shares fail closed, naming the config, the field,
what was allowed and what came; a bool is never an int, a numpy integer is."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megacpp_lab.checks import check_int, check_ints, is_int


def test_is_int_refuses_bools_and_floats_and_takes_numpy_integers():
    assert is_int(3) and is_int(np.int64(3)) and is_int(-1)
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(3.0) and not is_int("3") and not is_int(None)


@pytest.mark.parametrize("value, bounds, message", [
    (True, {}, r"Cfg\.n must be an int, got True"),
    (0, {"low": 1}, r"Cfg\.n must be an int >= 1, got 0"),
    (9, {"low": 0, "high": 8}, r"Cfg\.n must be an int in \[0, 8\], got 9"),
    (9, {"high": 8}, r"Cfg\.n must be an int <= 8, got 9"),
    ("x", {"low": 1, "optional": True}, r"Cfg\.n must be an int >= 1 or None, got 'x'"),
])  # fmt: skip
def test_check_int_names_the_field_the_bound_and_the_value(value, bounds, message):
    with pytest.raises(ValueError, match=message):
        check_int("Cfg", "n", value, **bounds)


def test_check_int_passes_what_fits_and_check_ints_reads_fields_by_name():
    check_int("Cfg", "n", 0, low=0, high=8)
    check_int("Cfg", "n", None, low=1, optional=True)
    check_ints("Cfg", SimpleNamespace(a=1, b=2), ("a", "b"))
    with pytest.raises(ValueError, match=r"Cfg\.b must be an int >= 1, got 0"):
        check_ints("Cfg", SimpleNamespace(a=1, b=0), ("a", "b"))
