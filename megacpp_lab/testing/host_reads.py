"""Host-side tripwires: a validated (PackedContext) path must never pull a tensor value to the host, and a custom
operator's launcher should dispatch no work beyond its kernels (every operator is host time in every step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LAUNCHER_PLUMBING", "launcher_operators", "no_host_reads"]

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


# operators that allocate, view or convert (and, under TRITON_INTERPRET on a CPU, the interpreter's own copies into and
# out of each launch): what any launcher dispatches; the rest is work it chose to do on the device
LAUNCHER_PLUMBING = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "set_", "copy_", "select", "slice", "view", "to", "_to_copy",
    "detach", "as_strided", "alias", "split", "split_with_sizes", "contiguous", "resolve_conj", "resolve_neg",
})  # fmt: skip


def launcher_operators(fn: Callable[[], Any], op: str) -> tuple[Any, list[str]]:
    """fn's result and the aten operators (names without 'aten::') that the first call of custom operator `op`
    ('megacpp::...') inside it dispatched directly, in order, read from a CPU-activity profile."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    calls = [e for e in prof.events() if e.name == op]
    if not calls:
        raise AssertionError(f"{op} was not called")
    # aten operators only: on a GPU the profile also records the driver's launch calls (cuLaunchKernelEx) there
    return out, [c.name.removeprefix("aten::") for c in calls[0].cpu_children if c.name.startswith("aten::")]
