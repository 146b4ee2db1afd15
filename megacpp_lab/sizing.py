"""One place that sizes every notebook and test: small on CPU, full on a GPU.

MEGACPP_LAB_SIZE=small|full overrides the choice (CI and `make tour` force small).
"""

from __future__ import annotations

import os
from typing import Literal, TypeVar

import torch

Scale = Literal["small", "full"]
T = TypeVar("T")
SIZE_ENV = "MEGACPP_LAB_SIZE"


def lab_scale() -> Scale:
    """'full' on a CUDA machine, 'small' otherwise, unless MEGACPP_LAB_SIZE says which."""
    raw = os.environ.get(SIZE_ENV, "")
    forced = raw.strip().lower()
    if forced:
        if forced not in ("small", "full"):
            raise ValueError(f"{SIZE_ENV} must be 'small' or 'full' (or unset), got {raw!r}")
        return forced  # type: ignore[return-value]
    return "full" if torch.cuda.is_available() else "small"


def lab_device() -> torch.device:
    """The device the notebooks run on: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def by_device(small: T, full: T) -> T:
    """Pick a problem size (or any value) for this machine: `small` on CPU, `full` on a GPU."""
    return full if lab_scale() == "full" else small
