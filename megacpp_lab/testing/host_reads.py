"""A tripwire for host reads: a validated (PackedContext) path must never pull a tensor value to the host."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["no_host_reads"]

_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Raise on every way a tensor value reaches the host (item, tolist, int/bool/float/index of a tensor):
    on a GPU each is a sync. On CPU there is no sync to detect, so this catches the reads themselves."""
    saved = {n: getattr(torch.Tensor, n) for n in _READS}

    def refuse(name: str):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read on the validated path: Tensor.{name} of a {tuple(self.shape)} tensor")

        return read

    try:
        for n in _READS:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
